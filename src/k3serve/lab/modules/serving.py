"""19. End-to-end serving: a real `k3serve serve` driven by the official openai client; fcfs vs fair between two
tenants."""

from __future__ import annotations

import contextlib
import secrets
import statistics
import tempfile
from pathlib import Path

import numpy as np

from k3serve.lab.registry import Figure, LabModule, LabResult, Param, Verdict
from k3serve.lab.server_process import ServerProcess, stop_all
from k3serve.lab.serving_load import PERCENTILES, concurrency_run, import_client, tenants_run
from k3serve.lab.timing import WARM_UP_MESSAGE, repeats_param
from k3serve.lab.verdict import sentence_case

CONCURRENCY = (1, 2, 4, 8, 16, 32)
MODES = ("fcfs", "fair")
SERVED_NAME = "lab"
LIGHT_PROMPT_TOKENS, LIGHT_MAX_TOKENS = 16, 4
EVEN_BAND = 0.05  # within 5% the verdict says "even"


def _tenants_file(folder: Path, keys: dict[str, str]) -> Path:
    from k3serve.serve.tenants import hash_key

    lines = []
    for name, key in keys.items():
        lines += [f"[tenants.{name}]", f'keys = ["{hash_key(key)}"]', "weight = 1.0", ""]
    path = folder / "tenants.toml"
    path.write_text("\n".join(lines))
    return path


def _prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab_size, length)] for _ in range(count)]


def _median_point(points: list) -> dict[str, float]:
    return {"tok_per_s": statistics.median(p.tok_per_s for p in points),
            **{f"ttft_p{q}_ms": 1e3 * statistics.median(p.ttft[q] for p in points) for q in PERCENTILES},
            **{f"itl_p{q}_ms": 1e3 * statistics.median(p.itl[q] for p in points) for q in PERCENTILES}}


def run(params, progress, cancel, lab) -> LabResult:
    sweep = [c for c in CONCURRENCY if c <= params["max_concurrency"]]
    repeats = params["repeats"]
    vocab_size = lab.config.vocab_size
    prompts = _prompts(vocab_size, max(sweep) * params["requests_per_stream"], params["prompt_tokens"], seed=0)
    flood_prompt = _prompts(vocab_size, 1, params["flood_prompt_tokens"], seed=1)[0]
    light_prompt = _prompts(vocab_size, 1, LIGHT_PROMPT_TOKENS, seed=2)[0]
    keys = {"A": f"lab-a-{secrets.token_hex(8)}", "B": f"lab-b-{secrets.token_hex(8)}"}
    model_args = ["--model", str(lab.model_dir)] if lab.model_arg is not None else []

    with tempfile.TemporaryDirectory(prefix="k3lab-serving-") as folder, contextlib.ExitStack() as stack:
        tenants = _tenants_file(Path(folder), keys)
        progress(0.01, "starting two servers (fcfs and fair scheduling) on free loopback ports")
        servers = {mode: ServerProcess([*model_args, "--served-model-name", SERVED_NAME, "--tenants",
                                        str(tenants), "--scheduling", mode], cancel=cancel) for mode in MODES}
        stack.callback(stop_all, list(servers.values()))  # registered before they start: stopped on every way out
        for server in servers.values():
            server.launch()
        import_client()  # while the servers start
        for server in servers.values():
            server.wait_ready()
        base = {mode: server.base_url for mode, server in servers.items()}
        cancel.check()

        def tenants_pass(mode: str, seconds: float):
            return tenants_run(base[mode], keys, SERVED_NAME, flood_prompt, light_prompt, params["flood_streams"],
                               params["flood_max_tokens"], LIGHT_MAX_TOKENS, params["light_interval_s"], seconds,
                               cancel)

        progress(0.1, WARM_UP_MESSAGE)
        concurrency_run(base["fair"], keys["A"], SERVED_NAME, prompts, max(sweep), 1, params["max_tokens"], cancel)
        for mode in MODES:
            tenants_pass(mode, 0.3)

        samples: dict[int, list] = {c: [] for c in sweep}
        tenant_runs: dict[str, list] = {mode: [] for mode in MODES}
        steps = repeats * (len(sweep) + len(MODES))
        done = 0
        for r in range(repeats):  # alternated: the whole sweep, then fcfs and fair, once per repeat
            for c in sweep:
                progress(0.15 + 0.83 * done / steps, f"repeat {r + 1}: {c} concurrent stream(s)")
                samples[c].append(concurrency_run(base["fair"], keys["A"], SERVED_NAME, prompts, c,
                                                  params["requests_per_stream"], params["max_tokens"], cancel))
                done += 1
            for mode in MODES:
                progress(0.15 + 0.83 * done / steps, f"repeat {r + 1}: tenant A floods, B sends light requests, "
                                                     f"{mode} scheduling")
                tenant_runs[mode].append(tenants_pass(mode, params["tenant_seconds"]))
                done += 1
        start_seconds = {mode: server.start_seconds for mode, server in servers.items()}
    # the servers are stopped here (ExitStack), also when a pass above raised or the run was cancelled

    rows = {c: _median_point(points) for c, points in samples.items()}
    tenants = {mode: {"b_ttft_p50_ms": 1e3 * statistics.median(t.b_ttft[50] for t in runs),
                      "b_ttft_p99_ms": 1e3 * statistics.median(t.b_ttft[99] for t in runs),
                      "total_tok_per_s": statistics.median(t.tokens / t.seconds for t in runs)}
               for mode, runs in tenant_runs.items()}
    top = sweep[-1]
    source = (f"`k3serve serve` ({lab.model_name}) on a loopback port, the openai client, {params['prompt_tokens']}-"
              f"token prompts, {params['max_tokens']} generated tokens, {params['requests_per_stream']} request(s) "
              f"per stream; medians of {repeats} alternated repeats on this machine")
    tenant_source = (f"two servers (fcfs, fair), tenant A keeps {params['flood_streams']} streams of "
                     f"{params['flood_prompt_tokens']}+{params['flood_max_tokens']} tokens busy, tenant B sends "
                     f"{LIGHT_PROMPT_TOKENS}+{LIGHT_MAX_TOKENS} tokens every {params['light_interval_s']:g} s, "
                     f"{params['tenant_seconds']:g} s per run; medians of {repeats} alternated repeats on this "
                     "machine")
    figures = [
        Figure("Throughput vs concurrent streams", "line", True, source,
               [{"name": "generated tokens", "x": sweep, "y": [rows[c]["tok_per_s"] for c in sweep]}],
               x_label="concurrent streams (requests)", y_label="generated tokens per second (tok/s)"),
        Figure("Time to first token vs concurrent streams", "line", True, source,
               [{"name": f"p{q}", "x": sweep, "y": [rows[c][f"ttft_p{q}_ms"] for c in sweep]} for q in PERCENTILES],
               x_label="concurrent streams (requests)", y_label="time to first token (ms)"),
        Figure("Inter-token latency vs concurrent streams", "line", True, source,
               [{"name": f"p{q}", "x": sweep, "y": [rows[c][f"itl_p{q}_ms"] for c in sweep]} for q in PERCENTILES],
               x_label="concurrent streams (requests)", y_label="gap between streamed tokens (ms)"),
        Figure("Tenant B's time to first token while A floods", "bar", True, tenant_source,
               [{"name": name, "x": list(MODES), "y": [tenants[m][key] for m in MODES]}
                for name, key in (("p50", "b_ttft_p50_ms"), ("p99", "b_ttft_p99_ms"))],
               y_label="time to first token (ms)", highlight="fair"),
        Figure("Generated tokens per second, both tenants", "bar", True, tenant_source,
               [{"name": "all tenants", "x": list(MODES), "y": [tenants[m]["total_tok_per_s"] for m in MODES]}],
               y_label="generated tokens per second (tok/s)", highlight="fair"),
    ]
    peak, one = rows[top], rows[1]
    metrics, baseline = dict(peak), dict(one)  # the same server at `top` concurrent streams against one stream
    labels = {"tok_per_s": "generated tok/s (all streams)",
              **{f"ttft_p{q}_ms": f"p{q} time to first token (ms)" for q in PERCENTILES},
              **{f"itl_p{q}_ms": f"p{q} inter-token latency (ms)" for q in PERCENTILES}}
    for mode in MODES:  # the two-tenant comparison: fair and fcfs side by side in the first column
        for key, label in (("b_ttft_p50_ms", "tenant B's median TTFT while A floods (ms)"),
                           ("b_ttft_p99_ms", "tenant B's p99 TTFT while A floods (ms)"),
                           ("total_tok_per_s", "both tenants' generated tok/s")):
            metrics[f"{mode}_{key}"] = tenants[mode][key]
            labels[f"{mode}_{key}"] = f"{mode}: {label}"
    verdict = _verdict(rows)
    notes = [verdict.sentence, _tenants_sentence(tenants),
             f"{top} concurrent streams: p50/p99 inter-token latency {peak['itl_p50_ms']:.1f}/{peak['itl_p99_ms']:.1f}"
             f" ms, p50/p99 TTFT {peak['ttft_p50_ms']:.0f}/{peak['ttft_p99_ms']:.0f} ms (client-side times, HTTP "
             "and SSE included)",
             "the concurrency sweep runs on the fair server with tenant A's key only: with one tenant, fair and fcfs "
             "admit in the same order",
             f"server start (spawn to a healthy /health): fcfs {start_seconds['fcfs']:.1f} s, fair "
             f"{start_seconds['fair']:.1f} s, both at once; not timed in any figure",
             "B requests without a first token when a run ends count with their wait so far (a lower bound)"]
    progress(1.0, "done")
    return LabResult(metrics, baseline, figures, labels, metrics_name=f"{top} concurrent streams",
                     baseline_name="one stream", notes=notes, verdict=verdict,
                     related_commands=[
                         f"k3serve serve --served-model-name {SERVED_NAME} --tenants tenants.toml --scheduling fair",
                         f"k3serve serve --served-model-name {SERVED_NAME} --tenants tenants.toml --scheduling fcfs",
                         "k3serve tenants hash-key KEY", "python benchmarks/bench_tenants.py"])


def _outcome(factor: float) -> str:
    return "even" if abs(factor - 1) <= EVEN_BAND else ("won" if factor > 1 else "lost")


def _verdict(rows: dict[int, dict[str, float]]) -> Verdict:
    """The server's throughput at the most streams against one stream; it flips where adding streams stops adding
    throughput (the first point of the sweep below its predecessor), or, if none did, it names the sweep's end.
    Worded as `verdict.judge` words the other modules' verdicts (the outcome, the factor, the flip condition)."""
    sweep = sorted(rows)
    top = sweep[-1]
    factor = rows[top]["tok_per_s"] / rows[1]["tok_per_s"]
    itl = rows[top]["itl_p99_ms"] / rows[1]["itl_p99_ms"]
    outcome = _outcome(factor)
    head = {"won": "won", "lost": "lost", "even": "was even"}[outcome]
    sentence = (f"Batching in k3serve serve {head}: it streamed {rows[top]['tok_per_s']:.0f} tok/s to {top} "
                f"concurrent openai clients here, {factor:.2f}x one client's {rows[1]['tok_per_s']:.0f} tok/s, at "
                f"{itl:.2f}x its p99 inter-token latency.")
    flat = next((c for prev, c in zip(sweep, sweep[1:]) if rows[c]["tok_per_s"] <= rows[prev]["tok_per_s"]), None)
    if flat is not None:
        prev = sweep[sweep.index(flat) - 1]
        flips = (f"more streams stopped paying at {flat}: {rows[flat]['tok_per_s']:.0f} tok/s against "
                 f"{rows[prev]['tok_per_s']:.0f} at {prev}")
    else:
        flips = (f"throughput still grew at every step up to {top} streams; it would flip where a step's cost grows "
                 f"as fast as its batch (p50 inter-token {rows[1]['itl_p50_ms']:.1f} ms at 1 stream, "
                 f"{rows[top]['itl_p50_ms']:.1f} ms at {top})")
    return Verdict(outcome, factor, "tok_per_s", f"{sentence} {sentence_case(flips)}.", flips)


def _tenants_sentence(tenants: dict[str, dict[str, float]]) -> str:
    """Fair against fcfs on tenant B's p99 TTFT (lower is better), with the throughput it cost."""
    fcfs, fair = tenants["fcfs"]["b_ttft_p99_ms"], tenants["fair"]["b_ttft_p99_ms"]
    factor = fcfs / fair if fair > 0 else float("inf")
    cost = tenants["fair"]["total_tok_per_s"] / tenants["fcfs"]["total_tok_per_s"]
    said = {"won": f"cut tenant B's p99 time to first token {factor:.2f}x", "lost":
            f"raised tenant B's p99 time to first token {1 / factor:.2f}x", "even": "left tenant B's p99 time to "
            f"first token even ({factor:.2f}x)"}[_outcome(factor)]
    return (f"Fair scheduling {said} against fcfs ({fair:.0f} vs {fcfs:.0f} ms) while tenant A flooded the "
            f"server, at {cost:.2f}x fcfs's total throughput.")


MODULE = LabModule(
    id="serving", number=19, title="End-to-end serving",
    summary="A real `k3serve serve` on a loopback port, driven by the official openai client: throughput, TTFT and "
            "inter-token latency percentiles at 1-32 streams, and fcfs vs fair between two tenants.",
    explanation=(
        "The other modules call the engine in-process. This one starts the server as its own process, exactly as "
        "`k3serve serve` runs, and measures what a client sees: HTTP, JSON, server-sent events, the server's "
        "event loop and the engine thread included. Concurrent streamed completions (openai's AsyncOpenAI) give "
        "throughput and TTFT/inter-token percentiles as concurrency grows: continuous batching shares each step's "
        "weight reads among the streams, so throughput rises while each stream's inter-token latency grows "
        "slowly. Then two tenants (a tenants file with one key each): A keeps many streams busy, B sends short "
        "requests; under fcfs B waits behind A's queue, under fair (a virtual token counter per tenant) B is "
        "served next. The servers are child processes in their own process group that die with the lab's "
        "worker (PR_SET_PDEATHSIG), so Cancel, an error or the time limit never leaves one behind."),
    params=(Param("max_concurrency", "int", 8, "largest number of concurrent streams (1, 2, 4, ... up to it)",
                  min=1, max=32),
            Param("prompt_tokens", "int", 16, "prompt per request", min=1, max=1024, unit="tokens"),
            Param("max_tokens", "int", 16, "generated per request", min=2, max=256, unit="tokens"),
            Param("requests_per_stream", "int", 1, "requests each stream sends back to back", min=1, max=16),
            Param("flood_streams", "int", 8, "tenant A's concurrent streams", min=1, max=32),
            Param("flood_prompt_tokens", "int", 128, "tenant A's prompt", min=1, max=1024, unit="tokens"),
            Param("flood_max_tokens", "int", 32, "tenant A's generated tokens per request", min=1, max=256,
                  unit="tokens"),
            Param("light_interval_s", "float", 0.1, "tenant B's arrival period", min=0.01, max=5.0, unit="s"),
            Param("tenant_seconds", "float", 0.8, "traffic per tenants run (fcfs and fair, each repeat)",
                  min=0.5, max=30.0, unit="s"),
            repeats_param()),
    kind="measured", run=run)
