"""Policies, traces, the co-activation heatmap PNG, and the streaming CLI commands."""

from __future__ import annotations

import struct
import zlib

import numpy as np

from k3serve.cli.main import main
from k3serve.stream.cache import LRUPolicy, PinnedPolicy, S3FIFOPolicy
from k3serve.cli.heatmap import heatmap_rgb, write_png
from k3serve.stream.trace import read_trace


def test_lru_and_pinned_never_evict_protected_or_hot_keys():
    lru = LRUPolicy()
    for key in "abc":
        lru.admit(key)
    lru.touch("a")
    assert lru.victim(protected={"b"}) == "c"
    pinned = PinnedPolicy(hot={"h"})
    pinned.admit("h")
    pinned.admit("x")
    assert pinned.victim(protected=set()) == "x"


def test_s3fifo_keeps_a_key_hit_while_resident():
    s3 = S3FIFOPolicy(capacity=10)
    for key in range(10):
        s3.admit(key)
    s3.touch(0)
    victim = s3.victim(protected=set())
    assert victim != 0


def test_trace_records_every_token_and_layer(tiny_trace, tiny_store):
    trace = read_trace(tiny_trace)
    config = tiny_store.config
    assert trace.num_tokens == 5 + 11  # prompt + decode steps (the last sampled token is never fed back)
    assert len(trace.records) == trace.num_tokens * len(config.moe_layer_ids)
    assert all(len(ids) == config.num_experts_per_token for _, _, _, ids in trace.records)


def test_png_is_valid(tmp_path):
    path = tmp_path / "h.png"
    matrix = np.arange(16).reshape(4, 4)
    write_png(path, heatmap_rgb(matrix, cell=2))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (8, 8)
    idat_len = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41:41 + idat_len])
    assert len(raw) == height * (1 + width * 3)


def test_cli_pack_sim_and_coactivation(tiny_dir, tiny_trace, tmp_path, capsys):
    out = tmp_path / "co"
    assert main(["pack", str(tiny_dir), str(out), "--layout", "coactivation", "--trace", str(tiny_trace)]) == 0
    assert main(["sim", "cache", str(tiny_trace), "--capacity", "4,16"]) == 0
    printed = capsys.readouterr().out
    assert "belady" in printed and "s3fifo" in printed
    assert main(["coactivation", str(tiny_trace), "--out", str(tmp_path / "maps")]) == 0
    assert (tmp_path / "maps" / "layer_001.png").exists() and (tmp_path / "maps" / "layer_001.npy").exists()
    ids = "1,5,9,200"
    for extra in ([], ["--ram-budget", "2M", "--io", "direct", "--cache", "lfu", "--prefetch", "next-layer"]):
        assert main(["logits", "--model", str(out), "--ids", ids, "--out", str(tmp_path / "l.npy"), *extra]) == 0
    assert main(["logits", "--model", str(out), "--ids", ids, "--out", str(tmp_path / "l.npy"),
                 "--ram-budget", "10K"]) == 2
    assert "minimum" in capsys.readouterr().err


# --- issue 32, item 18: bad trace files are one clear error naming the file, never a traceback

def _binary_trace(tmp_path):
    path = tmp_path / "binary.trace"
    path.write_bytes(bytes(range(256)) * 8)  # not UTF-8
    return path


def test_a_binary_file_given_as_a_trace_is_a_typed_error_naming_it(tmp_path):
    from k3serve.stream.trace import TraceError

    path = _binary_trace(tmp_path)
    try:
        read_trace(path)
    except TraceError as exc:
        assert str(path) in str(exc) and "binary" in str(exc)
    else:
        raise AssertionError("a binary trace was read")


def _trace_commands(tiny_dir, tiny_store, trace, tmp_path):
    return {
        "sim cache": ["sim", "cache", str(trace), "--capacity", "4"],
        "sim k3": ["sim", "k3", "--routing-trace", str(trace)],
        "coactivation": ["coactivation", str(trace), "--out", str(tmp_path / "maps")],
        "pack --trace": ["pack", str(tiny_dir), str(tmp_path / "packed"), "--layout", "frequency", "--trace",
                         str(trace)],
        "generate --cache-profile": ["generate", "--model", str(tiny_store.path), "--prompt-ids", "1,2",
                                     "--max-tokens", "1", "--cache", "pinned", "--cache-profile", str(trace)],
    }


def test_every_command_that_reads_a_trace_refuses_a_binary_file_in_one_line(tiny_dir, tiny_store, tmp_path, capsys):
    trace = _binary_trace(tmp_path)
    for name, argv in _trace_commands(tiny_dir, tiny_store, trace, tmp_path).items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("k3serve: error: ") and str(trace) in err and err.count("\n") == 1, (name, err)


def _out_of_range_trace(tiny_trace, tmp_path):
    lines = tiny_trace.read_text().splitlines()
    meta = read_trace(tiny_trace).meta
    step, token, layer, *_ = lines[1].split()
    ids = [str(meta["num_experts"] + 3)] + ["0"] * (meta["top_k"] - 1)
    path = tmp_path / "bad-id.trace"
    path.write_text("\n".join([lines[0], lines[1], " ".join([step, token, layer, *ids]), *lines[2:]]) + "\n")
    return path, meta["num_experts"] + 3


def test_an_expert_id_past_the_expert_count_is_refused_by_sim_cache_and_coactivation(tiny_trace, tmp_path, capsys):
    path, bad_id = _out_of_range_trace(tiny_trace, tmp_path)
    for argv in (["sim", "cache", str(path), "--capacity", "4"], ["coactivation", str(path), "--out",
                                                                  str(tmp_path / "maps")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{path}:3" in err and f"expert id {bad_id}" in err and "num_experts" in err, err


def test_sim_cache_warns_that_a_routing_stats_trace_has_no_decode_step(tiny_model, tiny_trace, tmp_path, capsys):
    from k3serve.lab.routing_stats import measure_routing
    from k3serve.stream.trace import TraceWriter, trace_meta

    stats_trace = tmp_path / "stats.trace"  # what `routing-stats --trace-out` writes: one prefill step per window
    writer = TraceWriter(stats_trace, trace_meta(tiny_model.config))
    measure_routing(tiny_model, [[1, 5, 9, 200, 17, 3, 88, 41], [2, 250, 7, 9, 11, 13]], writer)
    writer.close()
    assert main(["sim", "cache", str(stats_trace), "--capacity", "4"]) == 0
    assert "holds no decode step" in capsys.readouterr().err
    assert main(["sim", "cache", str(tiny_trace), "--capacity", "4"]) == 0  # a generation's trace: no warning
    assert "warning" not in capsys.readouterr().err
