"""Streaming a family model's experts under a RAM budget vs the same model resident.

    python benchmarks/bench_family_stream.py [--model DIR | --family NAME] [--precision native|int8|mxfp4]
                                             [--rounds 3] [--tokens 16] [--quick]

The model (a family checkpoint folder, or the random tiny model of --family: benchmarks/family_fixture.py) is packed
once, untimed, into a family store (`k3serve pack --expert-precision`). Then, alternating round by round, greedy
decode on the same prompts under four configurations:
  resident     the family model with every expert in RAM at the same precision (all packed before timing);
  unlimited    streamed, budget unlimited (every expert gets a slot once read);
  tight        streamed, budget = trunk + a quarter of all experts' slots (at least top-k), LRU;
  tight+pf     the same with next-layer prefetch.
Reported per configuration: median decode tok/s, and from the streaming counters of the decode steps (the prefill
apart): bytes read and reads per token, retention, prefetch hits. Every configuration must produce the resident
tokens (checked; the run fails otherwise). The store is read through the page cache, which holds it after the
first round: the figures are the streaming stack's own cost (slots, cache policy, checksums, reads from page
cache), not a disk's. Prints the machine, one summary line, and a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
from pathlib import Path

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from family_fixture import add_model_args, model_path
from k3serve.engine.generate import generate
from k3serve.engine.sampling import SamplingParams
from k3serve.host import describe_host
from k3serve.loading import load_model
from k3serve.units import format_size
from k3serve.stream.family_pack import pack_family
from k3serve.stream.family_source import trunk_float32_bytes
from k3serve.lab.measure import measure_decode
from k3serve.stream.options import StreamOptions
from k3serve.weights.family_store import FamilyStore, is_family_store

CONFIGS = ("resident", "unlimited", "tight", "tight+pf")


def packed_store(source: Path, precision: str) -> FamilyStore:
    """The store of `source` at `precision`, packed once per source version (path, files' sizes and mtimes)."""
    stamp = [str(source.resolve())] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}"
                                       for f in sorted(source.iterdir()) if f.is_file()]
    key = hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:12]
    out = Path(os.environ.get("K3BENCH_DIR", "/tmp/k3bench-families")) / f"{source.name}-{key}-store-{precision}"
    if not is_family_store(out):
        pack_family(source, out, expert_precision=precision)
    return FamilyStore(out)


def resident_model(source: Path, precision: str, store: FamilyStore):
    """The resident model with every expert packed already (packing happens on first use otherwise, inside the
    timed decode)."""
    model = load_model(source, expert_precision=precision).model
    for layer in store.moe_layers:
        for expert in range(store.num_experts):
            model.experts.get(layer, expert)
    return model


def resident_run(model, prompts, tokens: int) -> tuple[list[list[int]], float]:
    outputs, steps, seconds = [], 0, 0.0
    for prompt in prompts:
        out, report = generate(model, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
        outputs.append(out)
        steps += len(out) - 1
        seconds += report.decode_seconds
    return outputs, steps / seconds


def streamed_run(store: FamilyStore, options: StreamOptions, prompts, tokens: int):
    model = load_model(store.path, stream=options).model
    try:
        m = measure_decode(model, prompts, tokens)
        return m.outputs, m.decode_steps / m.decode_seconds, m
    finally:
        model.experts.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--precision", choices=("native", "int8", "mxfp4"), default="native")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 8 tokens on 2 prompts")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.tokens, args.prompts = 2, 8, 2
    if args.model is None and args.family is None:
        parser.error("give --model DIR (a family checkpoint folder) or --family NAME")
    logging.basicConfig(level=logging.WARNING)
    path, label = model_path(args)
    source = Path(path)
    store = packed_store(source, args.precision)
    globals_bytes, layers = trunk_float32_bytes(store.trunk_path)
    trunk = globals_bytes + sum(layers.values())
    slots = max(store.top_k, store.num_experts_total // 4)
    tight = trunk + slots * store.expert_stride
    options = {
        "unlimited": StreamOptions(),
        "tight": StreamOptions(ram_budget=tight, cache="lru"),
        "tight+pf": StreamOptions(ram_budget=tight, cache="lru", prefetch="next-layer"),
    }
    rng = np.random.default_rng(0)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    prompts = [[int(t) for t in rng.integers(3, vocab, 24)] for _ in range(args.prompts)]

    resident = resident_model(source, args.precision, store)
    resident_run(resident, prompts, 2)  # warm-up: kernels compiled
    streamed_run(store, options["unlimited"], prompts, 2)  # the store in the page cache
    rates: dict[str, list[float]] = {c: [] for c in CONFIGS}
    counters: dict[str, list] = {c: [] for c in CONFIGS[1:]}
    want: list[list[int]] | None = None
    for _ in range(args.rounds):
        for config in CONFIGS:
            if config == "resident":
                outputs, rate = resident_run(resident, prompts, args.tokens)
            else:
                outputs, rate, measured = streamed_run(store, options[config], prompts, args.tokens)
                counters[config].append(measured)
            want = outputs if want is None else want
            if outputs != want:
                raise SystemExit(f"{config}: streamed tokens differ from the resident ones")
            rates[config].append(rate)
    medians = {c: statistics.median(v) for c, v in rates.items()}
    figures = {}
    for config, runs in counters.items():
        last = runs[-1]
        figures[config] = {"bytes_per_token": round(last.bytes_per_token), "reads_per_token":
                           round(last.reads_per_token, 2), "retention": round(last.decode.retention, 3),
                           "prefetch_hit_share": round(last.prefetch_hit_share, 3),
                           "evictions": last.decode.expert_evictions}
    record = {
        "benchmark": "family_stream", "model": label, "machine": describe_host(), "precision": args.precision,
        "expert_kind": store.kind, "rounds": args.rounds, "tokens": args.tokens, "prompts": args.prompts,
        "trunk_float32_bytes": trunk, "expert_stride": store.expert_stride, "experts": store.num_experts_total,
        "tight_budget_bytes": tight, "tight_slots": slots,
        "median_decode_tok_per_s": {c: round(v, 2) for c, v in medians.items()},
        "over_resident": {c: round(medians[c] / medians["resident"], 2) for c in CONFIGS[1:]},
        "decode_counters_last_round": figures, "same_tokens_as_resident": True,
        "all_rounds": {c: [round(v, 2) for v in vs] for c, vs in rates.items()},
    }
    print(f"machine: {record['machine']}")
    print(f"{label}, experts {args.precision} ({store.kind}): decode tok/s resident {medians['resident']:.1f} | "
          + " | ".join(f"{c} {medians[c]:.1f} ({record['over_resident'][c]}x, "
                       f"{format_size(figures[c]['bytes_per_token'])}/token, retention {figures[c]['retention']})"
                       for c in CONFIGS[1:])
          + f" | tight = trunk {format_size(trunk)} + {slots} of {store.num_experts_total} expert slots"
          + f" | same tokens everywhere | medians of {args.rounds}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
