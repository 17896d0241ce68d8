"""Decode and prefill throughput of a model (default: the embedded model; any family's checkpoint with --model, or
a family's random tiny model with --family, see benchmarks/family_fixture.py), resident weights.

Measures, in one run and interleaved round by round:
  - prefill tok/s for one prompt of --prompt-len tokens;
  - decode tok/s at batch 1 and at batch 8 (8 sequences stepping together, one forward per step).
Prints the machine, one summary line, and a JSON record on the last line. Medians over --rounds rounds.

    python benchmarks/bench_decode.py [--model DIR | --family NAME] [--rounds 5] [--steps 32] [--quick]
                                      [--trunk-precision bf16|q8_0|mxfp4]

--trunk-precision (a K3 checkpoint, the embedded model by default) packs it into a temporary store at that trunk
precision (`k3serve pack --trunk-precision`) and runs the store with every layer pinned and the trunk held as
stored (bf16 bits, or Q8_0 / MXFP4 bytes multiplied from their bytes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from family_fixture import add_model_args, model_path
from k3serve.loading import load_model
from k3serve.model.interface import ForwardItem
from k3serve.host import describe_host


def prefill_rate(model, prompt: np.ndarray) -> float:
    cache = model.new_cache()
    started = time.perf_counter()
    model.forward([ForwardItem(prompt, cache)])
    return len(prompt) / (time.perf_counter() - started)


def decode_rate(model, batch: int, prompt: np.ndarray, steps: int, rng: np.random.Generator) -> float:
    caches = [model.new_cache() for _ in range(batch)]
    model.forward([ForwardItem(prompt, c) for c in caches])
    tokens = rng.integers(0, model.config.vocab_size, size=(steps, batch))
    started = time.perf_counter()
    for step in range(steps):
        model.forward([ForwardItem(tokens[step, b:b + 1], caches[b]) for b in range(batch)])
    return batch * steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 8 steps")
    parser.add_argument("--trunk-precision", choices=("bf16", "q8_0", "mxfp4"), default=None,
                        help="run a K3 checkpoint packed at this trunk precision (default: the checkpoint as loaded)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 8

    path, label = model_path(args)
    if args.trunk_precision is not None:
        import tempfile

        from k3serve.default_model import default_model_dir
        from k3serve.stream.options import StreamOptions
        from k3serve.weights.pack import pack_checkpoint

        store = pack_checkpoint(path or default_model_dir(), tempfile.mkdtemp(prefix="bench-decode-"),
                                trunk_precision=args.trunk_precision)
        model = load_model(store.path, stream=StreamOptions(trunk_dtype="bf16")).model
        label = f"{label}, trunk {args.trunk_precision} (packed store, all pinned)"
    else:
        model = load_model(path).model
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.vocab_size, size=args.prompt_len)
    short = prompt[:16]
    decode_rate(model, 1, short, 2, rng)  # warm-up: JIT compile and first-touch allocations
    results: dict[str, list[float]] = {"prefill": [], "decode_b1": [], "decode_b8": []}
    for _ in range(args.rounds):
        results["prefill"].append(prefill_rate(model, prompt))
        results["decode_b1"].append(decode_rate(model, 1, short, args.steps, rng))
        results["decode_b8"].append(decode_rate(model, 8, short, args.steps, rng))
    medians = {name: statistics.median(values) for name, values in results.items()}
    record = {
        "benchmark": "decode",
        "model": label,
        "machine": describe_host(),
        "rounds": args.rounds,
        "steps": args.steps,
        "prompt_len": args.prompt_len,
        "median_tok_per_s": {k: round(v, 2) for k, v in medians.items()},
        "batch8_over_batch1": round(medians["decode_b8"] / medians["decode_b1"], 2),
        "all_rounds": {k: [round(v, 2) for v in vs] for k, vs in results.items()},
    }
    print(f"machine: {record['machine']}")
    print(f"prefill {medians['prefill']:.0f} tok/s | decode batch 1 {medians['decode_b1']:.1f} tok/s | "
          f"batch 8 {medians['decode_b8']:.1f} tok/s ({record['batch8_over_batch1']}x) | medians of {args.rounds}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
