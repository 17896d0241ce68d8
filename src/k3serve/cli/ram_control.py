"""`--ram-controller`: one `--ram-budget` for the weights, the expert slots, the KV blocks and the state checkpoints,
moved between the pools by the RAM controller while the engine runs (engine/ram_controller.py, docs/STREAMING.md,
"One RAM budget, priced").

Without the flag, `--ram-budget` covers the weights only (stream/budget.py: trunk, I/O buffers, expert slots), and
the KV blocks (`--kv-cache-mib`) and checkpoints (`--state-checkpoints`) come on top. With it, the same budget holds
all five: the trunk and its buffers stay where the budget plan put them (a fixed pool: pinned layers first, as
much as `--pin-trunk` allows), and the rest starts at the default split (KV blocks at the engine's floor, one checkpoint, expert slots the remainder); the explicit flags stay
the pools' caps."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from k3serve.cli import args as cli_args
from k3serve.errors import UsageError
from k3serve.units import format_size, parse_size

if TYPE_CHECKING:
    from k3serve.engine.engine import LLMEngine
    from k3serve.engine.ram_controller import RamController

# defaults measured on benchmarks/bench_ram_controller.py (docs/STREAMING.md): interval 8 with 1/32 steps learns
# too slowly there (1.73x the best fixed split), interval 4 with 1/8 steps comes within 3% of it
DEFAULT_INTERVAL_STEPS = 4
STEP_FRACTION = 8  # the default step: 1/8 of what the pools share (the budget less the trunk's fixed part)


def add_ram_controller_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("one RAM budget, priced (docs/STREAMING.md; a packed model under --ram-budget)")
    g.add_argument("--ram-controller", action="store_true",
                   help="make --ram-budget cover the KV blocks and state checkpoints too, and move RAM between "
                        "expert slots, KV blocks and checkpoints by what each MiB saves (disk reads, recompute); "
                        "every move is in /metrics and the run report. --kv-cache-mib and --state-checkpoints "
                        "become the pools' caps (default: off, the budget covers the weights only)")
    g.add_argument("--ram-controller-interval", type=cli_args.positive_int, default=None, metavar="STEPS",
                   help=f"engine steps between the controller's decisions (default {DEFAULT_INTERVAL_STEPS})")
    g.add_argument("--ram-controller-step", type=cli_args.size, default=None, metavar="SIZE",
                   help=f"the most RAM one decision moves, e.g. 64M (default: 1/{STEP_FRACTION} of what the pools "
                        "share: --ram-budget less the trunk and its buffers)")


def check_ram_controller_args(args: argparse.Namespace) -> None:
    """Flags that cannot go together, refused before any model loads."""
    if not getattr(args, "ram_controller", False):
        for flag in ("ram_controller_interval", "ram_controller_step"):
            if getattr(args, flag, None) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} tunes --ram-controller: add --ram-controller")
        return
    if args.ram_budget is None:
        raise UsageError("--ram-controller shares --ram-budget between the pools: give --ram-budget SIZE (and a "
                         "packed model, or the embedded one, which is packed on first use)")
    if args.command == "cluster":
        raise UsageError("--ram-controller is not offered by `cluster` yet (each replica would need its own share of "
                         "the budget): use it with `serve` or `generate`")


def attach_from_args(engine: LLMEngine, args: argparse.Namespace) -> RamController | None:
    """Attach the controller to `engine` as the flags say (None without --ram-controller). The engine's model must
    stream its experts from a packed store (a `StreamingSource` with expert slots)."""
    if not getattr(args, "ram_controller", False):
        return None
    from k3serve.engine.ram_controller import ControllerConfig
    from k3serve.engine.ram_pools import attach_ram_controller
    from k3serve.stream.slots import ExpertSlots

    source = engine.model.experts
    slots = getattr(source, "slots", None)
    plan = getattr(source, "plan", None)
    if not isinstance(slots, ExpertSlots) or plan is None or plan.budget_bytes is None:
        raise UsageError("--ram-controller moves RAM between streamed expert slots, KV blocks and checkpoints: it "
                         "needs a model streamed from a packed store under --ram-budget (this one's experts are "
                         "resident)")
    budget = plan.budget_bytes
    fixed = plan.total_bytes - plan.expert_cache_bytes  # globals, pinned trunk, trunk buffers: never moved
    scheduler = engine.scheduler
    kv_floor = min(-(-engine.max_context // engine.config.block_size) + scheduler.watermark_blocks,
                   scheduler.blocks.num_blocks)
    kv_bytes = kv_floor * engine.config.block_bytes(engine.model.cache_layout) \
        if engine.model.cache_layout.attention_layers else 0
    prefix = scheduler.prefix_cache
    checkpoints = 1 if prefix is not None and prefix.store.num_slots else 0
    checkpoint_bytes = checkpoints * (prefix.checkpoint_bytes if prefix is not None else 0)
    left = budget - fixed - kv_bytes - checkpoint_bytes
    top_k = slots.cache.top_k
    if left < top_k * slots.stride:
        raise UsageError(
            f"--ram-budget {format_size(budget)} is too small for --ram-controller: the trunk and its buffers take "
            f"{format_size(fixed)}, the KV blocks one longest sequence needs {format_size(kv_bytes)} "
            f"({kv_floor} blocks; lower --max-model-len to need fewer), {checkpoints} checkpoint "
            f"{format_size(checkpoint_bytes)}, which leaves {format_size(max(left, 0))} for expert slots where one "
            f"token's {top_k} take {format_size(top_k * slots.stride)}"
            + ("" if plan.pinned_trunk_bytes == 0 else
               f"; {format_size(plan.pinned_trunk_bytes)} of the trunk is pinned: --pin-trunk SIZE pins less"))
    step = parse_size(args.ram_controller_step) if args.ram_controller_step is not None \
        else max((budget - fixed) // STEP_FRACTION, slots.stride)
    interval = args.ram_controller_interval or DEFAULT_INTERVAL_STEPS
    config = ControllerConfig(interval_steps=interval, step_bytes=step)
    return attach_ram_controller(engine, budget, config, experts=(left // slots.stride, slots.cache.max_slots),
                                 checkpoints=checkpoints if prefix is not None else None,
                                 kv_blocks=kv_floor if kv_bytes else None, fixed_bytes=fixed)
