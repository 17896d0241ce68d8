"""The prefix cache's disk tier: checkpoints that leave RAM are written whole (rows, state, logits), a later hit
restores them with the tokens of a miss, and a corrupt, truncated, foreign or half-written entry is never used."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.metrics import MetricsRegistry
from k3serve.engine.prefix_cache import root_hash
from k3serve.engine.prefix_disk import SUFFIX, TEMP_MARK, CheckpointPayload, PrefixDiskTier
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import ConfigError
from k3serve.model.cache import CacheLayout

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPT_A = [1, 17, 200, 45, 3, 99, 128, 7, 250, 64, 31, 5, 180, 77, 12, 240, 33, 90]
PROMPT_B = [2, 8, 111, 222, 33, 44, 55, 66, 77, 88, 99, 101, 102, 103, 104, 105]
PROMPT_C = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
LAYOUT = CacheLayout({0: 6, 2: 4}, {1: ((2, 3, 3), (2, 5))})


def _engine(model, folder: Path, identity: str = "tiny", **overrides) -> LLMEngine:
    settings = dict(block_size=4, num_blocks=256, max_batch_tokens=64, max_seqs=4, num_state_checkpoints=2,
                    prefix_cache_dir=str(folder), prefix_cache_disk_bytes=64 << 20)
    settings.update(overrides)
    return LLMEngine(model, EngineConfig(**settings), model_identity=identity)


def _run(engine, drive, prompt, params=GREEDY, **kwargs):
    request_id = engine.add_request(prompt, params, **kwargs)
    out = drive(engine)[request_id]
    return out.outputs[0].token_ids, out.num_cached_tokens


def _evicted_to_disk(engine, drive, prompt=PROMPT_A) -> list[int]:
    """Run `prompt`, then two others that push its checkpoints out of RAM (2 slots): returns its tokens."""
    tokens, _ = _run(engine, drive, prompt)
    _run(engine, drive, PROMPT_B)
    _run(engine, drive, PROMPT_C)
    return tokens


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*" + SUFFIX))


def _counter(engine, name: str) -> float:
    return engine.metrics.counter(name, "").value


def test_an_evicted_checkpoint_is_restored_from_disk_with_the_tokens_of_a_miss(tiny_model, drive, tmp_path):
    engine = _engine(tiny_model, tmp_path)
    reply = _evicted_to_disk(engine, drive)
    assert _counter(engine, "prefix_cache_disk_writes") >= 2 and _files(tmp_path)
    assert engine.scheduler.prefix_cache.checkpoint_positions() and all(
        p != len(PROMPT_A) for p in engine.scheduler.prefix_cache.checkpoint_positions())
    turn = PROMPT_A + reply + [9, 19, 29]
    tokens, cached = _run(engine, drive, turn)
    assert cached == len(PROMPT_A) + len(reply) - 1  # the reply's last computed position, from disk
    assert _counter(engine, "prefix_cache_disk_hits") == 1
    cold = LLMEngine(tiny_model, EngineConfig(block_size=4, num_blocks=256, enable_prefix_caching=False))
    assert tokens == _run(cold, drive, turn)[0] == tiny_model.greedy(turn, 4)


def test_an_exact_repeat_restored_from_disk_samples_without_a_forward(tiny_model, drive, tmp_path):
    engine = _engine(tiny_model, tmp_path)
    reply = _evicted_to_disk(engine, drive)
    computed = _counter(engine, "computed_tokens")
    tokens, cached = _run(engine, drive, PROMPT_A, SamplingParams(max_tokens=1, ignore_eos=True))
    assert cached == len(PROMPT_A) and tokens == reply[:1]
    assert _counter(engine, "computed_tokens") == computed  # the logits came from the file


def test_a_restart_on_the_same_folder_hits_and_another_model_ignores_it(tiny_model, drive, tmp_path):
    first = _engine(tiny_model, tmp_path)
    reply = _evicted_to_disk(first, drive)
    turn = PROMPT_A + reply + [4, 4]
    restarted = _engine(tiny_model, tmp_path)
    assert restarted.scheduler.prefix_cache.disk.num_entries == len(_files(tmp_path))
    tokens, cached = _run(restarted, drive, turn)
    assert cached == len(PROMPT_A) + len(reply) - 1 and tokens == tiny_model.greedy(turn, 4)
    other = _engine(tiny_model, tmp_path, identity="another store")
    assert other.scheduler.prefix_cache.disk.num_entries == 0
    assert _run(other, drive, turn)[1] == 0
    assert _files(tmp_path), "another model's start leaves the entries alone"


def test_tenants_and_salts_never_share_a_disk_entry(tiny_model, drive, tmp_path):
    engine = _engine(tiny_model, tmp_path)
    reply = _evicted_to_disk(engine, drive)
    turn = PROMPT_A + reply + [3]
    assert _run(engine, drive, turn, tenant="other")[1] == 0
    assert _run(engine, drive, turn, cache_salt="s")[1] == 0
    assert _counter(engine, "prefix_cache_disk_hits") == 0


@pytest.mark.parametrize("damage", ["flip-payload", "truncate", "flip-header"])
def test_a_corrupt_or_truncated_entry_is_a_miss_and_is_removed(tiny_model, drive, tmp_path, damage):
    engine = _engine(tiny_model, tmp_path)
    reply = _evicted_to_disk(engine, drive)
    damaged = {path.stem for path in _files(tmp_path)}
    for path in _files(tmp_path):
        data = bytearray(path.read_bytes())
        if damage == "flip-payload":
            data[4096 + 5] ^= 0xFF
        elif damage == "flip-header":
            data[60] ^= 0xFF
        else:
            data = data[:len(data) // 2]
        path.write_bytes(bytes(data))
    turn = PROMPT_A + reply + [9, 19]
    tokens, cached = _run(engine, drive, turn)
    assert cached == 0 and tokens == tiny_model.greedy(turn, 4)  # a miss, never a wrong answer
    assert _counter(engine, "prefix_cache_disk_corrupt") >= 1
    restarted = _engine(tiny_model, tmp_path)
    disk = restarted.scheduler.prefix_cache.disk
    assert disk.num_entries == len(_files(tmp_path))
    assert _run(restarted, drive, turn)[0] == tokens
    for entry in [e for group in list(disk._index.values()) for e in list(group.values())]:
        # a start reads headers and lengths only: a damaged payload is found when it is read, and removed
        assert disk.read(entry) is not None or (damage == "flip-payload" and entry.key in damaged)
    assert all(disk.read(e) is not None for group in list(disk._index.values()) for e in list(group.values()))


def _payload(position: int, seed: int, logits: bool = True) -> CheckpointPayload:
    rng = np.random.default_rng(seed)
    return CheckpointPayload(rng.standard_normal((2, position, 6), dtype=np.float32),
                             [rng.standard_normal((2, 3, 3), dtype=np.float32)],
                             [rng.standard_normal((2, 5), dtype=np.float32)],
                             rng.standard_normal(11, dtype=np.float32) if logits else None)


def test_the_tier_round_trips_a_payload_and_evicts_by_its_byte_budget(tmp_path):
    tier = PrefixDiskTier(tmp_path, 3 * 8192, LAYOUT, "m", "slru", MetricsRegistry())
    root = root_hash("t", None)
    payloads = {i: _payload(5 + i, i, logits=i % 2 == 0) for i in range(4)}
    for i, payload in payloads.items():
        assert tier.write(root, bytes([i]) * 16, (i, i + 1), 5 + i, payload, protected=False)
        tier.check_integrity()
    assert tier.num_entries == 3 and len(_files(tmp_path)) == 3 and tier.used_bytes == 3 * 8192
    assert not tier.contains(bytes([0]) * 16, (0, 1))  # the least recent went first
    entry = tier.group(bytes([3]) * 16)[(3, 4)]
    got = tier.read(entry)
    want = payloads[3]
    assert np.array_equal(got.rows, want.rows) and np.array_equal(got.states[0], want.states[0])
    assert np.array_equal(got.conv_tails[0], want.conv_tails[0]) and got.logits is None
    assert np.array_equal(tier.read(tier.group(bytes([2]) * 16)[(2, 3)]).logits, payloads[2].logits)


def test_a_disk_hit_protects_an_entry_as_the_ram_tier_does(tmp_path):
    tier = PrefixDiskTier(tmp_path, 3 * 8192, LAYOUT, "m", "slru", MetricsRegistry())
    root = root_hash("t", None)
    for i in range(3):
        tier.write(root, bytes([i]) * 16, (i,), 4 * i + 1, _payload(4 * i + 1, i), protected=False)
    oldest = tier.group(bytes([0]) * 16)[(0,)]
    tier.hit(oldest, fork=True)  # a fork protects it: the next write evicts entry 1 instead
    tier.write(root, bytes([9]) * 16, (9,), 1, _payload(1, 9), protected=False)
    assert tier.contains(bytes([0]) * 16, (0,)) and not tier.contains(bytes([1]) * 16, (1,))
    tier.check_integrity()


def test_a_disk_tier_needs_the_model_identity_and_a_size(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="identity"):
        LLMEngine(tiny_model, EngineConfig(prefix_cache_dir=str(tmp_path), prefix_cache_disk_bytes=1 << 20))
    with pytest.raises(ConfigError, match="prefix_cache_disk_bytes"):
        EngineConfig(prefix_cache_dir=str(tmp_path))


WRITER = """
import os, sys, time
import numpy as np
from k3serve.engine import prefix_disk
from k3serve.engine.metrics import MetricsRegistry
from k3serve.engine.prefix_cache import root_hash
from k3serve.engine.prefix_disk import CheckpointPayload, PrefixDiskTier
from k3serve.model.cache import CacheLayout
folder, stop = sys.argv[1], sys.argv[2]  # stop: none, mid-data or before-rename (of the 4th entry)
count = [0]
real_write, real_replace = os.write, os.replace

def hold():
    print("holding", flush=True)
    time.sleep(600)

def write(fd, data):
    if stop == "mid-data" and count[0] == 3 and len(data) > 8192:
        real_write(fd, data[:len(data) // 2])
        hold()
    return real_write(fd, data)

def replace(a, b):
    if stop == "before-rename" and count[0] == 3:
        hold()
    return real_replace(a, b)

os.write, os.replace = write, replace
layout = CacheLayout({0: 256}, {1: ((4, 16, 16), (2, 8))})
tier = PrefixDiskTier(folder, 1 << 34, layout, "m", "slru", MetricsRegistry())
for i in range(10 ** 6):
    rows = np.full((1, 4096, 256), i % 251, np.float32)  # 4 MiB per entry
    tier.write(root_hash("t", None), i.to_bytes(16, "little"), (i,), 4096, CheckpointPayload(
        rows, [np.full((4, 16, 16), i, np.float32)], [np.full((2, 8), i, np.float32)], None), protected=False)
    count[0] += 1
    print(i, flush=True)
"""


@pytest.mark.parametrize("stop", ["mid-data", "before-rename", "none"])
def test_kill_9_during_writes_then_a_restart_hits_only_whole_entries(tmp_path, stop):
    """A writer killed while it writes an entry's data, before its rename, or at a random point leaves at most a
    temporary file; the restart removes it and every entry it indexes reads back whole (its checksum holds and its
    values are the writer's)."""
    layout = CacheLayout({0: 256}, {1: ((4, 16, 16), (2, 8))})
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), stop], stdout=subprocess.PIPE, env=env,
                              text=True)
    written = []
    while len(written) < 3:
        written.append(int(writer.stdout.readline()))
    if stop == "none":
        time.sleep(0.01 * (os.getpid() % 7))  # somewhere inside the next writes
    else:
        assert writer.stdout.readline().strip() == "holding"  # inside the 4th write
        assert list(tmp_path.glob("*" + TEMP_MARK + "*"))
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    tier = PrefixDiskTier(tmp_path, 1 << 34, layout, "m", "slru", MetricsRegistry())
    assert not list(tmp_path.glob("*" + TEMP_MARK + "*"))
    entries = [entry for group in tier._index.values() for entry in group.values()]
    indexed = {int.from_bytes(e.parent, "little") for e in entries}
    assert indexed >= set(written)
    if stop != "none":
        assert indexed == set(written)  # the held write never became an entry
    for entry in entries:
        i = int.from_bytes(entry.parent, "little")
        payload = tier.read(entry)
        assert payload is not None and payload.rows.shape == (1, 4096, 256)
        assert payload.rows[0, -1, -1] == i % 251 and payload.states[0][0, 0, 0] == i
    assert tier.num_entries == len(_files(tmp_path))


def test_a_temporary_file_of_a_live_writer_is_left_alone(tmp_path):
    alive = tmp_path / f"{'0' * 32}{SUFFIX}{TEMP_MARK}1"  # pid 1 is always alive
    dead = tmp_path / f"{'1' * 32}{SUFFIX}{TEMP_MARK}999999999"
    for path in (alive, dead):
        path.write_bytes(b"K3PC" + b"\0" * 100)
    PrefixDiskTier(tmp_path, 1 << 20, LAYOUT, "m", "slru", MetricsRegistry())
    assert alive.exists() and not dead.exists()


def test_a_checkpoint_protected_in_ram_stays_protected_on_disk(tiny_model, drive, tmp_path):
    """The two tiers share the segmented policy: a checkpoint that recurred (a fork at it) and leaves RAM while
    protected (the blocks under it were reused) enters disk's protected segment."""
    engine = _engine(tiny_model, tmp_path, num_state_checkpoints=3, num_blocks=16)
    cache = engine.scheduler.prefix_cache
    _run(engine, drive, PROMPT_A)
    _run(engine, drive, PROMPT_A + [7, 7])
    _run(engine, drive, PROMPT_A + [8, 8])  # parts from the last one at len(PROMPT_A): a fork, protected
    parent, tail = next((c.parent, c.tail) for c in cache._recency.protected.values()
                        if c.position == len(PROMPT_A))
    for k in range(8):  # other prompts take the blocks under it
        _run(engine, drive, [k + 3] + PROMPT_C[k:])
    assert tail not in cache._index.get(parent, {})  # it left RAM
    assert cache.disk.group(parent)[tail].key in cache.disk._segments.protected
    assert _run(engine, drive, PROMPT_A + [9, 9])[1] == len(PROMPT_A)  # and it hits from there


def test_a_long_tail_header_spans_pages_and_round_trips(tmp_path):
    """A block size of 1,024 gives tails of up to 1,023 tokens: 8 KiB of header."""
    tier = PrefixDiskTier(tmp_path, 1 << 20, LAYOUT, "m", "lru", MetricsRegistry())
    tail = tuple(range(700))
    payload = _payload(1024 + 700, 3)
    assert tier.write(root_hash("t", None), b"p" * 16, tail, 1024 + 700, payload, protected=False)
    restarted = PrefixDiskTier(tmp_path, 1 << 20, LAYOUT, "m", "lru", MetricsRegistry())
    got = restarted.read(restarted.group(b"p" * 16)[tail])
    assert got is not None and np.array_equal(got.rows, payload.rows)


def test_a_failed_write_drops_the_checkpoint_and_keeps_the_entries(tmp_path, monkeypatch):
    """A full disk (ENOSPC) costs the one checkpoint: nothing is evicted for it, no file is left, it is counted."""
    import errno

    metrics = MetricsRegistry()
    tier = PrefixDiskTier(tmp_path, 2 * 8192, LAYOUT, "m", "slru", metrics)
    root = root_hash("t", None)
    for i in range(2):
        assert tier.write(root, bytes([i]) * 16, (i,), 5, _payload(5, i), protected=False)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    assert not tier.write(root, b"x" * 16, (9,), 5, _payload(5, 9), protected=False)
    assert tier.num_entries == 2 and len(list(tmp_path.iterdir())) == 2
    assert metrics.counter("prefix_cache_disk_write_failures", "").value == 1
    tier.check_integrity()
