"""14. Budget isolation between tenants: a flood from tenant A and a light stream from tenant B, FCFS vs fair."""

from __future__ import annotations

import dataclasses

from k3serve.lab.isolation import IsolationConfig, run_isolation
from k3serve.lab.registry import Figure, LabModule, LabResult, Param
from k3serve.lab.timing import WARM_UP_MESSAGE
from k3serve.lab.verdict import judge

MODES = ("alone", "fcfs", "fair")


def run(params, progress, cancel, lab) -> LabResult:
    model = lab.loaded().model
    config = IsolationConfig(num_flood=params["flood_requests"], flood_prompt_tokens=params["flood_prompt_tokens"],
                             flood_max_tokens=params["flood_max_tokens"], light_prompt_tokens=params["light_prompt_tokens"],
                             light_max_tokens=8, light_interval_s=params["light_interval_s"],
                             duration_s=params["seconds"], max_batch_tokens=params["max_batch_tokens"],
                             max_seqs=params["flood_requests"] + 32, seed=0)
    cancel.check()
    progress(0.02, WARM_UP_MESSAGE)
    run_isolation(model, "fair", dataclasses.replace(config, duration_s=0.3))  # untimed: prefill and batched decode
    results = {}
    for i, mode in enumerate(MODES):  # a run cannot stop midway: cancellation takes effect between runs
        cancel.check()
        progress(0.05 + 0.3 * i, f"{mode}: {params['seconds']:g} s of traffic"
                                 + (" (B alone)" if mode == "alone" else f" with A flooding, {mode} scheduling"))
        results[mode] = run_isolation(model, mode, config)

    def summary(r) -> dict[str, float]:
        return {"b_ttft_p50_ms": 1e3 * r.light_ttft_p50, "b_ttft_p99_ms": 1e3 * r.light_ttft_p99,
                "b_unserved": float(r.light_unserved), "b_tok_per_s": r.light_tokens_per_s,
                "total_tok_per_s": r.total_tokens_per_s}

    rows = {mode: summary(r) for mode, r in results.items()}
    source = (f"{lab.model_name} in the engine, {params['seconds']:g} s per run on this machine: A keeps "
              f"{params['flood_requests']} requests of {params['flood_prompt_tokens']}+{params['flood_max_tokens']} "
              f"tokens live, B sends one of {params['light_prompt_tokens']}+8 every {params['light_interval_s']:g} s")
    figures = [
        Figure("Tenant B's time to first token", "bar", True, source,
               [{"name": name, "x": list(MODES), "y": [rows[m][key] for m in MODES]}
                for name, key in (("p50", "b_ttft_p50_ms"), ("p99", "b_ttft_p99_ms"))],
                y_label="time to first token (ms)"),
        Figure("Generated tokens per second", "bar", True, source,
               [{"name": name, "x": list(MODES), "y": [rows[m][key] for m in MODES]}
                for name, key in (("all tenants", "total_tok_per_s"), ("tenant B", "b_tok_per_s"))],
               y_label="generated tokens per second (tok/s)"),
    ]
    labels = {"b_ttft_p50_ms": "B's median TTFT (ms)", "b_ttft_p99_ms": "B's p99 TTFT (ms)",
              "b_unserved": "B requests still waiting at the end", "b_tok_per_s": "B's generated tok/s",
              "total_tok_per_s": "all generated tok/s"}
    alone = rows["alone"]["b_ttft_p99_ms"]
    # the step-budget model: under FCFS, B waits behind A's queued prompt positions; it stops waiting once A's
    # prompts and B's fit one step's budget together
    needed = params["flood_requests"] * params["flood_prompt_tokens"] + params["light_prompt_tokens"]
    throughput = rows["fair"]["total_tok_per_s"] / max(rows["fcfs"]["total_tok_per_s"], 1e-9)
    verdict = judge("Fair scheduling", "first come, first served", "b_ttft_p99_ms", "p99 time to first token for B",
                    rows["fair"]["b_ttft_p99_ms"], rows["fcfs"]["b_ttft_p99_ms"], higher_is_better=False,
                    flips_when=f"FCFS would serve B as well once A's prompts and B's fit one step: "
                               f"max_batch_tokens of at least {needed} (now {params['max_batch_tokens']}), by the "
                               f"step-budget model; fair kept {throughput:.2f}x FCFS's total throughput")
    progress(1.0, "done")
    return LabResult(rows["fair"], rows["fcfs"], figures, labels, metrics_name="fair (virtual token counter)",
                     verdict=verdict,
                     baseline_name="first come, first served",
                     notes=[f"B's p99 TTFT: alone {alone:.0f} ms, fcfs {rows['fcfs']['b_ttft_p99_ms']:.0f} ms, fair "
                            f"{rows['fair']['b_ttft_p99_ms']:.0f} ms",
                            "B requests without a first token when a run ends count with their wait so far (a lower "
                            "bound): starvation shows as a long tail"],
                     related_commands=["python benchmarks/bench_tenants.py"])


MODULE = LabModule(
    id="tenants", number=14, title="Budget isolation between tenants",
    summary="Tenant A floods the engine while tenant B sends light requests: B's wait under FCFS and fair scheduling.",
    explanation=(
        "With first-come-first-served admission, a tenant that keeps many long requests in flight takes every seat "
        "and every step's token budget, and a light tenant's requests queue behind it. Fair scheduling keeps a "
        "virtual token counter per tenant (tokens computed for it, weighted by its share) and serves the tenant "
        "with the lowest counter first; a tenant over its KV share is preempted first. B's time to first token "
        "then stays near what it is alone, at little cost in total throughput."),
    params=(Param("flood_requests", "int", 8, "A's live requests", min=1, max=64),
            Param("flood_prompt_tokens", "int", 128, "A's prompt length", min=1, max=1024, unit="tokens"),
            Param("flood_max_tokens", "int", 32, "A's generated tokens per request", min=1, max=256, unit="tokens"),
            Param("light_prompt_tokens", "int", 32, "B's prompt length", min=1, max=512, unit="tokens"),
            Param("light_interval_s", "float", 0.2, "B's arrival period", min=0.01, max=5.0, unit="s"),
            Param("max_batch_tokens", "int", 256, "positions per engine step", min=16, max=4096),
            Param("seconds", "float", 2.0, "traffic per run (three runs: alone, fcfs, fair)", min=0.5, max=30.0,
                  unit="s")),
    kind="measured", run=run)
