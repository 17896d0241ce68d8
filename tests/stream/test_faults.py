"""Bad bytes and bad stores: checksum retry, clear errors naming the blob, truncation, config mismatch, budget."""

from __future__ import annotations

import json
import shutil

import pytest

from k3serve.loading import load_model
from k3serve.stream.budget import BudgetError, plan_budget
from k3serve.stream.expert_cache import StoreCorruptError
from k3serve.stream.options import StreamOptions
from k3serve.weights.store import StoreError


def _copy(store, tmp_path):
    target = tmp_path / "store"
    shutil.copytree(store.path, target)
    return target


def test_a_corrupt_blob_is_refused_with_its_location(tiny_store, tmp_path):
    folder = _copy(tiny_store, tmp_path)
    offset = tiny_store.expert_offset(1, 3)
    with open(folder / "experts.bin", "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    model = load_model(folder, stream=StreamOptions(io="pread")).model
    with pytest.raises(StoreCorruptError) as info:
        for expert_ids in ([3], [0, 3]):
            model.source.experts(1, expert_ids)[3]
    message = str(info.value)
    assert "layer 1 expert 3" in message and "experts.bin" in message and f"offset {offset}" in message
    assert model.source.counters.checksum_retries == 1
    model.source.check_integrity()  # the bad slot was freed, not kept


def test_a_transient_corruption_is_reread_once(tiny_store):
    model = load_model(tiny_store.path, stream=StreamOptions(io="pread", cache="none")).model
    hits = []

    def flip_once(offset, buffer):
        if not hits:
            hits.append(offset)
            buffer[0] ^= 0xFF

    model.source.expert_io.fault = flip_once
    weights = model.source.experts(2, [5])[5]
    resident = load_model(tiny_store.path).model.source.experts(2, [5])[5]
    assert (weights.w1_packed == resident.w1_packed).all()
    assert model.source.counters.checksum_retries == 1


def test_io_errors_are_retried_then_reported(tiny_store):
    from k3serve.stream.io import StoreIOError

    model = load_model(tiny_store.path, stream=StreamOptions(io="pread", cache="none")).model
    failures = []

    def fail_once(offset, buffer):
        if not failures:
            failures.append(offset)
            raise OSError(5, "Input/output error")

    model.source.expert_io.fault = fail_once
    model.source.experts(1, [0])[0]  # retried, succeeds

    def always(offset, buffer):
        raise OSError(5, "Input/output error")

    model.source.expert_io.fault = always
    with pytest.raises(StoreIOError, match=r"layer 1 expert 1: .*experts.bin.*offset .*after 3 attempts"):
        model.source.experts(1, [1])[1]


def test_truncated_or_mismatched_stores_are_refused_at_load(tiny_store, tmp_path):
    folder = _copy(tiny_store, tmp_path)
    with open(folder / "experts.bin", "r+b") as f:
        f.truncate(tiny_store.expert_store_bytes - 4096)
    with pytest.raises(StoreError, match="truncated"):
        load_model(folder, stream=StreamOptions())
    folder2 = tmp_path / "other"
    shutil.copytree(tiny_store.path, folder2)
    config = json.loads((folder2 / "config.json").read_text())
    config["text_config"]["num_experts"] = 16
    (folder2 / "config.json").write_text(json.dumps(config))
    with pytest.raises(StoreError, match="does not match"):
        load_model(folder2, stream=StreamOptions())


def test_a_budget_too_small_names_the_minimum(tiny_store):
    with pytest.raises(BudgetError, match=r"minimum is .*--ram-budget (\d+)") as info:
        plan_budget(tiny_store, 100_000)
    minimum = int(str(info.value).split("--ram-budget ")[1].split()[0])
    plan = plan_budget(tiny_store, minimum)
    assert plan.total_bytes <= minimum and plan.expert_slots >= tiny_store.config.num_experts_per_token
    with pytest.raises(BudgetError):
        plan_budget(tiny_store, minimum - 1)


def test_trunk_comes_first_and_pin_cap_moves_the_split(tiny_store):
    generous = plan_budget(tiny_store, 4_000_000)
    capped = plan_budget(tiny_store, 4_000_000, pin_trunk_bytes=0)
    assert len(generous.pinned_layers) > 0 and capped.pinned_layers == ()
    assert capped.expert_slots > generous.expert_slots
    assert generous.total_bytes <= 4_000_000 and capped.total_bytes <= 4_000_000


def test_a_missing_expert_file_is_reported_missing_not_truncated(tiny_store, tmp_path):
    folder = _copy(tiny_store, tmp_path)
    (folder / "experts.bin").unlink()
    with pytest.raises(StoreError, match="experts.bin is missing") as info:
        load_model(folder, stream=StreamOptions())
    assert "truncated" not in str(info.value)


def test_a_cache_profile_from_another_model_is_refused(tiny_store, tmp_path):
    from k3serve.stream.trace import TraceError, TraceWriter, trace_meta

    config = tiny_store.config
    own, other = tmp_path / "own.trace", tmp_path / "other.trace"
    TraceWriter(own, trace_meta(config)).close()
    meta = {**trace_meta(config), "num_experts": config.num_experts * 2}
    TraceWriter(other, meta).close()
    pinned = dict(cache="pinned", ram_budget=None)
    load_model(tiny_store.path, stream=StreamOptions(cache_profile=own, **pinned))  # its own model: accepted
    with pytest.raises(TraceError, match="--cache-profile .* another model: num_experts"):
        load_model(tiny_store.path, stream=StreamOptions(cache_profile=other, **pinned))


# ---- the injecting reader (stream/faults.py) in the engine -----------------------------------------------------
def _engine_over(store_path, stream=None):
    from k3serve.engine.config import EngineConfig
    from k3serve.engine.engine import LLMEngine
    from k3serve.stream.options import StreamOptions as Options

    loaded = load_model(store_path, stream=stream or Options(io="pread", cache="none"))
    return LLMEngine(loaded.model, EngineConfig(block_size=4, num_blocks=128, max_model_len=128, max_seqs=4,
                                                enable_prefix_caching=False)), loaded.model.source


def _drive(engine, source, prompts, max_tokens=6) -> list:
    from k3serve.engine.sampling import SamplingParams

    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_integrity()
        source.check_integrity()
    return [final[i] for i in ids]


PROMPTS = [[1, 5, 9, 200, 17], [3, 44, 120, 7]]


def test_short_reads_are_completed_and_change_nothing(tiny_store):
    from k3serve.stream.faults import FaultyReads

    expected = load_model(tiny_store.path).model.greedy(PROMPTS[0], 6)
    model = load_model(tiny_store.path, stream=StreamOptions(io="pread", cache="none")).model
    injector = FaultyReads(max_bytes_per_call=1000)
    model.source.expert_io.preadv = injector
    model.source.trunk_io.preadv = injector
    assert model.greedy(PROMPTS[0], 6) == expected
    assert injector.num_short > 0


def test_counted_eio_failures_land_on_one_read_whatever_the_thread_order(tmp_path):
    """Two reads interleaved on reader threads: the first to touch the range takes all `times` failures, so it
    fails after 3 attempts and the other is never failed (before, each could take some and both succeed)."""
    import errno
    import os

    from k3serve.stream.faults import FaultyReads

    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 64)
    fd = os.open(path, os.O_RDONLY)
    try:
        inject = FaultyReads(eio_range=(0, 1 << 20), times=3)
        outcomes = []
        for offset in (0, 4096, 0, 4096, 0, 4096):  # the order two threads' retries could take
            try:
                inject(fd, [bytearray(512)], offset)
                outcomes.append((offset, "ok"))
            except OSError as exc:
                assert exc.errno == errno.EIO
                outcomes.append((offset, "eio"))
        assert [o for o in outcomes if o[1] == "eio"] == [(0, "eio")] * 3
        assert all(result == "ok" for offset, result in outcomes if offset == 4096)
        assert inject.num_failed == 3 and inject.failing_offset == 0
    finally:
        os.close(fd)


def test_an_eio_fails_the_request_alone_and_the_engine_keeps_serving(tiny_store):
    from k3serve.stream.faults import FaultyReads

    clean_engine, clean_source = _engine_over(tiny_store.path)
    expected = [out.outputs[0].token_ids for out in _drive(clean_engine, clean_source, PROMPTS)]
    engine, source = _engine_over(tiny_store.path)
    whole_file = (0, tiny_store.expert_store_bytes)
    # alone: the read fails after its 3 attempts -> that request fails with the read named; the next one is served
    source.expert_io.preadv = FaultyReads(eio_range=whole_file, times=3)
    failed = _drive(engine, source, PROMPTS[:1])[0]
    assert failed.error is not None and "experts.bin" in failed.error and "after 3 attempts" in failed.error
    assert failed.outputs[0].finish_reason.value == "error"
    assert [out.outputs[0].token_ids for out in _drive(engine, source, PROMPTS)] == expected
    # in a batch: the failed forward is recomputed per request, so neither is lost to the other's bad luck
    source.expert_io.preadv = FaultyReads(eio_range=whole_file, times=3)
    outs = _drive(engine, source, PROMPTS)
    assert [out.error for out in outs] == [None, None]
    assert [out.outputs[0].token_ids for out in outs] == expected
    assert engine.metrics.counter("forward_failures").value == 2


def test_a_store_replaced_or_truncated_under_a_running_engine(tiny_store, tmp_path):
    folder = _copy(tiny_store, tmp_path)
    engine, source = _engine_over(folder)
    expected = [out.outputs[0].token_ids for out in _drive(engine, source, PROMPTS)]
    experts = folder / "experts.bin"
    original = experts.read_bytes()
    # replaced by rename (how a deploy swaps files): the open descriptor keeps reading the old file, unchanged
    (folder / "experts.new").write_bytes(bytes(len(original)))
    (folder / "experts.new").replace(experts)
    assert [out.outputs[0].token_ids for out in _drive(engine, source, PROMPTS)] == expected
    # rewritten in place, truncated: each request fails with a clear error, the engine itself keeps running
    engine2, source2 = _engine_over(_copy(tiny_store, tmp_path / "b"))
    path2 = source2.store.expert_path
    with open(path2, "r+b") as f:
        f.truncate(4096)
    outs = _drive(engine2, source2, PROMPTS)
    assert all(out.error is not None and ("short read" in out.error or "truncated" in out.error) for out in outs)
    path2.write_bytes(original)  # the file is whole again: the same engine serves again, no restart
    assert [out.outputs[0].token_ids for out in _drive(engine2, source2, PROMPTS)] == expected
