"""Where a family model's decode time goes, and the weight bytes one decoded token reads.

    python benchmarks/bench_family_profile.py [--families qwen3_moe,kimi_linear,deepseek_v3]
                                              [--precisions bf16,int8,mxfp4] [--steps 32]

On the fixtures of `bench_families_peers.py` (run that first: it builds them under K3BENCH_FAMILIES_DIR): load at
a precision, read every expert, prefill 32 tokens, then --steps decode steps timed (wall and process CPU time),
then the same steps again under cProfile, split into the expert kernels (one call per MoE layer), the trunk
matmuls (bf16 row-dot kernel, BLAS, einsum) and the rest (Python and small numpy calls: norms, routing, rope,
attention over the cache, KDA / DeltaNet steps). Bytes per token: the top-k experts of every MoE layer as packed,
plus every trunk matrix as held. Each line ends with the profile split into compiled kernels, C calls and Python
frames (benchmarks/profile_split.py: Python's share of a decode step, calls per step). One line per (family,
precision). Figures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import time
from pathlib import Path

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from profile_split import line, split

from k3serve.loading import load_model
from k3serve.model.families.moe import MoEBlock
from k3serve.model.interface import ForwardItem

WORK = Path(os.environ.get("K3BENCH_FAMILIES_DIR", "/tmp/k3bench-families"))
EXPERT_KERNELS = ("_dense_experts_parallel", "_dense_experts_serial", "_experts_gate_up_parallel",
                  "_experts_gate_up_serial", "_experts_down_parallel", "_experts_down_serial", "expert_activation",
                  "_accumulate_rows")
TRUNK_KERNELS = ("_bf16_matmul_parallel", "_bf16_matmul_serial", "<method 'matmul' of 'numpy.ndarray' objects>",
                 "<built-in method numpy._core._multiarray_umath.c_einsum>")


def matrix_bytes(obj, seen: set[int]) -> int:
    """Bytes of the 2-D arrays reachable from a layer part (its weights), each counted once."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return obj.nbytes if obj.ndim == 2 else 0
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(matrix_bytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    if type(obj).__module__.startswith("k3serve.model.families") and hasattr(obj, "__dict__"):
        return sum(matrix_bytes(v, seen) for v in vars(obj).values())
    return 0


def profile(checkpoint: Path, precision: str, steps: int) -> str:
    model = load_model(checkpoint, expert_precision=precision).model
    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
    for block in moe:
        for expert in range(block.router.weight.shape[0]):
            block.experts.get(block.layer, expert)
    seen: set[int] = set()
    trunk = model.lm_head.nbytes + sum(matrix_bytes(layer.mixer, seen) + matrix_bytes(layer.mlp, seen)
                                       for layer in model.layers)  # the expert store keeps its arrays in dicts: not counted
    experts = len(moe) * moe[0].router.top_k * model.experts.nbytes / model.experts.num_loaded
    cache = model.new_cache()
    model.forward([ForwardItem(np.random.default_rng(0).integers(3, model.config.vocab_size, size=32), cache)])
    token = 5

    def run() -> None:
        nonlocal token
        for _ in range(steps):
            token = int(np.argmax(model.forward([ForwardItem(np.array([token]), cache)]).logits[0][-1]))

    wall, cpu = time.perf_counter(), time.process_time()
    run()
    wall, cpu = (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    run()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    parts = split(stats, steps)

    def ms(names: tuple[str, ...]) -> float:
        return sum(v[2] for k, v in stats.items() if k[2] in names) / steps * 1e3

    total = max(v[3] for k, v in stats.items() if k[2] == "forward") / steps * 1e3
    kernel, matmul = ms(EXPERT_KERNELS), ms(TRUNK_KERNELS)
    rest = total - kernel - matmul
    return (f"{checkpoint.parent.name.split('-')[0]} {precision}: wall {wall * 1e3:.2f} ms/token, cpu "
            f"{cpu * 1e3:.2f} ms/token; profiled forward {total:.2f} ms: experts kernel {kernel:.2f} "
            f"({kernel / total:.0%}), trunk matmuls {matmul:.2f} ({matmul / total:.0%}), the rest {rest:.2f} "
            f"({rest / total:.0%}); bytes/token: experts {experts / 2**20:.1f} MiB + trunk {trunk / 2**20:.1f} MiB; "
            f"{(experts + trunk) / cpu / 1e9:.1f} GB/s per CPU second | {line(parts)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="qwen3_moe,kimi_linear,deepseek_v3")
    parser.add_argument("--precisions", default="bf16,int8,mxfp4")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--fixture", default="h512-l8-e64k8-w256-v4096", help="bench_families_peers.py's size key")
    args = parser.parse_args()
    for family in args.families.split(","):
        for precision in args.precisions.split(","):
            print(profile(WORK / f"{family}-{args.fixture}" / "checkpoint", precision, args.steps), flush=True)


if __name__ == "__main__":
    main()
