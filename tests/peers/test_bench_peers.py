"""benchmarks/bench_peers.py end to end on the smoke fixture: the harness builds a family checkpoint and its GGUF with
llama.cpp's own converter, runs both engines in alternated fresh processes under two wait policies, and reports
every shape (prefill, decode at batch 1 and 8, peak RSS) at each engine's defaults and at its best policy.

Needs the `peers` extra and llama.cpp's converter (the llama-cpp-python 0.3.36 sdist, as the other tests here);
skips without the extra, fails with the extra but no converter. About a minute on 2 cores. Speed is not asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="the peers extra is not installed (pip install -e '.[peers]')")

from k3serve.lab import peers  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_peers.py"


def test_the_peers_matrix_runs_end_to_end_on_the_smoke_fixture(tmp_path):
    try:
        tree = peers.converter_tree(tmp_path / "llama_cpp_src")
    except peers.PeerUnavailable as error:
        pytest.fail(f"the peers extra is installed but {error}")
    out = tmp_path / "record.json"
    env = {**os.environ, "K3BENCH_DIR": str(tmp_path / "bench"), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--targets", "qwen3_moe", "--precisions", "int8",
                           "--llama-tree", str(tree), "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["benchmark"] == "peers_matrix" and record["policies"] == ["default", "PASSIVE"]
    (result,) = record["results"]
    assert result["target"] == "qwen3_moe smoke" and set(result["ggufs"]) == {"Q8_0"}
    assert Path(result["ggufs"]["Q8_0"]).stat().st_size > 0
    figures = ["prefill_64_tok_s", "decode_b1_tok_s", "decode_b8_tok_s", "peak_rss_mib"]
    runs = [key for key in result["all_runs"]]
    assert runs == ["k3serve int8 default", "llama.cpp Q8_0 default", "k3serve int8 PASSIVE",
                    "llama.cpp Q8_0 PASSIVE"]  # engines alternated within each policy
    for key, rs in result["all_runs"].items():
        assert len(rs) == 1 and "error" not in rs[0], (key, rs)
        assert all(math.isfinite(rs[0][f]) and rs[0][f] > 0 for f in figures)
    row = result["pairs"]["int8 vs Q8_0"]
    for figure in figures:
        defaults, best = row[figure]["defaults"], row[figure]["best"]
        assert defaults["ratio"] == pytest.approx(defaults["k3serve"] / defaults["llama.cpp"], rel=1e-2)
        assert best["ratio"] == pytest.approx(best["k3serve"] / best["llama.cpp"], rel=1e-2)
        for engine in ("k3serve", "llama.cpp"):  # best over policies that include the default one
            better = min if figure == "peak_rss_mib" else max
            assert best[engine] == better(defaults[engine], best[engine])
            assert best[f"{engine}_policy"] in ("default", "PASSIVE")
    # a wait policy changes when threads sleep, never what they compute
    greedy = result["greedy_first_round"]
    assert greedy["k3serve int8 default"] == greedy["k3serve int8 PASSIVE"] and len(greedy["k3serve int8 default"]) == 4
    assert greedy["llama.cpp Q8_0 default"] == greedy["llama.cpp Q8_0 PASSIVE"]
    assert "qwen3_moe smoke int8 vs Q8_0: prefill_64 " in done.stdout
