"""6. Router-guided prefetch: guess the next layer's experts and read them into cold slots early."""

from __future__ import annotations

from k3serve.lab.registry import Figure, LabModule, LabResult, Param
from k3serve.lab.streaming import WIDENINGS, streamed_run, warm_up
from k3serve.lab.timing import WARM_UP_MESSAGE
from k3serve.lab.verdict import judge
from k3serve.stream.budget import minimum_budget_bytes
from k3serve.units import format_size
from k3serve.stream.options import StreamOptions
from k3serve.weights.store import PackedStore


def break_even_read_ms(on: dict[str, float], off: dict[str, float]) -> float | None:
    """The demand read latency (ms per read) at which prefetch and no prefetch take the same time per token, from
    this run: time(t) = rest + demand reads x t, with prefetched reads hidden behind compute. The demand reads per
    token are exact counts; `rest` is each run's time less its demand reads at this machine's latency t_here (the
    I/O wait per demand read without prefetch), so the model gives this run's times at t_here. Then
    t* = t_here + (ms_on - ms_off) / (reads_off - reads_on), at least 0 (0.0: prefetch wins at any latency);
    None when prefetch saves no demand reads."""
    saved_reads = off["demand_misses_per_token"] - on["demand_misses_per_token"]
    if saved_reads <= 0:
        return None
    return max(read_ms_here(off) + (on["ms_per_token"] - off["ms_per_token"]) / saved_reads, 0.0)


def read_ms_here(off: dict[str, float]) -> float:
    """The I/O wait per demand read without prefetch on this machine (ms)."""
    return off["io_wait_ms_per_token"] / max(off["demand_misses_per_token"], 1e-9)


def verdict(on: dict[str, float], off: dict[str, float]):
    flip = break_even_read_ms(on, off)
    now = read_ms_here(off)
    saved = off["demand_misses_per_token"] - on["demand_misses_per_token"]
    if flip is None:
        flips_when = "it saves no demand reads here, so no read latency would make it pay"
    elif flip == 0:
        flips_when = (f"it wins at any read latency: it saves {saved:.1f} demand reads per token and costs no time "
                      f"here (a demand read waits {now:.3f} ms now)")
    else:
        side = "win" if on["ms_per_token"] > off["ms_per_token"] else "lose"
        flips_when = (f"it would {side} when a demand read takes {'longer' if side == 'win' else 'less'} than "
                      f"{flip:.3f} ms (here {now:.3f} ms, from the page cache or this disk): it saves {saved:.1f} "
                      f"demand reads per token, each worth one read's latency once its own reads hide behind compute")
    return judge("Next-layer prefetch", "no prefetch", "ms_per_token", "time per token", on["ms_per_token"],
                 off["ms_per_token"], higher_is_better=False, flips_when=flips_when)


def run(params, progress, cancel, lab) -> LabResult:
    progress(0.02, "preparing the packed store (first use only)")
    path = lab.packed("natural", *WIDENINGS[params["experts"]])
    store = PackedStore(path)
    budget = minimum_budget_bytes(store) + int(params["expert_fraction"] * store.expert_store_bytes)
    prompts = lab.windows(params["prompts"], 24, skip=44)
    progress(0.05, WARM_UP_MESSAGE)
    warm_up(path, StreamOptions(ram_budget=budget, io=params["io"], cache=params["cache"], prefetch="next-layer"),
            prompts, cancel)
    runs = {}
    for i, mode in enumerate(("none", "next-layer")):
        progress(0.1 + 0.4 * i, f"prefetch {mode}")
        options = StreamOptions(ram_budget=budget, io=params["io"], cache=params["cache"], prefetch=mode,
                                prefetch_max=params["guesses"] or None)
        runs[mode] = streamed_run(path, options, prompts, params["tokens"], cancel)

    def summary(r) -> dict[str, float]:
        m, steps = r.measurement, max(r.measurement.decode_steps, 1)
        return {"ms_per_token": 1e3 * m.seconds_per_token, "prefetch_hit_pct": 100 * m.prefetch_hit_share,
                "retention_pct": 100 * m.decode.retention,
                "demand_misses_per_token": m.decode.expert_misses / steps,
                "expert_bytes_per_token": m.decode.expert_bytes_read / steps,
                "wasted_guesses_per_token": m.decode.prefetch_wasted / steps,
                "wasted_bytes_per_token": m.decode.prefetch_wasted * store.expert_blob_size / steps,
                "io_wait_ms_per_token": 1e3 * m.decode.io_wait_seconds / steps}

    on, off = summary(runs["next-layer"]), summary(runs["none"])
    issued = runs["next-layer"].measurement.decode.prefetch_issued
    wasted = runs["next-layer"].measurement.decode.prefetch_wasted
    source = (f"{lab.model_name} (experts widened {params['experts']}) streamed under {format_size(budget)}, "
              f"{params['io']} reads, decode of {len(prompts)} held-out prompts x {params['tokens']} tokens")
    figures = [
        Figure("Where expert requests were served", "bar", True, source,
               [{"name": name, "x": ["retained (resident before the step)", "prefetched this step", "demand read"],
                 "y": [s["retention_pct"], s["prefetch_hit_pct"], 100 - s["retention_pct"] - s["prefetch_hit_pct"]]}
                for name, s in (("prefetch off", off), ("next-layer prefetch", on))],
                y_label="share of expert requests (%)"),
        Figure("Time per decoded token", "bar", True, source,
               [{"name": name, "x": ["in all", "waiting for I/O"],
                 "y": [s["ms_per_token"], s["io_wait_ms_per_token"]]}
                for name, s in (("prefetch off", off), ("next-layer prefetch", on))],
               y_label="time per token (ms/token)"),
        Figure("Expert bytes read per decoded token (wasted guesses included)", "bar", True, source,
               [{"name": name, "x": ["expert bytes read"], "y": [s["expert_bytes_per_token"] / 1024]}
                for name, s in (("prefetch off", off), ("next-layer prefetch", on))],
               y_label="bytes read per token (KiB/token)"),
    ]
    labels = {"ms_per_token": "ms per decoded token", "prefetch_hit_pct": "requests served by a prefetch (%)",
              "retention_pct": "retained (%)", "demand_misses_per_token": "demand reads per token",
              "expert_bytes_per_token": "expert bytes read per token (guesses included)",
              "wasted_guesses_per_token": "wasted guesses per token",
              "wasted_bytes_per_token": "bytes of wasted guesses per token", "io_wait_ms_per_token": "I/O wait ms per token"}
    progress(1.0, "done")
    same = runs["none"].measurement.outputs == runs["next-layer"].measurement.outputs
    return LabResult(on, off, figures, labels, metrics_name="next-layer prefetch", baseline_name="prefetch off",
                     verdict=verdict(on, off),
                     notes=[f"{issued} guesses issued, {wasted} never used ({wasted / max(issued, 1):.0%} wasted)",
                            "prefetch only fills free or never-used slots: it never evicts a warm expert",
                            "generated tokens identical with and without prefetch" if same else
                            "WARNING: outputs differ"],
                     related_commands=[f"k3serve generate --prompt 'def f(x):' --ram-budget {budget} "
                                       f"--prefetch next-layer", "k3serve routing-stats"])


MODULE = LabModule(
    id="prefetch", number=6, title="Router-guided prefetch",
    summary="Run the next layer's router on this layer's hidden state and read the guessed experts early.",
    explanation=(
        "The residual stream changes little from one layer to the next, so layer l+1's router applied to layer l's "
        "hidden state h_l guesses most of its top-k: guess = topk(W_router(l+1) h_l). The guessed experts are read "
        "into cold slots (free, or holding an earlier guess that was never used) while layer l computes, so the "
        "read overlaps compute. Honest counting: a prefetched expert is a prefetch hit, never a retained one, and "
        "guesses that are never used are wasted bytes."),
    params=(Param("expert_fraction", "float", 0.15, "budget = minimum + this share of the expert store", min=0.0,
                  max=1.0),
            Param("guesses", "int", 0, "guesses per layer (0 = top-k)", min=0, max=64),
            Param("io", "choice", "pread", "how experts are read", choices=("pread", "direct", "mmap")),
            Param("cache", "choice", "lru", "expert cache policy", choices=("lru", "lfu", "s3fifo")),
            Param("experts", "choice", "4x", "experts widened (exactly)", choices=tuple(WIDENINGS)),
            Param("tokens", "int", 16, "generated per prompt", min=2, max=128, unit="tokens"),
            Param("prompts", "int", 2, "held-out prompts", min=1, max=8)),
    kind="measured", run=run)
