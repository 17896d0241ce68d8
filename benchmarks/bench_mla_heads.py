"""MLA's per-head W_uk / W_uv of a Q8_0 GGUF, held as the file's Q8_0 blocks (the default, `q8_0_heads_matmul`)
against the same values as float32 heads (the path before: a BLAS product a head and sequence), alternated in one
process on one loaded model: the A/B that separate processes on this VM cannot resolve (their decode swings 20-38%).
`--part kda` does the same for Kimi Linear's KDA f_b / g_b [P, D] (Q8_0 blocks through `linear` against float32).

The model is loaded as bench_peers.py's k3serve harness loads it (every expert resident); each round prefills B
random 64-token prompts and times `--steps` decode steps of all B sequences, once with each variant, the order
alternating round by round.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_mla_heads.py MODEL.gguf [--part mla|kda] [--batches 1 8]
                                                                  [--rounds 6] [--steps 32]

Prints, per batch size, each variant's tok/s per round and median and the per-round ratio; then a JSON record on the
last line. MODEL.gguf: a DeepSeek-V3 or Kimi Linear GGUF whose attn_k_b / attn_v_b are Q8_0 (benchmarks/
family_fixture.py's real-width fixtures, K3BENCH_REALWIDTH_DIR).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import _K3ServeShapes  # noqa: E402

from k3serve.model.families.delta import KimiDeltaAttention  # noqa: E402
from k3serve.model.families.latent_attention import LatentAttention  # noqa: E402
from k3serve.weights.q8_0 import dequantize_q8_0  # noqa: E402
from k3serve.weights.quantized import QuantizedMatrix  # noqa: E402


def float_heads(mixer: LatentAttention):
    """The mixer's weights with W_uk / W_uv as float32 heads holding the Q8_0 blocks' values."""
    NA, KL, DN, DV = mixer.num_heads, mixer.kv_lora_rank, mixer.nope_dim, mixer.value_dim
    w = mixer.weights
    w_uk = np.ascontiguousarray(dequantize_q8_0(w.w_uk.data).reshape(NA, KL, DN).transpose(0, 2, 1))
    return dataclasses.replace(w, w_uk=w_uk, w_uv=dequantize_q8_0(w.w_uv.data).reshape(NA, DV, KL))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--part", choices=("mla", "kda"), default="mla")
    args = parser.parse_args()
    harness = _K3ServeShapes({"family": "gguf", "checkpoint": args.gguf, "precision": "native"})
    kind, held = ((LatentAttention, "w_uk") if args.part == "mla" else (KimiDeltaAttention, "f_b"))
    mixers = [layer.mixer for layer in harness.model.layers if isinstance(layer.mixer, kind)]
    if not mixers or not all(isinstance(getattr(m.weights, held), QuantizedMatrix) for m in mixers):
        print(f"{args.gguf}: no {args.part} layer holds Q8_0 blocks there", file=sys.stderr)
        return 2
    if args.part == "mla":
        floats = [float_heads(m) for m in mixers]
    else:
        floats = [dataclasses.replace(m.weights, f_b=m.weights.f_b.dequantize(), g_b=m.weights.g_b.dequantize())
                  for m in mixers]
    variants = {"q8_0": [m.weights for m in mixers], "float32": floats}
    rng = np.random.default_rng(0)
    vocab = harness.model.config.vocab_size
    record = {"benchmark": "mla_heads", "part": args.part, "gguf": args.gguf, "machine": platform.processor() or platform.machine(),
              "steps": args.steps, "rounds": args.rounds, "batches": {}}
    for batch in args.batches:
        prompts = [rng.integers(3, vocab - 8, 64).tolist() for _ in range(batch)]
        runs: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                for mixer, weights in zip(mixers, variants[name]):
                    mixer.weights = weights
                first = harness.prefill(prompts)
                started = time.perf_counter()
                harness.decode([[t] for t in first], args.steps)
                runs[name].append(batch * args.steps / (time.perf_counter() - started))
        ratios = [a / b for a, b in zip(runs["q8_0"], runs["float32"])]
        for name, values in runs.items():
            print(f"batch {batch}: {name:7s} tok/s {[round(v, 1) for v in values]} median "
                  f"{np.median(values):.1f}")
        print(f"batch {batch}: q8_0 / float32 per round {[round(x, 3) for x in ratios]}, median "
              f"{np.median(ratios):.3f}")
        record["batches"][str(batch)] = {"tok_s": runs, "ratio_per_round": ratios,
                                         "median_ratio": float(np.median(ratios))}
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
