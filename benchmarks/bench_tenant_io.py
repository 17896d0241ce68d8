"""A tenant whose prompts miss the expert cache beside one whose prompts hit, with and without `--charge io`
(issue 35, item 3).

The embedded model is packed (once) and streamed under --ram-budget with O_DIRECT reads (`io=direct`, LRU expert
cache). Tenant H sends one short request every --interval seconds, each a --light-prompt window of the first
--hit-text-tokens tokens of one Python source file (by default one fixed 8-token prompt: alone, its experts stay
cached and it barely reads); tenant M keeps --flood requests live, each a prompt of random token ids (no domain:
its routing spreads over the experts). Each round runs, alternating, the --modes, each on a fresh
streaming source (an empty expert cache): H alone (fair), H + M under fair
charged by tokens (`fair`), H + M under fair with charge io (`fair_io`, --io-cost tokens per second of waiting on
reads), and with charge io plus per-tenant expert cache shares (`fair_io_shares`, --tenant-cache-shares), I/O-heavy
tenants in steps of their own (`fair_io_defer`, --defer-io-heavy), or both (`fair_io_shares_defer`). Reported per mode
(medians over rounds): H's TTFT p50 and p99, and each tenant's expert misses and bytes per computed position from
the requests' own usage fields (engine/io_usage.py: a miss charged to the tokens routed to its expert, other bytes
by token share), and what H's TTFT is made of: per H request, the model-clock seconds of the step in flight when it
arrived and of the steps until its first token, and how many of those steps ran M's tokens beside H's.

The default budget (6708K: 337 expert slots for the 7 x 64 experts) keeps the regime of the first runs (338 slots
at 8M then; the plan now holds the trunk in bf16, so at 8M all 448 experts fit and nothing misses). --hit-weight
sets H's tenant weight in every mode: its virtual counter's rate and, with shares, its share of the expert cache
(weight / sum of weights; H's requests route to about 209 experts, more than half of 337 slots).

Clock (--clock model, the default): every forward runs for real, but time is a virtual clock advanced after each
step by the step's compute cost (fixed + per position, calibrated once on the resident model: no I/O in it) plus
the seconds the step really waited on reads (measured by the source). So CPU load from other work on the machine
does not enter the compute part, while the disk waits stay real. --clock wall uses real time throughout.

Prints the machine, one summary line, and a JSON record on the last line.

    python benchmarks/bench_tenant_io.py [--rounds 3] [--duration 10] [--ram-budget 6708K] [--clock model|wall]
        [--hit-weight 1] [--io-heavy-step-tokens 32]
        [--modes alone fair fair_io fair_io_shares fair_io_defer fair_io_shares_defer]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.fairness import TenantShare
from k3serve.engine.sampling import SamplingParams
from k3serve.host import describe_host
from k3serve.lab.isolation import calibrate_step_cost
from k3serve.loading import load_model
from k3serve.stream.options import StreamOptions
from k3serve.units import parse_size

HIT, MISS = "H", "M"
MODES = ("alone", "fair", "fair_io", "fair_io_shares", "fair_io_defer", "fair_io_shares_defer")
SOURCE_TEXT = Path(__file__).resolve().parents[1] / "src" / "k3serve" / "engine" / "scheduler.py"


def _quantile(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) if values else float("nan")


def run(loaded, mode: str, args: argparse.Namespace, step_cost: tuple[float, float], code_ids: list[int]) -> dict:
    model = loaded.model
    config = EngineConfig(max_batch_tokens=args.max_batch_tokens, max_seqs=args.flood + 16, block_size=16,
                          num_blocks=4096, enable_prefix_caching=False, scheduling="fair",
                          charge="io" if mode.startswith("fair_io") else "tokens", io_cost=args.io_cost,
                          tenant_cache_shares="shares" in mode, defer_io_heavy="defer" in mode,
                          io_heavy_step_tokens=args.io_heavy_step_tokens)
    engine = LLMEngine(model, config, stop_ids=())
    if args.hit_weight != 1:  # every mode: only the switches differ between them
        engine.set_tenant_shares({HIT: TenantShare(weight=args.hit_weight)})
    rng = np.random.default_rng(args.seed)
    vocab = model.config.vocab_size
    virtual = [0.0]
    clock = (lambda: virtual[0]) if args.clock == "model" else time.perf_counter
    arrival: dict[str, float] = {}
    ttft: dict[str, float] = {}
    fresh: list[str] = []
    usage = {HIT: [0, 0, 0], MISS: [0, 0, 0]}  # misses, bytes, positions
    generated = {HIT: 0, MISS: 0}  # tokens of finished requests
    # what H's TTFT is made of: the rest of the step in flight at its arrival, then the steps until its first token
    in_flight: dict[str, float] = {}
    own_steps: dict[str, list[float]] = {}
    mixed_steps: dict[str, int] = {}  # of those steps, how many ran M's tokens too
    step_kinds = {"H only": 0, "M only": 0, "both": 0}
    scheduled: list[set[str]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        decision = schedule()
        scheduled.append({s.seq.request.tenant for s in decision.scheduled})
        return decision

    engine.scheduler.schedule = recording_schedule

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
        step_start = clock()
        waiting_h = [r for r in arrival if r not in ttft and r not in fresh]
        for request_id in waiting_h:
            in_flight.setdefault(request_id, step_start - arrival[request_id])
        scheduled.clear()
        outputs = engine.step()
        if args.clock == "model":
            positions = computed.value - before_positions
            waited = model.experts.local_stats().io_wait_seconds - before_io
            virtual[0] += (fixed + per_position * positions if positions else 0.0) + waited
        now = clock()
        ran = set().union(*scheduled)
        if ran:
            step_kinds["both" if len(ran) > 1 else f"{next(iter(ran))} only"] += 1
        for request_id in waiting_h:
            own_steps.setdefault(request_id, []).append(now - step_start)
            mixed_steps[request_id] = mixed_steps.get(request_id, 0) + (MISS in ran)
        for request_id in fresh:
            ttft[request_id] = now - arrival[request_id]
        fresh.clear()
        for out in outputs:
            if out.finished:
                tenant = HIT if out.request_id in arrival else MISS
                generated[tenant] += len(out.outputs[0].token_ids)
                live -= tenant == MISS
                positions = len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
                for i, value in enumerate((out.expert_misses, out.bytes_read, positions)):
                    usage[tenant][i] += value
    elapsed = clock() - start
    in_order = [ttft.get(r, elapsed + start - a) for r, a in arrival.items()]  # by arrival
    waits = sorted(in_order)
    return {"mode": mode, "hit_ttft_p50": _quantile(waits, 0.5), "hit_ttft_p99": _quantile(waits, 0.99),
            "hit_requests": len(waits), "hit_unserved": len(waits) - len(ttft),
            "hit_ttft_ms_by_arrival": [round(1000 * t, 2) for t in in_order],
            "flood_tokens_per_second": generated[MISS] / elapsed,
            "in_flight_p50": _quantile(list(in_flight.values()), 0.5),
            "in_flight_p99": _quantile(list(in_flight.values()), 0.99),
            "own_steps_mean": statistics.mean(len(s) for s in own_steps.values()) if own_steps else None,
            "own_steps_seconds_p99": _quantile([sum(s) for s in own_steps.values()], 0.99),
            "own_steps_with_m_mean": statistics.mean(mixed_steps.values()) if mixed_steps else None,
            "step_kinds": step_kinds,
            "separated_steps": engine.scheduler.io_separation.num_separated_steps
            if engine.scheduler.io_separation is not None else 0,
            "expert_slots_owned": model.experts.expert_cache.owned_slots(),
            "expert_slot_quotas": model.experts.expert_cache.tenant_quotas(),
            "misses_per_position": {t: u[0] / u[2] if u[2] else None for t, u in usage.items()},
            "bytes_per_position": {t: u[1] / u[2] if u[2] else None for t, u in usage.items()},
            "counters": {t: engine.scheduler.policy.counter(t) for t in (HIT, MISS)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per run (clock seconds)")
    parser.add_argument("--ram-budget", default="6708K")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
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
    parser.add_argument("--hit-weight", type=float, default=1.0,
                        help="H's tenant weight in every mode (its virtual counter and, with shares, its share of "
                             "the expert cache: weight / sum of weights)")
    parser.add_argument("--io-heavy-step-tokens", type=int, default=32,
                        help="the defer modes: positions an M-only step may compute while H is around")
    parser.add_argument("--clock", choices=("model", "wall"), default="model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    resident = load_model(None)
    step_cost = calibrate_step_cost(resident.model)
    code_ids = list(resident.tokenizer.encode(SOURCE_TEXT.read_text()))[:args.hit_text_tokens]
    del resident
    modes = tuple(args.modes)
    if "alone" not in modes:
        parser.error("--modes needs alone (the ratios are to it)")

    def fresh_run(mode: str) -> dict:
        """Each run on a fresh streaming source: every mode starts from an empty expert cache (H's first request
        is cold in every mode, alone included), whatever the run before it left resident."""
        loaded = load_model(None, stream=StreamOptions(ram_budget=parse_size(args.ram_budget), io="direct",
                                                       cache="lru"))
        try:
            return run(loaded, mode, args, step_cost, code_ids)
        finally:
            loaded.model.source.close()

    rounds = [{mode: fresh_run(mode) for mode in modes} for _ in range(args.rounds)]
    summary = {mode: {field: statistics.median(r[mode][field] for r in rounds)
                      for field in ("hit_ttft_p50", "hit_ttft_p99")} for mode in modes}
    ratio = {mode: statistics.median(r[mode]["hit_ttft_p99"] / r["alone"]["hit_ttft_p99"] for r in rounds)
             for mode in modes if mode != "alone"}
    record = {"benchmark": "tenant_io", "machine": describe_host(), "args": vars(args),
              "step_cost": {"fixed_s": step_cost[0], "per_position_s": step_cost[1]}, "summary": summary,
              "hit_p99_over_alone": ratio, "rounds": rounds}
    print(f"machine: {record['machine']}")
    parts = [f"{mode} {summary[mode]['hit_ttft_p99'] * 1000:.0f} ms ({ratio[mode]:.2f}x, H misses/position "
             f"{statistics.median(r[mode]['misses_per_position'][HIT] for r in rounds):.3f})"
             for mode in modes if mode != "alone"]
    print(f"H p99 TTFT: alone {summary['alone']['hit_ttft_p99'] * 1000:.0f} ms, " + ", ".join(parts)
          + f" | budget {args.ram_budget}, clock {args.clock}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
