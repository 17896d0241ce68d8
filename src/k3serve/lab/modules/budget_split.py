"""4. RAM budget split: trunk layers pinned first vs the whole budget to expert slots."""

from __future__ import annotations

from k3serve.lab.registry import Figure, LabModule, LabResult, Param
from k3serve.lab.streaming import WIDENINGS, streamed_run, warm_up
from k3serve.lab.timing import WARM_UP_MESSAGE
from k3serve.lab.verdict import crossing, judge
from k3serve.stream.budget import minimum_budget_bytes
from k3serve.units import format_size
from k3serve.stream.options import StreamOptions
from k3serve.weights.store import PackedStore

FRACTIONS = (0.05, 0.3, 1.0)


def run(params, progress, cancel, lab) -> LabResult:
    progress(0.02, "preparing the packed store (first use only)")
    path = lab.packed("natural", *WIDENINGS[params["experts"]])
    store = PackedStore(path)
    minimum = minimum_budget_bytes(store)
    prompts = lab.windows(params["prompts"], 24, skip=40)
    fractions = sorted(set(FRACTIONS) | {params["expert_fraction"]})
    progress(0.03, WARM_UP_MESSAGE)
    warm_up(path, StreamOptions(ram_budget=minimum, cache=params["cache"]), prompts, cancel)
    rows: dict[tuple[str, float], object] = {}
    total = 2 * len(fractions)
    for i, fraction in enumerate(fractions):
        budget = minimum + int(fraction * store.expert_store_bytes)
        for j, (name, pin) in enumerate((("trunk first", None), ("experts only", 0))):
            progress(0.05 + 0.9 * (2 * i + j) / total, f"{name} at {format_size(budget)}")
            options = StreamOptions(ram_budget=budget, cache=params["cache"], pin_trunk_bytes=pin)
            rows[(name, fraction)] = streamed_run(path, options, prompts, params["tokens"], cancel)
    chosen = params["expert_fraction"]
    a, b = rows[("trunk first", chosen)], rows[("experts only", chosen)]
    source = (f"{lab.model_name} (experts widened {params['experts']}), packed store, decode of {len(prompts)} "
              f"held-out prompts x {params['tokens']} tokens, page cache warm: bytes are what a cold disk would "
              f"deliver, time is this machine's")
    budgets = [(minimum + int(f * store.expert_store_bytes)) / 2**20 for f in fractions]
    figures = [
        Figure("Bytes read per decoded token vs budget", "line", True, source,
               [{"name": name, "x": budgets, "y": [rows[(name, f)].measurement.bytes_per_token / 2**20
                                                 for f in fractions]} for name in ("trunk first", "experts only")],
               x_label="RAM budget (MiB)", y_label="bytes read per token (MiB/token)"),
        Figure("Seconds per decoded token vs budget", "line", True, source,
               [{"name": name, "x": budgets, "y": [1e3 * rows[(name, f)].measurement.seconds_per_token
                                                 for f in fractions]} for name in ("trunk first", "experts only")],
               x_label="RAM budget (MiB)", y_label="time per token (ms/token)"),
    ]

    def summary(r) -> dict[str, float]:
        m = r.measurement
        return {"ms_per_token": 1e3 * m.seconds_per_token, "bytes_per_token": m.bytes_per_token,
                "trunk_bytes_per_token": m.decode.trunk_bytes_read / max(m.decode_steps, 1),
                "expert_bytes_per_token": m.decode.expert_bytes_read / max(m.decode_steps, 1),
                "retention_pct": 100 * m.decode.retention, "expert_slots": float(r.expert_slots),
                "pinned_layers": float(r.pinned_layers)}

    labels = {"ms_per_token": "ms per decoded token", "bytes_per_token": "bytes read per token",
              "trunk_bytes_per_token": "trunk bytes per token", "expert_bytes_per_token": "expert bytes per token",
              "retention_pct": "expert retention %", "expert_slots": "expert slots", "pinned_layers":
              "trunk layers pinned"}
    same = all(rows[("trunk first", f)].measurement.outputs == rows[("experts only", f)].measurement.outputs
               for f in fractions)
    budget = minimum + int(chosen * store.expert_store_bytes)
    on, off = summary(a), summary(b)
    pinned = [rows[("trunk first", f)].measurement.bytes_per_token for f in fractions]
    unpinned = [rows[("experts only", f)].measurement.bytes_per_token for f in fractions]
    flip = crossing(budgets, pinned, unpinned, higher_is_better=False)
    saved = off["trunk_bytes_per_token"] - on["trunk_bytes_per_token"]
    cost = on["expert_bytes_per_token"] - off["expert_bytes_per_token"]
    if flip is not None:
        flips_when = (f"the two read the same bytes at about {flip:.1f} MiB (the budget sweep); past it the outcome "
                      "reverses")
    else:
        flips_when = (f"experts-only read fewer bytes at no budget swept ({budgets[0]:.1f} to {budgets[-1]:.1f} MiB); "
                      f"pinning would lose only where the expert re-reads it causes ({cost / 1e6:+.2f} MB per token "
                      f"here) outgrow the trunk re-reads it saves ({saved / 1e6:.2f} MB per token here)")
    verdict = judge("Pinning the trunk first", "giving the whole budget to expert slots", "bytes_per_token",
                    "bytes read per token", on["bytes_per_token"], off["bytes_per_token"], higher_is_better=False,
                    words=("fewer", "more"), flips_when=flips_when)
    progress(1.0, "done")
    return LabResult(on, off, figures, labels, metrics_name="trunk pinned first", verdict=verdict,
                     baseline_name="all to expert slots",
                     notes=[f"budget {format_size(budget)} = minimum {format_size(minimum)} + {chosen:.0%} of the "
                            f"{format_size(store.expert_store_bytes)} expert store",
                            "generated tokens identical in every configuration" if same else
                            "WARNING: outputs differ between configurations"],
                     related_commands=[f"k3serve generate --prompt 'def f(x):' --ram-budget {budget} --pin-trunk 0",
                                       f"k3serve generate --prompt 'def f(x):' --ram-budget {budget}"])


MODULE = LabModule(
    id="budget_split", number=4, title="RAM budget split: trunk first vs expert slots",
    summary="Under one RAM budget, pin trunk layers first or give everything to expert slots; bytes and time per token.",
    explanation=(
        "Every token needs every trunk layer (attention, norms, router, shared experts) but only top-k experts per "
        "layer. A streamed trunk layer is read again for every step, so pinning it saves its bytes on every token; "
        "an expert slot only saves a read when that expert comes back. With budget B: pinned trunk T_p and expert "
        "slots S = (B - globals - T_p - stream buffers) / expert_stride; bytes/token = streamed trunk + expert misses "
        "x expert_bytes. Pinning the trunk first wins unless the trunk is huge relative to B."),
    params=(Param("expert_fraction", "float", 0.3, "budget = minimum + this share of the expert store", min=0.0,
                  max=1.0),
            Param("experts", "choice", "4x", "experts widened (exactly) to make them weigh more", choices=tuple(WIDENINGS)),
            Param("cache", "choice", "lfu", "expert cache policy", choices=("lru", "lfu", "s3fifo")),
            Param("tokens", "int", 12, "generated per prompt", min=2, max=128, unit="tokens"),
            Param("prompts", "int", 2, "held-out prompts", min=1, max=8)),
    kind="measured", run=run)
