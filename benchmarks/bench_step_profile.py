"""Why batch 16 is not 16x batch 1: one decode step's CPU time at each batch size, split by function.

    python benchmarks/bench_step_profile.py [--model DIR] [--batches 1,16] [--steps 16] [--top 10]

For each batch size B (alternated round by round): B sequences after a 16-token prompt each take --steps decode
steps together, timed by process CPU time (the shared machine's other jobs inflate wall time, not CPU time), then
the same again under cProfile. Also counted: the distinct routed experts per MoE layer per step, since each
active expert costs one pass over its weights whatever its token count. The speed-up the batch can give is
    B * cpu(1) / cpu(B),
which is what concurrency B gives the engine at best. The engine's own share is measured too: B requests through
`LLMEngine.step` (scheduling, sampling, cache bookkeeping, outputs) after their prefill, with the CPU time of the
`model.forward` calls inside counted apart, so 'engine' - 'forward' is the engine's per-step cost.
Prints the machine, a table per batch size, one summary line and a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.host import describe_host
from k3serve.loading import load_model
from k3serve.model.interface import ForwardItem


def decode_steps(model, batch: int, steps: int, rng: np.random.Generator, experts: list[int] | None = None,
                 profiler: cProfile.Profile | None = None) -> float:
    """CPU seconds per step of `steps` decode steps of `batch` sequences."""
    caches = [model.new_cache() for _ in range(batch)]
    prompt = rng.integers(0, model.config.vocab_size, size=16)
    model.forward([ForwardItem(prompt, c) for c in caches])
    tokens = rng.integers(0, model.config.vocab_size, size=(steps, batch))

    def count(layer, routing, segments) -> None:
        if experts is not None:
            experts.append(len(np.unique(routing.expert_ids)))

    if profiler is not None:
        profiler.enable()
    started = time.process_time()
    for step in range(steps):
        model.forward([ForwardItem(tokens[step, b:b + 1], caches[b]) for b in range(batch)], on_routing=count)
    elapsed = time.process_time() - started
    if profiler is not None:
        profiler.disable()
    return elapsed / steps


def engine_steps(model, stop_ids: list[int], batch: int, steps: int, rng: np.random.Generator
                 ) -> tuple[float, float]:
    """CPU seconds per engine decode step of `batch` requests, and of the model forward inside it."""
    engine = LLMEngine(model, EngineConfig(max_seqs=max(batch, 1), enable_prefix_caching=False), stop_ids=stop_ids)
    for _ in range(batch):
        engine.add_request([int(t) for t in rng.integers(3, model.config.vocab_size, 16)],
                           SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # the prefill and first tokens
    forward = model.forward
    inside = [0.0]

    def timed(*args, **kwargs):
        started = time.process_time()
        try:
            return forward(*args, **kwargs)
        finally:
            inside[0] += time.process_time() - started

    model.forward = timed
    try:
        started = time.process_time()
        for _ in range(steps):
            engine.step()
        elapsed = time.process_time() - started
    finally:
        del model.forward  # the instance attribute goes; the class's method shows through again
    return elapsed / steps, inside[0] / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    loaded = load_model(args.model)
    model = loaded.model
    rng = np.random.default_rng(0)
    for b in batches:
        decode_steps(model, b, 2, rng)  # warm-up: compile every kernel at every shape
        engine_steps(model, loaded.stop_ids, b, 2, rng)
    cpu: dict[int, list[float]] = {b: [] for b in batches}
    experts: dict[int, list[int]] = {b: [] for b in batches}
    engine_cpu: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}
    for _ in range(args.rounds):
        for b in batches:
            cpu[b].append(decode_steps(model, b, args.steps, rng, experts[b]))
            engine_cpu[b].append(engine_steps(model, loaded.stop_ids, b, args.steps, rng))
    profiles = {}
    for b in batches:
        profiler = cProfile.Profile(time.process_time)
        decode_steps(model, b, args.steps, rng, profiler=profiler)
        stats = pstats.Stats(profiler)
        total = sum(entry[2] for entry in stats.stats.values())
        rows = sorted(((entry[2], entry[1], f"{Path(key[0]).name}:{key[2]}") for key, entry in stats.stats.items()),
                      reverse=True)
        profiles[b] = {"cpu_ms_per_step_profiled": round(total / args.steps * 1e3, 3),
                       "top": [{"function": name, "ms_per_step": round(t / args.steps * 1e3, 3),
                                "calls_per_step": round(n / args.steps, 1), "share": round(t / total, 3)}
                               for t, n, name in rows[:args.top]]}
    median = {b: statistics.median(v) for b, v in cpu.items()}
    speedup = {b: round(b * median[batches[0]] / median[b], 2) for b in batches}
    engine_step = {b: statistics.median(step for step, _ in v) for b, v in engine_cpu.items()}
    engine_own = {b: statistics.median(step - inside for step, inside in v) for b, v in engine_cpu.items()}
    engine_speedup = {b: round(b * engine_step[batches[0]] / engine_step[b], 2) for b in batches}
    record = {"benchmark": "step_profile", "machine": describe_host(), "model": str(args.model or "embedded default"),
              "rounds": args.rounds, "steps": args.steps,
              "cpu_ms_per_step": {b: round(v * 1e3, 3) for b, v in median.items()},
              "speedup_over_first": speedup,
              "engine_cpu_ms_per_step": {b: round(v * 1e3, 3) for b, v in engine_step.items()},
              "engine_own_cpu_ms_per_step": {b: round(v * 1e3, 3) for b, v in engine_own.items()},
              "engine_speedup_over_first": engine_speedup,
              "distinct_experts_per_moe_layer": {b: round(float(np.mean(v)), 1) for b, v in experts.items()},
              "profiles": profiles}
    print(f"machine: {record['machine']}")
    for b in batches:
        print(f"batch {b}: {median[b] * 1e3:.2f} CPU ms/step, {record['distinct_experts_per_moe_layer'][b]} experts "
              f"per MoE layer; profile:")
        for row in profiles[b]["top"]:
            print(f"  {row['function']:<55} {row['ms_per_step']:8.3f} ms  {row['calls_per_step']:7.1f} calls  "
                  f"{row['share']:6.1%}")
        print(f"  engine step {engine_step[b] * 1e3:.2f} CPU ms, of which the engine's own (outside the forward) "
              f"{engine_own[b] * 1e3:.3f} ms ({engine_own[b] / engine_step[b]:.1%})")
    print(" | ".join(f"batch {b}: {median[b] * 1e3:.2f} CPU ms/step, {speedup[b]}x batch {batches[0]}'s tokens/CPU-s "
                     f"(engine {engine_speedup[b]}x)" for b in batches) + f" | medians of {args.rounds}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
