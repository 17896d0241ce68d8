"""A tenant whose prompts miss the expert cache beside one whose prompts hit, with and without `--charge io`
(issue 35, item 3).

The embedded model is packed (once) and streamed under --ram-budget with O_DIRECT reads (`io=direct`, LRU expert
cache). Tenant H sends one short request every --interval seconds, each a --light-prompt window of the first
--hit-text-tokens tokens of one Python source file (by default one fixed 8-token prompt: alone, its experts stay
cached and it barely reads); tenant M keeps --flood requests live, each a prompt of random token ids (no domain:
its routing spreads over the experts). Each round runs, alternating: H alone (fair), H + M under fair charged by
tokens, H + M under fair with charge io (--io-cost tokens per second of waiting on reads). Reported per mode
(medians over rounds): H's TTFT p50 and p99, and each tenant's expert misses and bytes per computed position from
the requests' own usage fields (engine/io_usage.py: a miss charged to the tokens routed to its expert, other bytes
by token share).

Clock (--clock model, the default): every forward runs for real, but time is a virtual clock advanced after each
step by the step's compute cost (fixed + per position, calibrated once on the resident model: no I/O in it) plus
the seconds the step really waited on reads (measured by the source). So CPU load from other work on the machine
does not enter the compute part, while the disk waits stay real. --clock wall uses real time throughout.

Prints the machine, one summary line, and a JSON record on the last line.

    python benchmarks/bench_tenant_io.py [--rounds 3] [--duration 10] [--ram-budget 8M] [--clock model|wall]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.host import describe_host
from k3serve.lab.isolation import calibrate_step_cost
from k3serve.loading import load_model
from k3serve.stream.options import StreamOptions
from k3serve.units import parse_size

HIT, MISS = "H", "M"
SOURCE_TEXT = Path(__file__).resolve().parents[1] / "src" / "k3serve" / "engine" / "scheduler.py"


def _quantile(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) if values else float("nan")


def run(loaded, mode: str, args: argparse.Namespace, step_cost: tuple[float, float], code_ids: list[int]) -> dict:
    model = loaded.model
    config = EngineConfig(max_batch_tokens=args.max_batch_tokens, max_seqs=args.flood + 16, block_size=16,
                          num_blocks=4096, enable_prefix_caching=False, scheduling="fair",
                          charge="io" if mode == "fair_io" else "tokens", io_cost=args.io_cost)
    engine = LLMEngine(model, config, stop_ids=())
    rng = np.random.default_rng(args.seed)
    vocab = model.config.vocab_size
    virtual = [0.0]
    clock = (lambda: virtual[0]) if args.clock == "model" else time.perf_counter
    arrival: dict[str, float] = {}
    ttft: dict[str, float] = {}
    fresh: list[str] = []
    usage = {HIT: [0, 0, 0], MISS: [0, 0, 0]}  # misses, bytes, positions

    def hit_prompt() -> list[int]:
        start = int(rng.integers(0, len(code_ids) - args.light_prompt + 1))
        return code_ids[start:start + args.light_prompt]

    def on_hit_output(out) -> None:
        if out.outputs[0].token_ids and out.request_id not in ttft and out.request_id not in fresh:
            fresh.append(out.request_id)

    light = SamplingParams(max_tokens=args.light_max_tokens, ignore_eos=True)
    flood = SamplingParams(max_tokens=args.flood_max_tokens, ignore_eos=True)
    fixed, per_position = step_cost
    computed = engine.metrics.counter("computed_tokens")
    start = clock()
    end = start + args.duration
    next_light = start
    live = 0
    while clock() < end:
        while mode != "alone" and live < args.flood:
            engine.add_request([int(t) for t in rng.integers(3, vocab, args.flood_prompt)], flood, tenant=MISS)
            live += 1
        while next_light <= clock():
            request = engine.make_request(hit_prompt(), light, tenant=HIT, on_output=on_hit_output)
            request.arrival_time = next_light
            arrival[engine.enqueue(request)] = next_light
            next_light += args.interval
        if not engine.has_unfinished_requests():
            if args.clock == "model":
                virtual[0] = min(next_light, end)
            else:
                time.sleep(max(0.0, min(next_light, end) - time.perf_counter()))
            continue
        before_io = model.experts.local_stats().io_wait_seconds
        before_positions = computed.value
        outputs = engine.step()
        if args.clock == "model":
            positions = computed.value - before_positions
            waited = model.experts.local_stats().io_wait_seconds - before_io
            virtual[0] += (fixed + per_position * positions if positions else 0.0) + waited
        now = clock()
        for request_id in fresh:
            ttft[request_id] = now - arrival[request_id]
        fresh.clear()
        for out in outputs:
            if out.finished:
                tenant = HIT if out.request_id in arrival else MISS
                live -= tenant == MISS
                positions = len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
                for i, value in enumerate((out.expert_misses, out.bytes_read, positions)):
                    usage[tenant][i] += value
    elapsed = clock() - start
    waits = sorted(ttft.get(r, elapsed + start - a) for r, a in arrival.items())
    return {"mode": mode, "hit_ttft_p50": _quantile(waits, 0.5), "hit_ttft_p99": _quantile(waits, 0.99),
            "hit_requests": len(waits), "hit_unserved": len(waits) - len(ttft),
            "misses_per_position": {t: u[0] / u[2] if u[2] else None for t, u in usage.items()},
            "bytes_per_position": {t: u[1] / u[2] if u[2] else None for t, u in usage.items()},
            "counters": {t: engine.scheduler.policy.counter(t) for t in (HIT, MISS)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per run (clock seconds)")
    parser.add_argument("--ram-budget", default="8M")
    parser.add_argument("--flood", type=int, default=8)
    parser.add_argument("--flood-prompt", type=int, default=128)
    parser.add_argument("--flood-max-tokens", type=int, default=32)
    parser.add_argument("--light-prompt", type=int, default=8)
    parser.add_argument("--light-max-tokens", type=int, default=4)
    parser.add_argument("--hit-text-tokens", type=int, default=8,
                        help="H's windows come from the first this many tokens of one source file (a narrow domain)")
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--io-cost", type=float, default=1000.0)
    parser.add_argument("--clock", choices=("model", "wall"), default="model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    resident = load_model(None)
    step_cost = calibrate_step_cost(resident.model)
    code_ids = list(resident.tokenizer.encode(SOURCE_TEXT.read_text()))[:args.hit_text_tokens]
    del resident
    loaded = load_model(None, stream=StreamOptions(ram_budget=parse_size(args.ram_budget), io="direct",
                                                   cache="lru"))
    modes = ("alone", "fair", "fair_io")
    rounds = [{mode: run(loaded, mode, args, step_cost, code_ids) for mode in modes} for _ in range(args.rounds)]
    loaded.model.source.close()
    summary = {mode: {field: statistics.median(r[mode][field] for r in rounds)
                      for field in ("hit_ttft_p50", "hit_ttft_p99")} for mode in modes}
    ratio = {mode: statistics.median(r[mode]["hit_ttft_p99"] / r["alone"]["hit_ttft_p99"] for r in rounds)
             for mode in ("fair", "fair_io")}
    record = {"benchmark": "tenant_io", "machine": describe_host(), "args": vars(args),
              "step_cost": {"fixed_s": step_cost[0], "per_position_s": step_cost[1]}, "summary": summary,
              "hit_p99_over_alone": ratio, "rounds": rounds}
    print(f"machine: {record['machine']}")
    m = rounds[0]["fair"]["misses_per_position"]
    print(f"H p99 TTFT: alone {summary['alone']['hit_ttft_p99'] * 1000:.0f} ms, "
          f"fair {summary['fair']['hit_ttft_p99'] * 1000:.0f} ms ({ratio['fair']:.2f}x), "
          f"fair --charge io {summary['fair_io']['hit_ttft_p99'] * 1000:.0f} ms ({ratio['fair_io']:.2f}x) | "
          f"expert misses per position H {m[HIT]:.3f} M {m[MISS]:.3f} | "
          f"budget {args.ram_budget}, clock {args.clock}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
