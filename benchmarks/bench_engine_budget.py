"""Bytes read from disk per generated token under a RAM budget, as the engine's batch grows.

The embedded model is packed (once, into the user cache) and served by the engine from a streaming source
capped at --ram-budget. C requests (C = 1, 8, 32) with distinct 16-token prompts decode --max-tokens greedy
tokens together; every trunk layer and expert read in a step serves every token of the batch that needs it, so
bytes per generated token fall as C grows. Reads are pread through the I/O pool (page cache not dropped: the
figure is bytes requested from the store, which is what a cold disk would have to deliver).

Prints the machine, one summary line, and a JSON record on the last line.

    python benchmarks/bench_engine_budget.py [--ram-budget 16M] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import time

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.host import describe_host
from k3serve.loading import load_model
from k3serve.units import parse_size
from k3serve.stream.options import StreamOptions

CONCURRENCY = (1, 8, 32)


def run(concurrency: int, budget: int, max_tokens: int) -> dict[str, float]:
    loaded = load_model(None, stream=StreamOptions(ram_budget=budget, io="pread", cache="lfu"))
    model = loaded.model
    engine = LLMEngine(model, EngineConfig(max_seqs=64, max_batch_tokens=2048), stop_ids=())
    rng = np.random.default_rng(concurrency)
    for _ in range(concurrency):
        engine.add_request([int(t) for t in rng.integers(3, model.config.vocab_size, 16)],
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    before = model.source.stats().stream
    started = time.perf_counter()
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - started
    stats = model.source.stats().stream.minus(before)
    model.source.close()
    return {"generated_tokens": generated, "bytes_per_token": stats.bytes_read / generated,
            "expert_bytes_per_token": stats.expert_bytes_read / generated,
            "trunk_bytes_per_token": stats.trunk_bytes_read / generated,
            "retention": stats.retention, "tok_per_s": generated / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ram-budget", default="16M")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    budget = parse_size(args.ram_budget)
    results = {c: run(c, budget, args.max_tokens) for c in CONCURRENCY}
    record = {"benchmark": "engine_budget", "machine": describe_host(), "ram_budget_bytes": budget,
              "max_tokens": args.max_tokens, "results": {str(c): r for c, r in results.items()}}
    print(f"machine: {record['machine']}")
    print(" | ".join(f"batch {c}: {r['bytes_per_token'] / 2**20:.2f} MiB/token ({r['tok_per_s']:.1f} tok/s)"
                     for c, r in results.items()) + f" | budget {args.ram_budget}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
