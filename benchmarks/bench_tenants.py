"""Budget isolation between tenants on the embedded default model (lab/isolation.py).

Tenant A floods: --flood requests live at once (prompt --flood-prompt tokens, --flood-max-tokens generated,
each resubmitted as it finishes). Tenant B sends one short request (--light-prompt tokens, --light-max-tokens
generated) every --interval seconds. For each round, three runs of --duration seconds alternate: B alone, A + B
under fcfs, A + B under fair. Reported per mode (medians over rounds): B's TTFT p50 and p99, B's throughput, total
throughput (positions through the model per second, prompt + generated: the engine's work, whoever it served;
generated tokens per second too, which favours whichever policy serves the short requests). Targets: fair B p99
<= 1.5 x alone; fair total throughput within 5% of fcfs. Ratios are taken per round, then the median.
With --step-interruption each round also runs a fourth mode, `fair_si`: fair with the engine's step interruption
(a forward pauses after a layer's attention or MLP for B's arrival, engine/engine.py); the targets are then judged
on it too.

Prints the machine, one summary line, and a JSON record on the last line.

    python benchmarks/bench_tenants.py [--rounds 3] [--duration 20] [--clock wall|model] [--step-interruption]
                                       [--quick]

With --clock model the engine runs every forward for real but time is a virtual clock advanced per step by a
cost calibrated once (fixed + per position), so the figures do not depend on other load on the machine. It advances
in parts, at the model's pause points (after each layer's attention and after its MLP), each part's share of the
step measured on the model (`measure_pause_split`): `--measure-pause-split FILE` measures it, prints it, writes it
as JSON and exits; `--pause-split FILE` uses such a record (without it, it is measured at the start).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from k3serve.lab.isolation import IsolationConfig, PauseSplit, measure_pause_split, run_isolation
from k3serve.loading import load_model
from k3serve.host import describe_host

FIELDS = ("light_ttft_p50", "light_ttft_p99", "light_tokens_per_s", "total_tokens_per_s", "computed_tokens_per_s",
          "light_unserved", "light_requests")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per run")
    parser.add_argument("--flood", type=int, default=32)
    parser.add_argument("--flood-prompt", type=int, default=192)
    parser.add_argument("--flood-max-tokens", type=int, default=48)
    parser.add_argument("--light-prompt", type=int, default=48)
    parser.add_argument("--light-max-tokens", type=int, default=8)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between B's requests")
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--clock", choices=("wall", "model"), default="wall",
                        help="wall: real time; model: a virtual clock advanced by a calibrated cost per step "
                             "(fixed + per position), immune to other load on the machine")
    parser.add_argument("--step-cost", default=None,
                        help="model clock: FIXED_MS,PER_POSITION_US instead of calibrating (calibration is only "
                             "meaningful on an idle machine)")
    parser.add_argument("--pause-split", type=Path, default=None,
                        help="model clock: each layer part's share of a step, from a --measure-pause-split record")
    parser.add_argument("--measure-pause-split", type=Path, default=None, metavar="FILE",
                        help="measure the time of each part of each layer (medians of --split-repeats forwards of 1 "
                             "and 256 positions), write it to FILE and exit")
    parser.add_argument("--split-repeats", type=int, default=41)
    parser.add_argument("--step-interruption", action="store_true",
                        help="also run fair with EngineConfig.step_interruption (mode fair_si)")
    parser.add_argument("--quick", action="store_true", help="1 round of 4 s with 8 flood requests")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.duration, args.flood = 1, 4.0, 8
    config = IsolationConfig(num_flood=args.flood, flood_prompt_tokens=args.flood_prompt,
                             flood_max_tokens=args.flood_max_tokens, light_prompt_tokens=args.light_prompt,
                             light_max_tokens=args.light_max_tokens, light_interval_s=args.interval,
                             duration_s=args.duration, max_batch_tokens=args.max_batch_tokens,
                             max_seqs=max(64, args.flood + 32), clock=args.clock)
    model = load_model(None).model
    if args.measure_pause_split is not None:
        split = measure_pause_split(model, repeats=args.split_repeats)
        for index, length in enumerate(split.lengths):
            print(f"{length} positions: mixer ms {[round(t * 1e3, 3) for t in split.mixer[index]]}, MLP ms "
                  f"{[round(t * 1e3, 3) for t in split.mlp[index]]}; forward {split.seconds(index).sum() * 1e3:.2f} "
                  f"ms, mixers {split.mixer_fraction(index):.1%} of it")
        fixed_shares, token_shares = split.shares
        print(f"largest part: {fixed_shares.max():.1%} of the fixed cost, {token_shares.max():.1%} of the "
              f"per-position cost")
        args.measure_pause_split.write_text(json.dumps({**split.as_dict(), "machine": describe_host(),
                                                        "repeats": args.split_repeats}, indent=1) + "\n")
        return
    if args.clock == "model":
        from k3serve.lab.isolation import calibrate_step_cost

        if args.step_cost is not None:
            fixed_ms, per_us = (float(v) for v in args.step_cost.split(","))
            cost = (fixed_ms / 1e3, per_us / 1e6)
        else:
            cost = calibrate_step_cost(model, args.max_batch_tokens)
        print(f"step cost model: {cost[0] * 1e3:.2f} ms + {cost[1] * 1e6:.1f} us per position")
        split = (PauseSplit.from_dict(json.loads(args.pause_split.read_text())) if args.pause_split is not None
                 else measure_pause_split(model, repeats=args.split_repeats))
        print(f"pause split: mixers {split.mixer_fraction(0):.1%} / {split.mixer_fraction(1):.1%} of a forward of "
              f"{split.lengths[0]} / {split.lengths[1]} positions")
        config = dataclasses.replace(config, step_cost=cost, pause_split=split)
    print(f"machine: {describe_host()}")
    modes = ("alone", "fcfs", "fair") + (("fair_si",) if args.step_interruption else ())
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_index in range(args.rounds):
        for mode in modes:
            if mode == "fair_si":
                result = run_isolation(model, "fair", dataclasses.replace(config, step_interruption=True)).as_dict()
            else:
                result = run_isolation(model, mode, config).as_dict()
            runs[mode].append(result)
            print(f"round {round_index + 1} {mode:7s}: B ttft p50 {result['light_ttft_p50'] * 1e3:7.1f} ms  "
                  f"p99 {result['light_ttft_p99'] * 1e3:7.1f} ms  B {result['light_tokens_per_s']:6.1f} tok/s  "
                  f"generated {result['total_tokens_per_s']:6.1f} tok/s  computed "
                  f"{result['computed_tokens_per_s']:6.0f} tok/s  unserved {result['light_unserved']}", flush=True)
    medians = {mode: {f: statistics.median(r[f] for r in runs[mode]) for f in FIELDS} for mode in modes}

    def ratio(mode: str, other: str, field: str) -> float:  # per round (same conditions), then the median
        return statistics.median(a[field] / b[field] for a, b in zip(runs[mode], runs[other]))

    ratios = {"fcfs_p99_over_alone": ratio("fcfs", "alone", "light_ttft_p99")}
    targets = {}
    for fair in modes[2:]:
        ratios[f"{fair}_p99_over_alone"] = ratio(fair, "alone", "light_ttft_p99")
        ratios[f"{fair}_p50_over_alone"] = ratio(fair, "alone", "light_ttft_p50")
        ratios[f"{fair}_total_over_fcfs"] = ratio(fair, "fcfs", "computed_tokens_per_s")
        ratios[f"{fair}_generated_over_fcfs"] = ratio(fair, "fcfs", "total_tokens_per_s")
        targets[f"{fair}_p99_within_1.5x_alone"] = ratios[f"{fair}_p99_over_alone"] <= 1.5
        targets[f"{fair}_total_within_5pct_of_fcfs"] = ratios[f"{fair}_total_over_fcfs"] >= 0.95
    m = medians
    fairs = ", ".join(f"{fair} {m[fair]['light_ttft_p99'] * 1e3:.0f} ms ({ratios[f'{fair}_p99_over_alone']:.2f}x)"
                      for fair in modes[2:])
    totals = ", ".join(f"{fair} {m[fair]['computed_tokens_per_s']:.0f} ({ratios[f'{fair}_total_over_fcfs']:.3f}x)"
                       for fair in modes[2:])
    print(f"summary: B p99 TTFT alone {m['alone']['light_ttft_p99'] * 1e3:.1f} ms, fcfs "
          f"{m['fcfs']['light_ttft_p99'] * 1e3:.0f} ms ({ratios['fcfs_p99_over_alone']:.1f}x), {fairs}; total "
          f"computed tok/s fcfs {m['fcfs']['computed_tokens_per_s']:.0f}, {totals}; targets {targets}")
    record = {**config.__dict__, "pause_split": None if config.pause_split is None else config.pause_split.as_dict()}
    print(json.dumps({"benchmark": "tenants", "config": record, "machine": describe_host(), "medians": medians,
                      "ratios": ratios, "targets": targets, "runs": runs}))

if __name__ == "__main__":
    main()
