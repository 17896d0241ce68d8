"""The budget-isolation experiment: tenant A floods the engine, tenant B sends a steady light stream; how long does
B wait for its first token, alone, under `fcfs` and under `fair`?

A keeps `num_flood` long requests live (resubmitting each as it finishes); B submits a short request every
`light_interval_s`. Each request's arrival time is its due time, so time spent waiting for the step in flight
counts. The engine is driven directly on this thread, for `duration_s` per run; arrivals that fall due during a
forward are submitted at its next pause point (as a server thread would submit them), and a B request's first
token counts when the engine streams it. B's requests still without a first token when a run ends count with their
wait so far (a lower bound), so starvation shows as a long tail rather than as missing samples. Used by
`benchmarks/bench_tenants.py` and the lab.

With `clock="model"` the same engine runs the same forwards, but time is virtual: each forward of n positions costs
    t_forward = fixed + per_token * n
advanced in 2L parts, one at each of the model's pause points (model/k3.py `pause_points`: after each layer's
attention, the mixer, and after its MLP or MoE) and the last at the end: part k advances it by
    fixed * fixed_share[k] + per_token * n * token_share[k]
(fixed, per_token) come from the fastest of a few timed forwards (`calibrate_step_cost`); the shares from the
median time of each part of each layer over repeated forwards of 1 and of 256 positions (`measure_pause_split`,
`PauseSplit.shares`), since the parts differ (a KDA mixer costs more than an MLA one, layer 0's MLP is dense). The
scheduling decisions are real; only the clock is a model, so results do not depend on what else the machine runs.
`step_interruption` turns on the engine's switch of that name (engine/engine.py) in all three runs (fcfs never
interrupts).
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
from k3serve.model.interface import MIXER, ForwardItem, Model

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
    pause_split: PauseSplit | None = None  # each part's share of a forward, for the model clock; None = measure
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


def run_isolation(model: Model, mode: str, config: IsolationConfig = IsolationConfig()) -> IsolationResult:
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
        split = config.pause_split if config.pause_split is not None else measure_pause_split(model)
        if split.num_layers != model.config.num_layers:
            raise ConfigError(f"the pause split was measured on {split.num_layers} layers, the model has "
                              f"{model.config.num_layers}")
        fixed_shares, token_shares = (shares.tolist() for shares in split.shares)  # Python floats on the clock

        def part_cost(num_positions: int, layer: int, part: str) -> float:
            """Seconds of one part of one layer of a forward over `num_positions`."""
            k = 2 * layer + (part != MIXER)
            return fixed * fixed_shares[k] + per_token * num_positions * token_shares[k]

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

    def on_pause(num_positions: int, layer: int, part: str) -> None:
        if config.clock == "model":
            virtual[0] += part_cost(num_positions, layer, part)
        submit_due_light()

    engine = LLMEngine(model, engine_config, stop_ids=(), on_pause=on_pause)
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


def calibrate_step_cost(model: Model, num_tokens: int = 256, repeats: int = 5) -> tuple[float, float]:
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


@dataclass(frozen=True)
class PauseSplit:
    """Median seconds of each part of each layer of a forward (`measure_pause_split`), at two lengths."""

    lengths: tuple[int, int]  # positions per forward: (short, long)
    mixer: tuple[tuple[float, ...], tuple[float, ...]]  # per length, per layer: embedding (layer 0) + attention
    mlp: tuple[tuple[float, ...], tuple[float, ...]]  # per length, per layer: MLP or MoE (+ the logits after the last)

    def __post_init__(self) -> None:
        if len(self.lengths) != 2 or not 1 <= self.lengths[0] < self.lengths[1]:
            raise ConfigError(f"PauseSplit.lengths must be two increasing positive lengths, got {self.lengths!r}")
        sizes = {len(times) for part in (self.mixer, self.mlp) for times in part}
        if len(self.mixer) != 2 or len(self.mlp) != 2 or len(sizes) != 1 or \
                not all(t >= 0 for part in (self.mixer, self.mlp) for times in part for t in times):
            raise ConfigError("PauseSplit needs, for each of its two lengths, one time >= 0 per layer for the mixer "
                              "and for the MLP")

    @property
    def num_layers(self) -> int:
        return len(self.mixer[0])

    def seconds(self, index: int) -> np.ndarray:
        """[2L]: every part's time at lengths[index], in pause-point order (layer 0 mixer, layer 0 MLP, ...)."""
        return np.column_stack([self.mixer[index], self.mlp[index]]).ravel()

    def mixer_fraction(self, index: int) -> float:
        """The mixers' share of the forward's time at lengths[index]."""
        return sum(self.mixer[index]) / float(self.seconds(index).sum())

    @property
    def shares(self) -> tuple[np.ndarray, np.ndarray]:
        """[2L] each, summing to 1: every part's share of a forward's fixed cost and of its per-position cost, from
        its time fitted as a + b x positions through the two lengths (an a or b below zero, noise, counts as 0)."""
        (short, long), (t_short, t_long) = self.lengths, (self.seconds(0), self.seconds(1))
        per_token = np.maximum((t_long - t_short) / (long - short), 0.0)
        fixed = np.maximum(t_short - per_token * short, 0.0)
        return fixed / fixed.sum(), per_token / per_token.sum()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PauseSplit:
        """The `as_dict` form back (a JSON record); a malformed one raises ConfigError."""
        try:
            mixer, mlp = (tuple(tuple(float(t) for t in times) for times in data[part]) for part in ("mixer", "mlp"))
            return cls(tuple(int(n) for n in data["lengths"]), mixer, mlp)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a pause split record ({exc})") from exc


def measure_pause_split(model: Model, lengths: tuple[int, int] = (1, 256), repeats: int = 21) -> PauseSplit:
    """Time every part of every layer of `repeats` forwards of each length (a fresh sequence each), stamping
    `time.perf_counter` at each pause point; medians, which a busy machine disturbs less than the means."""
    num_layers = model.config.num_layers
    mixer: list[tuple[float, ...]] = []
    mlp: list[tuple[float, ...]] = []
    for length in lengths:
        ids = np.arange(1, length + 1, dtype=np.int64) % model.config.vocab_size
        samples = []
        for _ in range(repeats + 1):  # the first forward warms up (compiles, touches the weights)
            stamps = [time.perf_counter()]
            model.forward([ForwardItem(ids, model.new_cache())], at_pause=lambda layer, part: stamps.append(
                time.perf_counter()))
            stamps.append(time.perf_counter())
            samples.append(np.diff(stamps))  # [2L]: layer 0 mixer, layer 0 MLP, ...
        part = np.median(np.array(samples[1:]), axis=0).reshape(num_layers, 2)  # [L, (mixer, MLP)]
        mixer.append(tuple(part[:, 0].tolist()))
        mlp.append(tuple(part[:, 1].tolist()))
    return PauseSplit(lengths, (mixer[0], mixer[1]), (mlp[0], mlp[1]))


def compare_isolation(model: Model | None = None, config: IsolationConfig | None = None,
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
