"""10. The hybrid prefix cache: MLA blocks by hash plus KDA state checkpoints; TTFT with and without."""

from __future__ import annotations

import statistics

import numpy as np

from k3serve.lab.workloads import shared_prefix_ttft
from k3serve.lab.fixtures import MODEL_CHOICES
from k3serve.lab.registry import Figure, LabModule, LabResult, Param
from k3serve.lab.timing import WARM_UP_MESSAGE, repeats_param
from k3serve.lab.verdict import judge


def run(params, progress, cancel, lab) -> LabResult:
    model, stop_ids, model_name = lab.model_for(params["model"])
    cancel.check()
    progress(0.02, WARM_UP_MESSAGE)
    for caching in (True, False):  # miss, branch point and hit paths, each prefill's kernels compiled
        shared_prefix_ttft(model, stop_ids, caching, params["system_tokens"], min(params["requests"], 3),
                           np.random.default_rng(10_000), cancel.check)
    runs = {True: [], False: []}
    total = 2 * params["rounds"]
    for r in range(params["rounds"]):  # alternated: with, without, with, without
        for i, caching in enumerate((True, False)):
            cancel.check()
            progress(0.05 + 0.9 * (2 * r + i) / total, f"round {r + 1}: prefix cache {'on' if caching else 'off'}")
            runs[caching].append(shared_prefix_ttft(model, stop_ids, caching, params["system_tokens"],
                                                    params["requests"], np.random.default_rng(r), cancel.check))
    on, off = runs[True], runs[False]
    per_request = {k: [1e3 * statistics.median(run["ttfts"][i] for run in v) for i in range(params["requests"])]
                   for k, v in runs.items()}
    steady_on = statistics.median(x for run in on for x in run["ttfts"][2:]) if params["requests"] > 2 else \
        statistics.median(x for run in on for x in run["ttfts"])
    steady_off = statistics.median(x for run in off for x in run["ttfts"][2:]) if params["requests"] > 2 else \
        statistics.median(x for run in off for x in run["ttfts"])
    hit_rate = on[-1]["hit_tokens"] / max(on[-1]["query_tokens"], 1)
    source = (f"{model_name} in the engine, a {params['system_tokens']}-token shared prefix + 16 distinct tokens per "
              f"request, requests one after another, median of {params['rounds']} alternated rounds on this machine")
    positions = on[-1]["checkpoint_positions"]
    figures = [
        Figure("Time to first token, request by request", "line", True, source,
               [{"name": "prefix cache on", "x": list(range(1, params["requests"] + 1)), "y": per_request[True]},
                {"name": "prefix cache off", "x": list(range(1, params["requests"] + 1)), "y": per_request[False]}],
               x_label="request (index)", y_label="time to first token (ms)"),
    ]
    if positions:  # a model without recurrent layers (Qwen3-MoE, DeepSeek-V3) hits on attention blocks alone
        figures.append(Figure("Where recurrent state checkpoints sit (KDA or DeltaNet)", "bar", True,
                              "the prefix cache's checkpoints after the cached run (positions in tokens)",
                              [{"name": "checkpoint", "x": [str(p) for p in positions], "y": [1] * len(positions)}],
                              x_label="position", y_label="checkpoints (checkpoints)"))
    metrics = {"steady_ttft_ms": 1e3 * steady_on, "hit_rate_pct": 100 * hit_rate,
               "checkpoints": float(len(positions))}
    baseline = {"steady_ttft_ms": 1e3 * steady_off, "hit_rate_pct": 0.0, "checkpoints": 0.0}
    labels = {"steady_ttft_ms": "TTFT from the 3rd request on (ms)", "hit_rate_pct": "prompt positions restored, all requests (%)",
              "checkpoints": "recurrent state checkpoints held (KDA / DeltaNet; none in a model without them)"}
    # a miss with the cache on (requests 1 and 2: the lookup, the checkpoints saved) against the same request off
    misses = min(2, params["requests"])
    miss_cost = statistics.median(per_request[True][:misses]) - statistics.median(per_request[False][:misses])
    hit_saving = 1e3 * (steady_off - steady_on)
    if hit_saving <= 0:
        flips_when = f"a hit saves nothing here ({hit_saving:.1f} ms), so no share of repeats would make it pay"
    elif miss_cost <= 0:
        flips_when = (f"a miss costs no more with the cache on ({miss_cost:+.1f} ms), so it cannot lose on TTFT; "
                      "it gains whenever a prefix comes back")
    else:
        flips_when = (f"it would lose if fewer than {miss_cost / (miss_cost + hit_saving):.0%} of requests found their "
                      f"prefix: a miss costs {miss_cost:.1f} ms more with the cache on, a hit saves "
                      f"{hit_saving:.1f} ms")
    verdict = judge("The prefix cache", "no cache", "steady_ttft_ms", "time to first token", metrics["steady_ttft_ms"],
                    baseline["steady_ttft_ms"], higher_is_better=False, flips_when=flips_when)
    progress(1.0, "done")
    return LabResult(metrics, baseline, figures, labels, metrics_name="prefix cache on", baseline_name="off",
                     verdict=verdict,
                     notes=["request 1 misses; request 2 misses too but saves a checkpoint at the branch point "
                            "(where it diverges from request 1); from request 3 on the shared prefix is restored: "
                            "attention blocks (MLA or GQA) by chained hash, recurrent state (KDA or DeltaNet) from the "
                            "checkpoint at the exact position",
                            f"speed-up from request 3 on: {steady_off / steady_on:.2f}x"],
                     related_commands=["python benchmarks/bench_engine.py --quick"])


MODULE = LabModule(
    id="prefix_cache", number=10, title="Hybrid prefix cache",
    summary="Reuse a shared prompt prefix across requests: TTFT and hit rate with the cache on and off.",
    explanation=(
        "Attention layers can reuse cached rows of any prefix, but a KDA layer's state after position p is one "
        "matrix that folds in every token before p: it can only be restored at a position where it was saved. The "
        "hybrid cache keeps MLA blocks keyed by a chained hash h_i = H(h_{i-1}, tokens of block i) and KDA state "
        "checkpoints at exact positions (prompt ends, branch points where requests diverge, after generation). A hit "
        "restores both and prefills only the rest: TTFT ~ (prompt - cached) / prefill speed."),
    params=(Param("system_tokens", "int", 240, "shared prefix length", min=16, max=2000, unit="tokens"),
            Param("requests", "int", 5, "requests per round", min=2, max=32),
            repeats_param("rounds", help="alternated rounds (medians)"),
            Param("model", "choice", MODEL_CHOICES[0], "the lab's K3 model, or a random tiny model of a family "
                  "(its figures show the family's paths, not a released model's speed)", choices=MODEL_CHOICES)),
    kind="measured", run=run)
