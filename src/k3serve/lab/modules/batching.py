"""11. Continuous batching and chunked prefill: tok/s, TTFT and inter-token latency vs concurrency."""

from __future__ import annotations

import statistics
import time

import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.lab.workloads import run_all
from k3serve.lab.fixtures import MODEL_CHOICES
from k3serve.lab.registry import Figure, LabModule, LabResult, Param
from k3serve.lab.timing import WARM_UP_MESSAGE, repeats_param
from k3serve.lab.verdict import EVEN_BAND, judge

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)


class Timeline:
    """Arrival and token times of every request (from the engine's per-request output callback)."""

    def __init__(self) -> None:
        self.token_times: dict[str, list[float]] = {}
        self.counts: dict[str, int] = {}

    def callback(self, out) -> None:
        now = time.perf_counter()
        produced = len(out.outputs[0].token_ids)
        new = produced - self.counts.get(out.request_id, 0)
        self.counts[out.request_id] = produced
        self.token_times.setdefault(out.request_id, []).extend([now] * new)

    def inter_token_gaps(self, ids=None) -> list[float]:
        gaps = []
        for request_id, times in self.token_times.items():
            if ids is None or request_id in ids:
                gaps += [b - a for a, b in zip(times, times[1:]) if b > a]
        return gaps


def serve(model, stop_ids, concurrency: int, max_seqs: int, params, cancel) -> dict[str, float]:
    config = EngineConfig(max_seqs=max_seqs, max_batch_tokens=params["max_batch_tokens"], enable_prefix_caching=False)
    engine = LLMEngine(model, config, stop_ids=stop_ids)
    rng = np.random.default_rng(concurrency)
    timeline = Timeline()
    for _ in range(concurrency):
        engine.add_request([int(t) for t in rng.integers(3, model.config.vocab_size, params["prompt_tokens"])],
                           SamplingParams(max_tokens=params["max_tokens"], ignore_eos=True),
                           on_output=timeline.callback)
    started = time.perf_counter()
    final = run_all(engine, between=cancel.check)
    elapsed = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in final.values())
    gaps = timeline.inter_token_gaps()
    return {"tok_per_s": generated / elapsed, "ttft_ms": 1e3 * statistics.median(o.ttft_seconds for o in final.values()),
            "itl_ms": 1e3 * statistics.median(gaps) if gaps else float("nan"),
            "itl_p90_ms": 1e3 * float(np.percentile(gaps, 90)) if gaps else float("nan")}


def long_prompt_stall(model, stop_ids, chunked: bool, params, cancel) -> float:
    """Worst inter-token gap (ms) of 4 decoding requests while a long prompt arrives and is prefilled."""
    long = params["long_prompt_tokens"]
    # unchunked, a prompt must fit one step: give that step room for the whole prompt and the decodes
    budget = params["max_batch_tokens"] if chunked else max(params["max_batch_tokens"], long + 8)
    config = EngineConfig(max_seqs=8, max_batch_tokens=budget, enable_prefix_caching=False,
                          enable_chunked_prefill=chunked)
    engine = LLMEngine(model, config, stop_ids=stop_ids)
    rng = np.random.default_rng(5)
    timeline = Timeline()
    decoders = [engine.add_request([int(t) for t in rng.integers(3, model.config.vocab_size, 8)],
                                   SamplingParams(max_tokens=24, ignore_eos=True), on_output=timeline.callback)
                for _ in range(4)]
    for _ in range(4):
        engine.step()
    engine.add_request([int(t) for t in rng.integers(3, model.config.vocab_size, long)],
                       SamplingParams(max_tokens=2, ignore_eos=True))
    run_all(engine, between=cancel.check)
    gaps = timeline.inter_token_gaps(set(decoders))
    return 1e3 * max(gaps) if gaps else float("nan")


def run(params, progress, cancel, lab) -> LabResult:
    model, stop_ids, model_name = lab.model_for(params["model"])
    sweep = [c for c in CONCURRENCY if c <= params["max_concurrency"]]
    progress(0.02, WARM_UP_MESSAGE)
    serve(model, stop_ids, sweep[0], 64, params, cancel)
    for chunked in (True, False):
        long_prompt_stall(model, stop_ids, chunked, params, cancel)
    repeats = params["repeats"]
    samples: dict[int, list[dict[str, float]]] = {c: [] for c in sweep}
    stalls: dict[bool, list[float]] = {True: [], False: []}
    for r in range(repeats):  # alternated: the whole sweep, then both stall runs, once per repeat
        for i, c in enumerate(sweep):
            progress(0.1 + 0.85 * (r + 0.7 * i / len(sweep)) / repeats, f"repeat {r + 1}: {c} requests at once")
            samples[c].append(serve(model, stop_ids, c, 64, params, cancel))
        progress(0.1 + 0.85 * (r + 0.7) / repeats, f"repeat {r + 1}: a long prompt arriving during decodes")
        for chunked in (True, False):
            stalls[chunked].append(long_prompt_stall(model, stop_ids, chunked, params, cancel))
    rows = {c: {key: statistics.median(s[key] for s in runs) for key in runs[0]} for c, runs in samples.items()}
    stall = {chunked: statistics.median(values) for chunked, values in stalls.items()}
    top = sweep[-1]
    # the same `top` requests one at a time: request i starts when i - 1 have finished (from the measured C = 1 run)
    one = rows[1]
    request_ms = 1e3 * params["max_tokens"] / one["tok_per_s"]
    serial = {"tok_per_s": one["tok_per_s"], "itl_ms": one["itl_ms"], "itl_p90_ms": one["itl_p90_ms"],
              "ttft_ms": statistics.median(one["ttft_ms"] + i * request_ms for i in range(top))}
    source = (f"{model_name} in the engine, requests of {params['prompt_tokens']} prompt + {params['max_tokens']} "
              f"generated tokens, medians of {repeats} alternated repeats on this machine")
    figures = [
        Figure("Throughput vs concurrency", "line", True, source,
               [{"name": "continuous batching", "x": sweep, "y": [rows[c]["tok_per_s"] for c in sweep]},
                {"name": "one at a time", "x": sweep, "y": [rows[1]["tok_per_s"]] * len(sweep)}],
               x_label="requests in flight (requests)", y_label="generated tokens per second (tok/s)"),
        Figure("Latency vs concurrency", "line", True, source,
               [{"name": "TTFT median", "x": sweep, "y": [rows[c]["ttft_ms"] for c in sweep]},
                {"name": "inter-token median", "x": sweep, "y": [rows[c]["itl_ms"] for c in sweep]},
                {"name": "inter-token p90", "x": sweep, "y": [rows[c]["itl_p90_ms"] for c in sweep]}],
               x_label="requests in flight (requests)", y_label="latency (ms)"),
        Figure(f"Worst decode stall while a {params['long_prompt_tokens']}-token prompt arrives", "bar", True,
               f"4 decoding requests, max_batch_tokens {params['max_batch_tokens']}, medians of {repeats} repeats on "
               "this machine",
               [{"name": "ms", "x": ["chunked prefill", "whole prompt in one step"],
                 "y": [stall[True], stall[False]]}], y_label="worst gap between decode steps (ms)"),
    ]
    batched = rows[top]
    metrics = {**batched, "decode_stall_ms": stall[True]}
    baseline = {**serial, "decode_stall_ms": stall[False]}
    labels = {"tok_per_s": f"generated tok/s ({top} requests)", "ttft_ms": "median time to first token (ms)",
              "itl_ms": "median inter-token latency (ms)", "itl_p90_ms": "p90 inter-token latency (ms)",
              "decode_stall_ms": "worst decode gap while a long prompt arrives (ms)"}
    progress(1.0, "done")
    notes = [f"{top} requests: {batched['tok_per_s'] / serial['tok_per_s']:.2f}x the tokens/s of serving them one at "
             "a time; the one-at-a-time column is computed from the measured single-request run (request i waits for "
             "i - 1 whole requests)",
             f"unchunked prefill runs the {params['long_prompt_tokens']}-token prompt in one step (its budget raised "
             f"to fit); chunked splits it into steps of {params['max_batch_tokens']} positions"]
    gains = {c: rows[c]["tok_per_s"] / one["tok_per_s"] for c in sweep}
    first_win = next((c for c in sweep if gains[c] > 1 + EVEN_BAND), None)
    itl = batched["itl_ms"] / one["itl_ms"] if one["itl_ms"] > 0 else float("nan")
    if first_win is None:
        flips_when = f"it gained nothing at any concurrency swept (1 to {top} requests in flight)"
    else:
        flips_when = (f"with one request in flight there is nothing to batch; it wins from {first_win} requests in "
                      f"flight on ({gains[first_win]:.2f}x there, the concurrency sweep), each request's inter-token "
                      f"latency {itl:.2f}x at {top}")
    verdict = judge(f"Continuous batching of {top} requests", "serving them one at a time", "tok_per_s",
                    "tokens per second", batched["tok_per_s"], serial["tok_per_s"], higher_is_better=True,
                    flips_when=flips_when)
    return LabResult(metrics, baseline, figures, labels, metrics_name="continuous batching, chunked prefill",
                     verdict=verdict,
                     baseline_name="one at a time; unchunked prefill", notes=notes,
                     related_commands=["python benchmarks/bench_engine.py --quick"])


MODULE = LabModule(
    id="batching", number=11, title="Continuous batching and chunked prefill",
    summary="Serve many requests in one forward per step: tok/s, TTFT and inter-token latency vs concurrency.",
    explanation=(
        "Each engine step runs one forward over every running sequence: decodes (one position each) and chunks of "
        "new prompts, up to max_batch_tokens positions. The weights read for a step serve every sequence in it, so "
        "throughput grows with the batch until compute saturates, while each sequence's inter-token latency grows "
        "slowly. New requests join at the next step (continuous batching) instead of waiting for a batch to drain. "
        "Chunked prefill splits a long prompt across steps, so running decodes keep producing a token every step."),
    params=(Param("max_concurrency", "int", 8, "largest number of requests in flight", min=1, max=64),
            Param("prompt_tokens", "int", 16, "prompt per request", min=1, max=1024, unit="tokens"),
            Param("max_tokens", "int", 8, "generated per request", min=2, max=256, unit="tokens"),
            Param("max_batch_tokens", "int", 128, "positions per step (prefill chunk budget)", min=16, max=8192),
            Param("long_prompt_tokens", "int", 384, "the long prompt of the stall figure", min=16, max=4000,
                  unit="tokens"),
            Param("model", "choice", MODEL_CHOICES[0], "the lab's K3 model, or a random tiny model of a family "
                  "(its figures show the family's paths, not a released model's speed)", choices=MODEL_CHOICES),
            repeats_param()),
    kind="measured", run=run)
