"""The budget-isolation experiment: tenant A floods the engine, tenant B sends a steady light stream; how long does
B wait for its first token, alone, under `fcfs` and under `fair`?

A keeps `num_flood` long requests live (resubmitting each as it finishes); B submits a short request every
`light_interval_s`. Each request's arrival time is its due time, so time spent waiting for the step in flight
counts. The engine is driven directly on this thread, for `duration_s` per run; arrivals that fall due during a
forward are submitted between two of its layers (as a server thread would submit them), and a B request's first
token counts when the engine streams it. B's requests still without a first token when a run ends count with their
wait so far (a lower bound), so starvation shows as a long tail rather than as missing samples. Used by
`benchmarks/bench_tenants.py` and the lab.

With `clock="model"` the same engine runs the same forwards, but time is virtual: each forward advances the clock by
    t_forward = fixed + per_token * (positions in the forward)
in equal parts after each of its L layers, with (fixed, per_token) calibrated once from the fastest of a few timed
forwards (`calibrate_step_cost`). The scheduling decisions are real; only the clock is a model, so results do not
depend on what else the machine runs. `step_interruption` turns on the engine's switch of that name
(engine/engine.py) in all three runs (fcfs never interrupts).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.request import RequestOutput
from k3serve.engine.metrics import _quantile
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import ConfigError
from k3serve.model.k3 import ForwardItem, K3Model

FLOOD, LIGHT = "A", "B"


@dataclass(frozen=True)
class IsolationConfig:
    num_flood: int = 32  # A's live requests
    flood_prompt_tokens: int = 192
    flood_max_tokens: int = 48
    light_prompt_tokens: int = 48
    light_max_tokens: int = 8
    light_interval_s: float = 0.1  # B's arrival period
    duration_s: float = 20.0  # per run
    max_batch_tokens: int = 256
    max_seqs: int = 64
    seed: int = 0
    clock: str = "wall"  # wall: real time; model: each step advances a virtual clock by fixed + per_token x tokens
    step_cost: tuple[float, float] | None = None  # (fixed s, s per token) for the model clock; None = calibrate
    step_interruption: bool = False  # EngineConfig.step_interruption for every run

    def __post_init__(self) -> None:
        for name in ("num_flood", "flood_prompt_tokens", "flood_max_tokens", "light_prompt_tokens",
                     "light_max_tokens", "max_batch_tokens", "max_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"IsolationConfig.{name} must be a positive integer, got {value!r}")
        for name in ("light_interval_s", "duration_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"IsolationConfig.{name} must be a positive number, got {value!r}")
        if self.clock not in ("wall", "model"):
            raise ConfigError(f"IsolationConfig.clock must be wall or model, got {self.clock!r}")
        if self.max_seqs <= self.num_flood:
            raise ConfigError("IsolationConfig.max_seqs must leave seats for B beside A's num_flood requests")


@dataclass(frozen=True)
class IsolationResult:
    """One run. TTFTs in seconds; throughputs in generated tokens per second."""

    mode: str  # alone (B only, fair), fcfs or fair
    light_ttft_p50: float
    light_ttft_p99: float
    light_requests: int  # B requests that arrived
    light_unserved: int  # of them, without a first token at the end (counted with their wait so far)
    light_tokens_per_s: float
    total_tokens_per_s: float
    computed_tokens_per_s: float  # prompt + generated positions through the model
    duration_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_isolation(model: K3Model, mode: str, config: IsolationConfig = IsolationConfig()) -> IsolationResult:
    """One run: `mode` is 'alone' (B without A, fair), 'fcfs' or 'fair'."""
    if mode not in ("alone", "fcfs", "fair"):
        raise ConfigError(f"mode must be alone, fcfs or fair, got {mode!r}")
    scheduling = "fair" if mode == "alone" else mode
    needed = config.num_flood * (config.flood_prompt_tokens + config.flood_max_tokens) * 2
    engine_config = EngineConfig(max_batch_tokens=config.max_batch_tokens, max_seqs=config.max_seqs,
                                 num_blocks=max(64, needed // 16 + 64), block_size=16,
                                 max_model_len=max(config.flood_prompt_tokens + config.flood_max_tokens,
                                                   config.light_prompt_tokens + config.light_max_tokens) + 1,
                                 enable_prefix_caching=False, scheduling=scheduling,
                                 step_interruption=config.step_interruption)
    virtual = [0.0]
    if config.clock == "model":
        fixed, per_token = config.step_cost if config.step_cost is not None else calibrate_step_cost(model)
        num_layers = model.config.num_layers

        def clock() -> float:
            return virtual[0]
    else:
        clock = time.perf_counter
    rng = np.random.default_rng(config.seed)
    vocab = model.config.vocab_size

    def prompt(length: int) -> list[int]:
        return [int(t) for t in rng.integers(1, vocab, size=length)]

    light_params = SamplingParams(max_tokens=config.light_max_tokens, ignore_eos=True)
    light_arrival: dict[str, float] = {}
    light_ttft: dict[str, float] = {}
    running = [False]  # the clock has started
    next_light = [0.0]

    def first_token(out: RequestOutput) -> None:
        if out.outputs[0].token_ids and out.request_id not in light_ttft:
            light_ttft[out.request_id] = clock() - light_arrival[out.request_id]

    def submit_due_light() -> None:
        now = clock()
        while running[0] and next_light[0] <= now:
            request = engine.make_request(prompt(config.light_prompt_tokens), light_params, tenant=LIGHT,
                                          on_output=first_token)
            request.arrival_time = next_light[0]
            light_arrival[engine.enqueue(request)] = next_light[0]
            next_light[0] += config.light_interval_s

    def on_layer(num_positions: int) -> None:
        if config.clock == "model":
            virtual[0] += (fixed + per_token * num_positions) / num_layers
        submit_due_light()

    engine = LLMEngine(model, engine_config, stop_ids=(), on_layer=on_layer)
    engine.add_request(prompt(config.flood_prompt_tokens), SamplingParams(max_tokens=2, ignore_eos=True),
                       tenant="warm-up")  # compile and touch everything before the clock starts
    while engine.has_unfinished_requests():
        engine.step()
    flood_params = SamplingParams(max_tokens=config.flood_max_tokens, ignore_eos=True)
    flood_live = 0
    generated = {FLOOD: 0, LIGHT: 0}
    computed = engine.metrics.counter("computed_tokens")
    computed_before = computed.value
    start = clock()
    end = start + config.duration_s
    next_light[0] = start
    running[0] = True
    while True:
        now = clock()
        if now >= end:
            break
        while mode != "alone" and flood_live < config.num_flood:
            engine.add_request(prompt(config.flood_prompt_tokens), flood_params, tenant=FLOOD)
            flood_live += 1
        submit_due_light()
        if not engine.has_unfinished_requests():
            if config.clock == "model":
                virtual[0] = min(next_light[0], end)
            else:
                time.sleep(max(0.0, min(next_light[0], end) - time.perf_counter()))
            continue
        for out in engine.step():
            tenant = LIGHT if out.request_id in light_arrival else FLOOD
            generated[tenant] += sum(len(c.new_token_ids) for c in out.outputs)
            if tenant == FLOOD and out.finished:
                flood_live -= 1
    running[0] = False
    elapsed = clock() - start
    waits = [light_ttft.get(rid, elapsed + start - arrival) for rid, arrival in light_arrival.items()]
    waits.sort()
    positions = computed.value - computed_before
    return IsolationResult(mode, _quantile(waits, 0.5), _quantile(waits, 0.99), len(waits),
                           len(waits) - len(light_ttft), generated[LIGHT] / elapsed,
                           (generated[LIGHT] + generated[FLOOD]) / elapsed, positions / elapsed, elapsed)


def calibrate_step_cost(model: K3Model, num_tokens: int = 256, repeats: int = 5) -> tuple[float, float]:
    """(fixed seconds, seconds per position) of one forward, from the fastest of `repeats` timed forwards of 1
    and of `num_tokens` positions (the fastest is the least disturbed by other work on the machine)."""
    def fastest(length: int) -> float:
        best = math.inf
        for _ in range(repeats):
            cache = model.new_cache()
            started = time.perf_counter()
            model.forward([ForwardItem(np.arange(1, length + 1, dtype=np.int64) % model.config.vocab_size, cache)])
            best = min(best, time.perf_counter() - started)
        return best

    one, many = fastest(1), fastest(num_tokens)
    per_token = max(many - one, 0.0) / (num_tokens - 1)
    return max(one - per_token, 0.0), per_token


def compare_isolation(model: K3Model | None = None, config: IsolationConfig | None = None,
                      modes: tuple[str, ...] = ("alone", "fcfs", "fair")) -> dict[str, IsolationResult]:
    """Run each mode once with the same workload (the embedded model when `model` is None). For the lab, small
    sizes finish in about ten seconds: `IsolationConfig(num_flood=8, duration_s=3)`."""
    if model is None:
        from k3serve.loading import load_model

        model = load_model(None).model
    config = config if config is not None else IsolationConfig()
    return {mode: run_isolation(model, mode, config) for mode in modes}


def summary(results: dict[str, IsolationResult]) -> dict[str, float]:
    """The ratios the benchmark reports: fair and fcfs B TTFT over alone, fair total throughput (positions computed
    per second) over fcfs."""
    out: dict[str, float] = {}
    alone = results.get("alone")
    for mode in ("fcfs", "fair"):
        if alone is not None and mode in results and alone.light_ttft_p99 > 0:
            out[f"{mode}_p99_over_alone"] = results[mode].light_ttft_p99 / alone.light_ttft_p99
            out[f"{mode}_p50_over_alone"] = results[mode].light_ttft_p50 / alone.light_ttft_p50
    if "fcfs" in results and "fair" in results and results["fcfs"].computed_tokens_per_s > 0:
        out["fair_throughput_over_fcfs"] = \
            results["fair"].computed_tokens_per_s / results["fcfs"].computed_tokens_per_s
    return {k: v for k, v in out.items() if math.isfinite(v)}
