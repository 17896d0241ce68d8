"""`q8_0_matmul` of this tree against another revision's, in one process, calls alternated: the A/B for a change
inside the Q8_0 kernels, which separate processes on a shared VM cannot resolve (their timings swing 20-38%).

The other revision is checked out into a temporary git worktree and its `k3serve/model/kernels.py` loaded beside this
tree's (the rest of k3serve is this tree's; the kernels module imports only the weight formats). Each shape is
multiplied by both, the outputs compared bit for bit, then timed in rounds that alternate the order (A B, B A, ...);
medians of the rounds.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_kernel_ab.py [--base HEAD~1] [--rounds 8]
                                                                   [--shapes 11264x2048x512 8192x128x1 ...]

A shape is RxCxT: a Q8_0 [R, C] matrix (random values) against T activation rows. Matrices larger than the last-level
cache come from memory at every call; small ones stay in cache (say which a figure is). Prints one line per shape
(base and tip ms, tip's speed-up, whether the bits are equal) and a JSON record on the last line.

`--experts T ...` times `q8_0_experts_run` instead: 128 Q8_0 experts of Qwen3-30B-A3B's shape (H 2048, I 768, 604
MB of int8 values with float16 block scales, so from memory), T tokens each routed to 8 distinct random experts
(T = 1: decode; 8: a decode batch; 64 and 512: prefill chunks), one call per layer as the model makes it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.model import kernels as tip
from k3serve.weights.q8_0 import quantize_q8_0

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SHAPES = ["11264x2048x512", "3648x2048x512", "32768x2304x8", "2816x2048x1", "8192x128x1", "262144x128x1"]


def load_kernels(worktree: Path):
    spec = importlib.util.spec_from_file_location("k3serve_base_kernels",
                                                  worktree / "src" / "k3serve" / "model" / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(module, blocks: np.ndarray, x: np.ndarray, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        module.q8_0_matmul(blocks, x)
    return (time.perf_counter() - started) / calls * 1e3


def experts_ab(base, token_counts: list[int], rounds: int, rng: np.random.Generator) -> dict:
    """`q8_0_experts_run` of base and tip on 128 experts of Qwen3-30B-A3B's shape, T tokens routed to 8 each."""
    num_experts, hidden, inner, top_k = 128, 2048, 768, 8
    gate_up = rng.integers(-127, 128, (num_experts, 2 * inner, hidden), dtype=np.int8)
    down = rng.integers(-127, 128, (num_experts, hidden, inner), dtype=np.int8)
    gate_up_scales = rng.uniform(1e-3, 2e-3, (num_experts, 2 * inner, hidden // 32)).astype(np.float16)
    down_scales = rng.uniform(1e-3, 2e-3, (num_experts, hidden, inner // 32)).astype(np.float16)
    out = {}
    for tokens in token_counts:
        chosen = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)])  # [T, 8]
        experts, positions = chosen.reshape(-1), np.repeat(np.arange(tokens), top_k)
        order = np.argsort(experts, kind="stable")  # pairs grouped by expert, as the model's routing sorts them
        experts, positions = experts[order], positions[order]
        ids, starts = np.unique(experts, return_index=True)
        ends = np.append(starts[1:], len(experts))
        x = rng.standard_normal((tokens, hidden)).astype(np.float32)
        call = (gate_up, gate_up_scales, down, down_scales, ids, x, positions, starts, ends)
        same = bool(np.array_equal(base.q8_0_experts_run(*call), tip.q8_0_experts_run(*call)))
        calls = max(1, 16 // tokens)
        runs = {"base": [], "tip": []}
        for r in range(rounds):
            for name in (("base", "tip") if r % 2 == 0 else ("tip", "base")):
                module = base if name == "base" else tip
                started = time.perf_counter()
                for _ in range(calls):
                    module.q8_0_experts_run(*call)
                runs[name].append((time.perf_counter() - started) / calls * 1e3)
        b, t = float(np.median(runs["base"])), float(np.median(runs["tip"]))
        print(f"experts, T={tokens:4d} ({len(ids)} experts, {len(experts)} pairs): base {b:8.3f} ms, tip {t:8.3f} ms, "
              f"tip {b / t:.2f}x, same bits: {same}")
        out[str(tokens)] = {"base_ms": runs["base"], "tip_ms": runs["tip"], "speedup": b / t, "same_bits": same,
                            "experts": int(len(ids)), "pairs": int(len(experts))}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD~1")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    parser.add_argument("--experts", type=int, nargs="+", default=None,
                        help="token counts for q8_0_experts_run (instead of --shapes)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    record = {"benchmark": "kernel_ab", "base": args.base, "machine": platform.processor() or platform.machine(),
              "rounds": args.rounds, "shapes": {}}
    with tempfile.TemporaryDirectory() as scratch:
        worktree = Path(scratch) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.base], check=True,
                       capture_output=True)
        try:
            base = load_kernels(worktree)
            if args.experts:
                record["experts"] = experts_ab(base, args.experts, args.rounds, rng)
                args.shapes = []
            for shape in args.shapes:
                rows, cols, tokens = (int(v) for v in shape.split("x"))
                blocks = quantize_q8_0(rng.standard_normal((rows, cols)).astype(np.float32))
                x = rng.standard_normal((tokens, cols)).astype(np.float32)
                same = bool(np.array_equal(base.q8_0_matmul(blocks, x), tip.q8_0_matmul(blocks, x)))
                calls = max(2, int(2e8 // max(blocks.nbytes * tokens, 1)))  # ~0.1-1 s a variant and round
                runs = {"base": [], "tip": []}
                for r in range(args.rounds):
                    for name in (("base", "tip") if r % 2 == 0 else ("tip", "base")):
                        runs[name].append(timed(base if name == "base" else tip, blocks, x, calls))
                b, t = float(np.median(runs["base"])), float(np.median(runs["tip"]))
                print(f"{shape:>16s}: base {b:8.3f} ms, tip {t:8.3f} ms, tip {b / t:.2f}x, same bits: {same}")
                record["shapes"][shape] = {"base_ms": runs["base"], "tip_ms": runs["tip"], "speedup": b / t,
                                           "same_bits": same, "calls": calls}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False,
                           capture_output=True)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
