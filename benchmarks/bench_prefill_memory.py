"""Where a long prefill's memory goes, per layer part: each mixer and MLP class's largest transient (tracemalloc,
the bytes numpy allocates inside one call, above what was live when it started), the whole forward's peak, and the
process's high-water mark (VmHWM) after the load and after the prefill. The peers matrix (bench_peers.py) measures
peak RSS under its protocol; this says which part of a layer sets it.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_prefill_memory.py --target kimi_linear --precision mxfp4
    PYTHONPATH=src .venv/bin/python benchmarks/bench_prefill_memory.py --target qwen3_moe --size smoke --tokens 256
    PYTHONPATH=src .venv/bin/python benchmarks/bench_prefill_memory.py --target qwen3_next --source gguf
    PYTHONPATH=src .venv/bin/python benchmarks/bench_prefill_memory.py --target qwen3_moe --precision bf16 \
        --tokens 512 --profile 8

The model loads as bench_peers.py loads it (every expert packed first; --trunk-precision q8_0 is what its
`--k3serve-trunk match` gives the int8 and mxfp4 pairs; --source gguf loads the fixture's GGUF of the precision's
llama.cpp type instead, as `bench_peers.py --k3serve-source gguf` does), then one prompt of --tokens random ids runs in one
forward. tracemalloc sees numpy's allocations (not numba's or BLAS's own scratch); VmHWM sees everything. Prints a
table and a JSON record on the last line (--json FILE writes it too).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import sys
import time
import tracemalloc
from pathlib import Path

import k3serve  # noqa: F401  (before numpy: OpenBLAS's threads then sleep between calls, k3serve/__init__.py)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_fixture import FAMILIES, SIZES, fixture_dir  # noqa: E402
from profile_split import by_own_time  # noqa: E402


FORWARD = "whole forward"


def watch_parts(model) -> dict[str, int]:
    """Wrap each distinct mixer and MLP class's __call__ to record its largest transient (bytes) into the dict, and
    the largest traced total under FORWARD."""
    peaks: dict[str, int] = collections.defaultdict(int)
    wrapped: set[type] = set()
    for layer in model.layers:
        for part in (layer.mixer, layer.mlp):
            cls = type(part)
            if cls in wrapped:
                continue
            wrapped.add(cls)

            def call(self, *args, _original=cls.__call__, _name=cls.__name__, **kwargs):
                live, peak_so_far = tracemalloc.get_traced_memory()
                peaks[FORWARD] = max(peaks[FORWARD], peak_so_far)  # reset_peak below would lose it
                tracemalloc.reset_peak()
                result = _original(self, *args, **kwargs)
                peak = tracemalloc.get_traced_memory()[1]
                peaks[_name] = max(peaks[_name], peak - live)
                peaks[FORWARD] = max(peaks[FORWARD], peak)
                return result

            cls.__call__ = call
    return peaks


def profile_prefill(engine, prompt: list[int], top: int) -> dict:
    """One timed prefill, then one under cProfile: its `top` functions by own time (seconds and share)."""
    started = time.perf_counter()
    engine.prefill([prompt])
    seconds = time.perf_counter() - started
    profiler = cProfile.Profile()
    profiler.enable()
    engine.prefill([prompt])
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in stats.values())
    rows = by_own_time(stats)[:top]
    print(f"  prefill {len(prompt) / seconds:.1f} tok/s ({seconds:.2f} s); profiled, by own time:")
    for spent, name in rows:
        print(f"    {name:<58} {spent:7.3f} s {spent / total:6.1%}")
    return {"prefill_tok_s": round(len(prompt) / seconds, 1),
            "profile_top": [{"function": name, "seconds": round(spent, 4)} for spent, name in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=FAMILIES, required=True)
    parser.add_argument("--size", choices=SIZES, default="real")
    parser.add_argument("--precision", choices=("bf16", "int8", "mxfp4"), default="mxfp4")
    parser.add_argument("--trunk-precision", choices=("native", "q8_0"), default=None,
                        help="default: q8_0 for int8 and mxfp4 (bench_peers.py's --k3serve-trunk match), else native")
    parser.add_argument("--source", choices=("checkpoint", "gguf"), default="checkpoint")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="then time one more prefill (no tracemalloc) and profile another (cProfile), printing "
                             "its TOP functions by own time: where a prefill's time goes")
    args = parser.parse_args()

    from bench_peers import PAIRS, _K3ServeShapes, peak_rss_mib  # the peers benchmark's loader and its VmHWM

    trunk = args.trunk_precision or ("native" if args.precision == "bf16" or args.source == "gguf" else "q8_0")
    checkpoint = fixture_dir(args.target, args.size)
    if args.source == "gguf":  # the GGUF bench_peers.py builds beside the checkpoint (family_ggufs)
        checkpoint = checkpoint.parent / f"{PAIRS[args.precision]}.gguf"
        if not checkpoint.exists():
            parser.error(f"{checkpoint} does not exist: bench_peers.py --targets {args.target} --sizes {args.size} "
                         "builds it")
    engine = _K3ServeShapes({"family": args.target, "checkpoint": str(checkpoint), "precision": args.precision,
                             "trunk_precision": trunk})
    after_load = peak_rss_mib()
    peaks = watch_parts(engine.model)
    vocab = engine.model.config.vocab_size
    prompt = np.random.default_rng(0).integers(3, min(1000, vocab), args.tokens).tolist()
    tracemalloc.start()
    started = time.perf_counter()
    engine.prefill([prompt])
    seconds = time.perf_counter() - started
    forward_peak = max(peaks.pop(FORWARD, 0), tracemalloc.get_traced_memory()[1])
    tracemalloc.stop()
    record = {"benchmark": "prefill_memory", "target": args.target, "size": args.size, "precision": args.precision,
              "source": args.source, "trunk_precision": trunk, "tokens": args.tokens, "checkpoint": str(checkpoint),
              "part_peak_mib": {name: round(b / 2**20, 1) for name, b in sorted(peaks.items())},
              "forward_peak_mib": round(forward_peak / 2**20, 1), "hwm_after_load_mib": round(after_load, 1),
              "hwm_after_prefill_mib": round(peak_rss_mib(), 1),
              "prefill_seconds_under_tracemalloc": round(seconds, 2)}
    print(f"{args.target} {args.size} {args.precision} (trunk {trunk}), one {args.tokens}-token prefill:")
    for name, mib in record["part_peak_mib"].items():
        print(f"  {name:<22} largest transient {mib:8.1f} MiB")
    print(f"  whole forward (tracemalloc)   {record['forward_peak_mib']:8.1f} MiB")
    print(f"  VmHWM after load {record['hwm_after_load_mib']:.0f} MiB, after the prefill "
          f"{record['hwm_after_prefill_mib']:.0f} MiB")
    if args.profile:
        record.update(profile_prefill(engine, prompt, args.profile))
    line = json.dumps(record)
    if args.json is not None:
        args.json.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
