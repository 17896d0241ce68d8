"""Long-context prefill: tok/s and peak RSS at 1K / 8K / 32K prompt tokens (default: the embedded model).

Each prompt length runs in its own process, so its peak RSS (ru_maxrss) is that prefill's alone; the process
loads the model, measures its RSS, then prefills through `generate` (one token generated). The prefill memory
is peak RSS minus the RSS after loading. With tiled attention (model/causal_attention.py) it must grow linearly
in T: the growth per token from 8K to 32K is compared with the growth per token from 1K to 8K (1.0 = linear;
the dense [heads, T, T] scores would make it grow ~T-fold). `--dense` also runs the dense twin (one tile) at the
short lengths for contrast. Prints the machine, one summary line, and a JSON record on the last line.

    python benchmarks/bench_long_context.py [--model DIR] [--lengths 1024,8192,32768] [--dense 1024,4096]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.host import describe_host


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def child(model_dir: str | None, length: int, dense: bool) -> None:
    """One prefill of `length` tokens in this process; prints a JSON line."""
    from k3serve.engine.generate import generate, peak_rss_bytes
    from k3serve.engine.sampling import SamplingParams
    from k3serve.loading import load_model
    from k3serve.model.k3 import K3Model

    model = load_model(model_dir).model
    if dense:
        model = K3Model(model.source, chunk_size=model.chunk_size, attention_blocks=(length, length))
    ids = np.random.default_rng(length).integers(0, model.config.vocab_size, length).tolist()
    generate(model, ids[:64], SamplingParams(max_tokens=1))  # warm the kernels (numba) before measuring
    loaded_rss = _rss_bytes()
    _, report = generate(model, ids, SamplingParams(max_tokens=1, ignore_eos=True), max_context=length + 1)
    print(json.dumps({"tokens": length, "dense": dense, "prefill_seconds": report.prefill_seconds,
                      "prefill_tok_s": report.prefill_tokens_per_second, "loaded_rss_mib": loaded_rss / 2**20,
                      "peak_rss_mib": peak_rss_bytes() / 2**20,
                      "prefill_mib": (peak_rss_bytes() - loaded_rss) / 2**20}))


def run_child(model_dir: str | None, length: int, dense: bool) -> dict:
    command = [sys.executable, __file__, "--child", str(length)] + (["--model", model_dir] if model_dir else [])
    command += ["--as-dense"] if dense else []
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--lengths", default="1024,8192,32768")
    parser.add_argument("--dense", default="1024,4096", help="lengths to also run with dense attention ('' = none)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--as-dense", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.model, args.child, args.as_dense)
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    runs = []
    for length in lengths:
        runs.append(run_child(args.model, length, dense=False))
        print(f"tiled  T={length:6d}: {runs[-1]['prefill_tok_s']:8.1f} tok/s, peak RSS "
              f"{runs[-1]['peak_rss_mib']:7.1f} MiB (+{runs[-1]['prefill_mib']:.1f} MiB for the prefill)")
    for length in [int(x) for x in args.dense.split(",") if x]:
        runs.append(run_child(args.model, length, dense=True))
        print(f"dense  T={length:6d}: {runs[-1]['prefill_tok_s']:8.1f} tok/s, peak RSS "
              f"{runs[-1]['peak_rss_mib']:7.1f} MiB (+{runs[-1]['prefill_mib']:.1f} MiB for the prefill)")
    tiled = [r for r in runs if not r["dense"]]
    slopes = [(b["prefill_mib"] - a["prefill_mib"]) / (b["tokens"] - a["tokens"]) * 1024
              for a, b in zip(tiled, tiled[1:])]  # MiB per 1K tokens over each interval
    linearity = slopes[-1] / slopes[0] if len(slopes) > 1 and slopes[0] > 0 else float("nan")
    record = {"benchmark": "long_context", "machine": describe_host(), "model": args.model or "embedded default",
              "runs": runs, "mib_per_1k_tokens": slopes, "linearity": linearity}
    rates = " / ".join(f"{r['tokens'] // 1024}K {r['prefill_tok_s']:.0f} tok/s" for r in tiled)
    growth = " -> ".join(f"{r['prefill_mib']:.0f}" for r in tiled)
    per_1k = " then ".join(f"{s:.1f}" for s in slopes)
    print(f"long context: {rates}; prefill memory {growth} MiB, {per_1k} MiB per 1K tokens "
          f"(ratio {linearity:.2f}, 1 = linear)")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
