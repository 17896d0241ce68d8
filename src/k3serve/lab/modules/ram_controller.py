"""21. One RAM budget, priced: the RAM controller's pools over time on a workload that changes phase, against the
default split and a fixed split of the same budget."""

from __future__ import annotations

import time

import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.errors import IntegrityError
from k3serve.engine.ram_controller import ControllerConfig, Prices
from k3serve.engine.ram_pools import attach_ram_controller
from k3serve.engine.sampling import SamplingParams
from k3serve.lab.registry import Figure, LabModule, LabParamError, LabResult, Param
from k3serve.lab.verdict import judge
from k3serve.stream.options import StreamOptions

MAX_MODEL_LEN = 512
BLOCK_SIZE = 16
MAX_BLOCKS = 320  # the KV cap (blocks), as benchmarks/bench_ram_controller.py
MAX_CHECKPOINTS = 16  # the checkpoint cap
POOLS = ("experts", "checkpoints", "kv")
ARMS = ("controller", "default split", "fixed split")


def _workload(params: dict, vocab: int) -> list[tuple[str, list[list[int]], int]]:
    """Phases as (name, batches of prompts, max_tokens): shared prefixes, then decode-heavy chat."""
    rng = np.random.default_rng(11)
    systems = [[int(t) for t in rng.integers(3, vocab - 8, params["prefix_tokens"])] for _ in range(params["groups"])]
    rounds = [[s + [int(t) for t in rng.integers(3, vocab - 8, 8)] for s in systems] for _ in range(params["rounds"])]
    chats = [[int(t) for t in rng.integers(3, vocab - 8, 8)] for _ in range(params["chats"])]
    return [("shared prefixes", rounds, 2), ("chat", [chats[i:i + 8] for i in range(0, len(chats), 8)], 48)]


def _engine(path, params: dict) -> tuple[LLMEngine, object]:
    from k3serve.loading import load_model

    model = load_model(path, stream=StreamOptions(io="direct", cache="lru")).model
    config = EngineConfig(max_seqs=8, max_batch_tokens=1024, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                          num_blocks=MAX_BLOCKS, num_state_checkpoints=MAX_CHECKPOINTS)
    return LLMEngine(model, config, stop_ids=()), model


def _run_arm(path, params: dict, split: tuple[int, int, int], controlled: bool, cancel) -> dict:
    """One run of the workload with the pools sized `split` = (expert slots, checkpoints, KV blocks) at the start;
    the controller moves them when `controlled`. Pool sizes are sampled after every engine step."""
    engine, model = _engine(path, params)
    try:
        config = ControllerConfig(interval_steps=params["interval"], step_bytes=params["step_kib"] << 10,
                                  hysteresis=params["hysteresis"], cooldown_intervals=2)
        ctl = attach_ram_controller(engine, params["budget_kib"] << 10, config,
                                    experts=(split[0], model.experts.slots.cache.max_slots), checkpoints=split[1],
                                    kv_blocks=split[2], enabled=controlled)
        sizes = {name: [] for name in POOLS}
        phase_starts = []
        before = model.source.stats().stream
        started = time.perf_counter()
        for name, batches, max_tokens in _workload(params, model.config.vocab_size):
            phase_starts.append((name, len(sizes["experts"])))
            for batch in batches:
                cancel.check()
                for prompt in batch:
                    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                while engine.has_unfinished_requests():
                    engine.step()
                    if ctl.pools.total_bytes > ctl.pools.budget_bytes:
                        raise IntegrityError(f"the pools hold {ctl.pools.total_bytes} bytes over a budget of "
                                             f"{ctl.pools.budget_bytes}")
                    for pool in POOLS:
                        sizes[pool].append(ctl.pools.pools[pool].size_bytes if pool in ctl.pools.pools else 0)
        seconds = time.perf_counter() - started
        read = model.source.stats().stream.minus(before)
        steering = engine.ram_steering
        return {"split": split, "seconds": seconds, "bytes_read": read.bytes_read,
                "positions_computed": int(engine.figures.computed.value),
                "prefix_hit_tokens": engine.metrics.counter("prefix_cache_hit_tokens").value,
                "moves": [m.line() for m in ctl.moves], "sizes": sizes, "phase_starts": phase_starts,
                "prices": steering.prices() if steering is not None else None}
    finally:
        model.source.close()


def _units(path, params: dict) -> dict[str, int]:
    """Bytes of one expert slot, checkpoint and KV block, the slot cap and the engine's KV floor (blocks)."""
    engine, model = _engine(path, params)
    try:
        return {"slot": model.experts.slots.stride, "max_slots": model.experts.slots.cache.max_slots,
                "checkpoint": engine.scheduler.prefix_cache.checkpoint_bytes,
                "block": engine.config.block_bytes(model.cache_layout),
                "floor_blocks": -(-MAX_MODEL_LEN // BLOCK_SIZE) + engine.scheduler.watermark_blocks}
    finally:
        model.source.close()


def _split(budget: int, units: dict[str, int], checkpoints: int, blocks: int) -> tuple[int, int, int]:
    left = budget - checkpoints * units["checkpoint"] - blocks * units["block"]
    slots = min(units["max_slots"], left // units["slot"])
    if slots < 8:
        raise LabParamError("budget_kib", f"{budget >> 10} KiB leaves {max(slots, 0)} expert slots after "
                                          f"{checkpoints} checkpoints and {blocks} KV blocks; at least 8 are needed")
    return slots, checkpoints, blocks


def _cost(run: dict, prices: Prices) -> float:
    return run["bytes_read"] * prices.read_seconds_per_byte + run["positions_computed"] * prices.compute_seconds_per_token


def run(params, progress, cancel, lab) -> LabResult:
    progress(0.02, "preparing the packed store (first use only)")
    path = lab.packed("natural")
    cancel.check()
    units = _units(path, params)
    budget = params["budget_kib"] << 10
    default = _split(budget, units, 1, units["floor_blocks"])
    fixed = _split(budget, units, params["fixed_checkpoints"], max(params["fixed_blocks"], units["floor_blocks"]))
    runs = {}
    for i, (arm, split, controlled) in enumerate((("controller", default, True), ("default split", default, False),
                                                  ("fixed split", fixed, False))):
        progress(0.05 + 0.3 * i, f"{arm}: slots {split[0]}, checkpoints {split[1]}, KV blocks {split[2]}")
        runs[arm] = _run_arm(path, params, split, controlled, cancel)
    prices = runs["controller"]["prices"]
    costs = {arm: _cost(r, prices) for arm, r in runs.items()}
    ctl, base, fix = runs["controller"], runs["default split"], runs["fixed split"]
    steps = list(range(1, len(ctl["sizes"]["experts"]) + 1))
    source = (f"{lab.model_name}, packed, streamed with O_DIRECT; {params['budget_kib']} KiB shared by expert slots "
              f"({units['slot'] >> 10} KiB each), checkpoints ({units['checkpoint'] / 1024:.0f} KiB) and KV blocks "
              f"({units['block'] / 1024:.0f} KiB); {params['groups']} shared {params['prefix_tokens']}-token prefixes "
              f"x {params['rounds']} rounds, then {params['chats']} chats of 48 tokens, 8 at a time; one run per arm")
    chat_step = dict(ctl["phase_starts"])["chat"]
    figures = [
        Figure("The controller's pools, step by step (the chat phase starts at step "
               f"{chat_step + 1})", "line", True, source,
               [{"name": pool, "x": steps, "y": [b / 2**20 for b in ctl["sizes"][pool]]} for pool in POOLS],
               x_label="engine step (index)", y_label="pool size (MiB)"),
        Figure("Cost of the workload, priced the controller's way", "bar", True,
               source + f"; cost = bytes read x {prices.read_seconds_per_byte * 2**20 * 1e3:.3f} ms/MiB + positions "
               f"computed x {prices.compute_seconds_per_token * 1e3:.3f} ms (the controller run's measured prices, "
               "the same for every arm)",
               [{"name": "cost", "x": list(ARMS), "y": [costs[a] for a in ARMS]}],
               y_label="priced cost (s)", highlight="controller"),
        Figure("Weight bytes read from the store (experts and trunk)", "bar", True, source,
               [{"name": "bytes read (MB)", "x": list(ARMS), "y": [runs[a]["bytes_read"] / 1e6 for a in ARMS]}],
               y_label="bytes read (MB)", highlight="controller"),
    ]
    figures.append(Figure("Prompt positions computed", "bar", True, source,
                          [{"name": "positions computed", "x": list(ARMS),
                            "y": [runs[a]["positions_computed"] for a in ARMS]}],
                          y_label="positions computed (positions)", highlight="controller"))

    def summary(arm: str) -> dict[str, float]:
        r = runs[arm]
        return {"cost_s": costs[arm], "bytes_read": float(r["bytes_read"]),
                "positions_computed": float(r["positions_computed"]), "prefix_hit_tokens": r["prefix_hit_tokens"],
                "moves": float(len(r["moves"])), "wall_s": r["seconds"]}

    metrics, baseline = summary("controller"), summary("default split")
    labels = {"cost_s": "priced cost: reads x read price + positions computed x compute price (s)", "bytes_read": "bytes read (B)",
              "positions_computed": "prompt positions computed", "prefix_hit_tokens": "positions from the prefix cache",
              "moves": "moves between pools", "wall_s": "wall time of the run (s; a timing)"}
    against_fixed = costs["controller"] / costs["fixed split"] if costs["fixed split"] > 0 else float("nan")
    learn_cost = costs["controller"] - costs["fixed split"]
    # cost = bytes x r + positions x c: the controller against the default split at other prices r / c
    saved_bytes = base["bytes_read"] - ctl["bytes_read"]
    saved_positions = base["positions_computed"] - ctl["positions_computed"]
    r_ms_per_mib = prices.read_seconds_per_byte * 2**20 * 1e3
    c_ms = prices.compute_seconds_per_token * 1e3
    fixed_words = (f"against the fixed split of {fixed[0]} slots, {fixed[1]} checkpoints and {fixed[2]} KV blocks it "
                   f"costs {against_fixed:.2f}x")
    if saved_bytes >= 0 and saved_positions >= 0:
        flips_when = (f"it reads {saved_bytes / 1e6:.1f} MB less and computes {saved_positions:,} fewer positions "
                      f"than the default split, so it wins at any read and compute prices; {fixed_words}")
    elif saved_bytes <= 0 and saved_positions <= 0:
        flips_when = f"it reads and computes no less than the default split at any prices; {fixed_words}"
    else:
        # break-even read price r* (ms/MiB) at this compute price: saved_bytes x r* + saved_positions x c = 0
        r_star = -saved_positions * c_ms / (saved_bytes / 2**20)
        side = "above" if saved_bytes < 0 else "below"
        flips_when = (f"it would flip with a read price {side} {r_star:.3f} ms/MiB (measured {r_ms_per_mib:.3f}) at "
                      f"{c_ms:.3f} ms per computed position: it reads {saved_bytes / 1e6:+.1f} MB less and computes "
                      f"{saved_positions:+,} fewer positions than the default split; {fixed_words}")
    verdict = judge("The RAM controller", "the default split", "cost_s", "priced cost", costs["controller"],
                    costs["default split"], higher_is_better=False, flips_when=flips_when)
    progress(1.0, "done")
    notes = [f"default split (budget.py's rule on one budget): {default[0]} expert slots, {default[1]} checkpoint, "
             f"{default[2]} KV blocks (the engine's floor); fixed split: {fixed[0]}, {fixed[1]}, {fixed[2]}",
             f"controller against the fixed split: {against_fixed:.2f}x its cost ({learn_cost:+.3f} priced s); "
             f"against the default: {costs['default split'] / costs['controller']:.2f}x cheaper",
             f"the controller's moves ({len(ctl['moves'])}): " + ("; ".join(ctl["moves"]) or "none"),
             "the fixed arms' counts (bytes read, positions computed) are exact and repeat; the controller's moves "
             "follow the prices it measures (this machine's timings), so its counts can differ a little from run to "
             "run, and so can every priced cost and wall time"]
    return LabResult(metrics, baseline, figures, labels, metrics_name="controller", baseline_name="default split",
                     verdict=verdict, notes=notes,
                     related_commands=["python benchmarks/bench_ram_controller.py --runs 3"])


MODULE = LabModule(
    id="ram_controller", number=21, title="One RAM budget, priced (the RAM controller)",
    summary="Expert slots, state checkpoints and KV blocks share one budget; a controller moves RAM to the pool "
            "that saves the most, as the workload changes phase.",
    explanation=(
        "Each pool reports what one more step of RAM would have saved in the last interval (its shadow or ghost "
        "hits: disk bytes not read x read price, positions not recomputed x compute price, preemptions avoided) and "
        "what one step less would have cost. Every interval the controller moves a step from the cheapest pool to "
        "the dearest when gain > (1 + hysteresis) x loss, never above the budget. Shared prefixes make checkpoints "
        "and KV blocks dear; decode-heavy chat makes expert slots dear."),
    params=(Param("budget_kib", "int", 2560, "RAM shared by expert slots, checkpoints and KV blocks", min=1024,
                  max=8192, unit="KiB"),
            Param("groups", "int", 4, "shared prefixes (phase 1)", min=1, max=8),
            Param("prefix_tokens", "int", 256, "shared prefix length", min=32, max=448, unit="tokens"),
            Param("rounds", "int", 8, "rounds of one request per prefix (phase 1)", min=1, max=24),
            Param("chats", "int", 8, "chat requests, 48 tokens each, 8 at a time (phase 2)", min=8, max=48),
            Param("interval", "int", 2, "controller: engine steps between decisions", min=1, max=16),
            Param("step_kib", "int", 512, "controller: bytes per move", min=64, max=2048, unit="KiB"),
            Param("hysteresis", "float", 0.25, "controller: a move needs gain > (1 + h) x loss", min=0.0, max=2.0),
            Param("fixed_checkpoints", "int", 12, "the fixed split's checkpoints", min=1, max=MAX_CHECKPOINTS),
            Param("fixed_blocks", "int", 96, "the fixed split's KV blocks (at least the engine's floor)", min=1,
                  max=MAX_BLOCKS)),
    kind="measured", run=run)
