"""One RAM budget, priced (issue 35, item 2): the RAM controller against fixed splits of the same budget between
expert slots, state checkpoints and attention (KV) blocks, on a mixed workload with a phase change.

The embedded model is packed (once, into the user cache) and streamed with O_DIRECT reads. Workload, the same
for every arm:
  phase A (shared prefixes): --groups system prompts of --prefix-tokens tokens; --rounds rounds, each sending one
           request per group (the prompt plus 8 tokens of its own, 2 generated): prefixes recur, so checkpoints and
           cached blocks save their recompute;
  phase B (decode-heavy chat): --chats short prompts (8 tokens), 48 greedy tokens each, 8 at a time: routed
           experts recur, so expert slots save their reads.
The pools share --budget (expert slots are charged their 4 KiB-aligned stride, a checkpoint its state and tail
rows, a block its rows). Arms:
  default     budget.py's rule carried to one budget: expert slots first; KV blocks at the floor the engine needs
              (one sequence of max_model_len plus the watermark) and one checkpoint;
  fixed       every split of a grid (KV blocks x checkpoints, expert slots get the rest); the best is reported;
  controller  starts at the default split; RamController moves steps between the pools (engine/ram_pools.py);
  oracle      (--arms ...,oracle) a fixed arm told the phase change: phase A at the best fixed split, phase B at
              the default split (experts first), the bound a controller that learns from what it sees approaches.
Cost of a run, priced the controller's way (the same prices for every arm, measured once on a warm-up run):
    cost = expert and trunk bytes read x read seconds per byte + positions computed x compute seconds per position
Counts are exact, and a fixed arm's counts are deterministic, so its cost is too given the prices (the controller's
moves follow its own measured prices, so its counts may vary a little run to run); wall times (medians of --runs
alternated runs) are reported beside them. --prices READ,COMPUTE prices every arm with given prices (no warm-up),
--best-split skips the sweep, --arms picks the arms: quick experiments.

Prints the machine, one summary line, and a JSON record on the last line.

    python benchmarks/bench_ram_controller.py [--budget 2560K] [--runs 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.ram_controller import ControllerConfig, Prices
from k3serve.engine.ram_pools import attach_ram_controller
from k3serve.engine.sampling import SamplingParams
from k3serve.host import describe_host
from k3serve.loading import load_model
from k3serve.stream.options import StreamOptions
from k3serve.units import parse_size

MAX_MODEL_LEN = 512
BLOCK_SIZE = 16


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[str, list[list[int]], int]]:
    """Phases as (name, batches of prompts, max_tokens)."""
    rng = np.random.default_rng(11)
    systems = [[int(t) for t in rng.integers(3, vocab - 8, args.prefix_tokens)] for _ in range(args.groups)]
    prefix_rounds = [[s + [int(t) for t in rng.integers(3, vocab - 8, 8)] for s in systems]
                     for _ in range(args.rounds)]
    chats = [[int(t) for t in rng.integers(3, vocab - 8, 8)] for _ in range(args.chats)]
    chat_batches = [chats[i:i + 8] for i in range(0, len(chats), 8)]
    return [("prefix", prefix_rounds, 2), ("chat", chat_batches, 48)]


def resize_to(ctl, split: tuple[int, int, int]) -> None:
    """Set the pools to `split` (expert slots, checkpoints, KV blocks) between steps: shrinks first, so the budget
    holds at every point."""
    pools = ctl.pools.pools
    targets = {name: count * pools[name].unit_bytes for name, count in zip(("experts", "checkpoints", "kv"), split)}
    for name in sorted(targets, key=lambda n: targets[n] - pools[n].size_bytes):
        pools[name].resize(targets[name])
    assert ctl.pools.total_bytes <= ctl.pools.budget_bytes


def run_once(args: argparse.Namespace, split: tuple[int, int, int] | None, controller: bool,
             prices: Prices | None, phase_splits: dict[str, tuple[int, int, int]] | None = None) -> dict:
    """`split`: (expert slots, checkpoints, KV blocks) at the start. `phase_splits`: a fixed arm that is told the
    phase change (an oracle): the split each phase starts at."""
    loaded = load_model(None, stream=StreamOptions(io="direct", cache="lru"))
    model = loaded.model
    config = EngineConfig(max_seqs=8, max_batch_tokens=1024, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                          num_blocks=args.max_blocks, num_state_checkpoints=args.max_checkpoints)
    engine = LLMEngine(model, config, stop_ids=())
    experts, checkpoints, blocks = split
    ctl = attach_ram_controller(engine, args.budget, ControllerConfig(
        interval_steps=args.interval, step_bytes=args.step, hysteresis=args.hysteresis, cooldown_intervals=2,
        max_steps_per_move=getattr(args, "max_steps", 1)),
        experts=(experts, model.experts.slots.cache.max_slots), checkpoints=checkpoints, kv_blocks=blocks,
        enabled=controller)
    start_sizes = {name: pool.size_bytes for name, pool in ctl.pools.pools.items()}
    before = model.source.stats().stream
    started = time.perf_counter()
    phases: dict[str, dict] = {}
    steps = 0
    for phase, batches, max_tokens in workload(args, model.config.vocab_size):
        if phase_splits is not None and phase in phase_splits:
            resize_to(ctl, phase_splits[phase])
        phase_before = (model.source.stats().stream.bytes_read, int(engine.figures.computed.value))
        for batch in batches:
            for prompt in batch:
                engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
                assert ctl.pools.total_bytes <= ctl.pools.budget_bytes
        phases[phase] = {"bytes_read": model.source.stats().stream.bytes_read - phase_before[0],
                         "positions_computed": int(engine.figures.computed.value) - phase_before[1],
                         "end_step": steps}
    seconds = time.perf_counter() - started
    read = model.source.stats().stream.minus(before)
    computed = int(engine.figures.computed.value)
    steering = engine.ram_steering
    measured = steering.prices() if steering is not None else None
    model.source.close()
    record = {"split": list(split), "controller": controller, "wall_s": seconds,
              "bytes_read": read.bytes_read, "expert_bytes_read": read.expert_bytes_read,
              "io_wait_s": read.io_wait_seconds, "positions_computed": computed,
              "prefix_hit_tokens": engine.metrics.counter("prefix_cache_hit_tokens").value,
              "preemptions": engine.metrics.counter("preemptions").value, "phases": phases,
              "moves": [m.line() for m in ctl.moves], "start_bytes": start_sizes,
              "end_bytes": {name: pool.size_bytes for name, pool in ctl.pools.pools.items()}}
    if prices is not None:
        record["cost_s"] = read.bytes_read * prices.read_seconds_per_byte + computed * prices.compute_seconds_per_token
    if measured is not None:
        record["measured_prices"] = [measured.read_seconds_per_byte, measured.compute_seconds_per_token]
    return record


def kib(n: int) -> str:
    return f"{n / 1024:.0f}K"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="2560K", help="RAM for expert slots + checkpoints + KV blocks")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--max-blocks", type=int, default=320, help="the KV cap (blocks)")
    parser.add_argument("--max-checkpoints", type=int, default=16, help="the checkpoint cap")
    parser.add_argument("--interval", type=int, default=2, help="controller: steps between decisions")
    parser.add_argument("--step", default="512K", help="controller: bytes per move")
    parser.add_argument("--hysteresis", type=float, default=0.25)
    parser.add_argument("--max-steps", type=int, default=1, help="controller: most steps one move takes")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prices", default=None, metavar="READ,COMPUTE",
                        help="seconds per byte read and per position computed (default: measured on a warm-up run); "
                             "given, every arm's cost is priced the same way and the warm-up is skipped")
    parser.add_argument("--best-split", default=None, metavar="SLOTS,CKPTS,BLOCKS",
                        help="skip the sweep and take this split as the best fixed one")
    parser.add_argument("--arms", default="default,best_fixed,controller",
                        help="which arms to run --runs times (comma-separated)")
    args = parser.parse_args()
    args.budget = parse_size(args.budget)
    args.step = parse_size(args.step)
    probe = load_model(None, stream=StreamOptions(io="direct", cache="lru")).model
    stride = probe.experts.slots.stride
    max_slots = probe.experts.slots.cache.max_slots
    probe_engine = LLMEngine(probe, EngineConfig(max_seqs=8, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                                                 num_blocks=args.max_blocks,
                                                 num_state_checkpoints=args.max_checkpoints), stop_ids=())
    checkpoint_bytes = probe_engine.scheduler.prefix_cache.checkpoint_bytes
    block_bytes = probe_engine.config.block_bytes(probe.cache_layout)
    floor_blocks = -(-MAX_MODEL_LEN // BLOCK_SIZE) + probe_engine.scheduler.watermark_blocks
    probe.source.close()

    def split(checkpoints: int, blocks: int) -> tuple[int, int, int] | None:
        left = args.budget - checkpoints * checkpoint_bytes - blocks * block_bytes
        slots = min(max_slots, left // stride)
        return (slots, checkpoints, blocks) if slots >= 8 else None

    default = split(1, floor_blocks)
    if args.prices is not None:
        prices = Prices(*(float(x) for x in args.prices.split(",")))
    else:  # measured by the controller arm's own steering on a warm-up run (the cost formula's only inputs)
        warm = run_once(args, default, True, None)
        prices = Prices(*warm["measured_prices"])
    fixed: list[dict] = []
    if args.best_split is not None:
        best_split = tuple(int(x) for x in args.best_split.split(","))
    else:
        grid = [split(c, b) for c, b in itertools.product(
            (1, 2, 4, 8, 12, 16), (floor_blocks, 96, 128, 192)) if b >= floor_blocks]
        grid = [g for g in dict.fromkeys(grid) if g is not None]
        fixed = [run_once(args, g, False, prices) for g in grid]
        best_split = tuple(min(fixed, key=lambda r: r["cost_s"])["split"])
    # the oracle is told the phase change: phase A at the best fixed split, phase B at the default (experts first)
    oracle = {"prefix": best_split, "chat": default}
    arms = {"default": (default, False, None), "best_fixed": (best_split, False, None),
            "controller": (default, True, None), "oracle": (best_split, False, oracle)}
    arms = {name: arms[name] for name in args.arms.split(",")}
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for _ in range(args.runs):
        for name, (start, on, phase_splits) in arms.items():
            runs[name].append(run_once(args, start, on, prices, phase_splits))
    summary = {name: {"cost_s": statistics.median(r["cost_s"] for r in rs),
                      "wall_s": statistics.median(r["wall_s"] for r in rs),
                      "bytes_read": statistics.median(r["bytes_read"] for r in rs),
                      "positions_computed": statistics.median(r["positions_computed"] for r in rs)}
               for name, rs in runs.items()}
    record = {"benchmark": "ram_controller", "machine": describe_host(), "budget_bytes": args.budget,
              "units": {"expert_slot": stride, "checkpoint": checkpoint_bytes, "kv_block": block_bytes},
              "prices": [prices.read_seconds_per_byte, prices.compute_seconds_per_token],
              "sweep": [{"split": r["split"], "cost_s": r["cost_s"], "bytes_read": r["bytes_read"],
                         "positions_computed": r["positions_computed"]} for r in fixed],
              "best_fixed_split": list(best_split), "default_split": list(default), "summary": summary,
              "runs": runs, "args": {k: v for k, v in vars(args).items()}}
    print(f"machine: {record['machine']}")
    if not {"controller", "default", "best_fixed"} <= set(summary):
        print(" | ".join(f"{name} cost {s['cost_s']:.3f} (positions {s['positions_computed']}, "
                         f"{s['bytes_read'] / 1e6:.1f} MB)" for name, s in summary.items()))
        print(json.dumps(record))
        return
    c, d, b = (summary[n]["cost_s"] for n in ("controller", "default", "best_fixed"))
    print(f"budget {kib(args.budget)}: cost (priced s) controller {c:.3f} | best fixed {b:.3f} "
          f"(slots/ckpts/blocks {best_split}) | default {d:.3f} {default}: controller/best {c / b:.3f}, "
          f"default/controller {d / c:.2f}x; wall medians {summary['controller']['wall_s']:.2f} / "
          f"{summary['best_fixed']['wall_s']:.2f} / {summary['default']['wall_s']:.2f} s"
          + (f"; oracle (told the phase change) {summary['oracle']['cost_s']:.3f}" if "oracle" in summary else ""))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
