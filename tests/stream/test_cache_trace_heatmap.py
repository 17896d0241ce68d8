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
