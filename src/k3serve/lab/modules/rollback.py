"""13. Rollback after rejected drafts: snapshots vs the projection cache; where "about 1/4" holds."""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from k3serve.config import full_k3_config
from k3serve.lab.registry import Figure, LabModule, LabParamError, LabResult, Param
from k3serve.lab.timing import MIN_REPEATS, WARM_UP_MESSAGE
from k3serve.lab.verdict import judge
from k3serve.model.rollback import KIMI_LINEAR_SHAPES, RecurrentShapes, RollbackCache, rollback_storage

PRECISION_BYTES = {"bf16": 2, "fp32": 4}
HEAD_DIMS = (16, 32, 64, 128, 256, 512)


def shapes_for(name: str, lab) -> RecurrentShapes:
    if name == "full_k3":
        return RecurrentShapes.of("Kimi K3 (full)", full_k3_config())
    if name == "kimi_linear":
        return KIMI_LINEAR_SHAPES
    return RecurrentShapes.of(lab.model_name, lab.config)


def measure(lab, window: int, kept: int, repeats: int, progress, cancel) -> dict[str, dict[str, float]]:
    """On the model: prefill a held-out prompt, run one verify window of `window` positions through a RollbackCache,
    keep `kept`; the bytes it recorded, the verify forward's time and the rollback's, medians over `repeats`."""
    from k3serve.model.interface import ForwardItem

    model = lab.loaded().model
    prompt = np.asarray(lab.windows(1, 64)[0], np.int64)
    drafts = np.asarray(lab.windows(1, window, skip=3)[0][:window], np.int64)
    out: dict[str, dict[str, float]] = {}
    progress(0.38, WARM_UP_MESSAGE)
    for method in ("snapshot", "projection"):  # each records (and restores) through its own kernels
        cache = RollbackCache(model.new_cache(), method)
        model.forward([ForwardItem(prompt, cache)])
        cache.begin_window()
        model.forward([ForwardItem(drafts, cache, all_logits=True)])
        cache.commit(kept)
    for m, method in enumerate(("snapshot", "projection")):
        verify, restore, stored = [], [], 0
        for i in range(repeats):
            cancel.check()
            progress(0.4 + 0.55 * (m * repeats + i) / (2 * repeats), f"{method}: repeat {i + 1} of {repeats}")
            cache = RollbackCache(model.new_cache(), method)
            model.forward([ForwardItem(prompt, cache)])
            cache.begin_window()
            started = time.perf_counter()
            model.forward([ForwardItem(drafts, cache, all_logits=True)])
            verify.append(time.perf_counter() - started)
            stored = cache.recorded_bytes
            started = time.perf_counter()
            cache.commit(kept)
            restore.append(time.perf_counter() - started)
        out[method] = {"recorded_bytes": float(stored), "verify_ms": 1e3 * statistics.median(verify),
                       "rollback_ms": 1e3 * statistics.median(restore)}
    return out


def run(params, progress, cancel, lab) -> LabResult:
    shapes = shapes_for(params["model"], lab)
    width = PRECISION_BYTES[params["precision"]]
    accounting = params["accounting"]
    windows = list(range(1, params["max_window"] + 1))
    progress(0.1, "computing storage per window")
    rows = [rollback_storage(shapes, t, width, accounting) for t in windows]
    first_quarter = next((r.window for r in rows if r.projection_bytes <= r.snapshot_bytes / 4), None)
    t = params["window"]
    by_dim = [rollback_storage(dataclasses.replace(shapes, head_dim=d), t, width, accounting) for d in HEAD_DIMS]
    figures = [
        Figure(f"Rollback storage per sequence, {shapes.name} ({accounting}, {params['precision']})", "line", False,
               f"computed from {shapes.name} shapes: {shapes.num_kda_layers} KDA layers, {shapes.num_heads} heads x "
               f"{shapes.head_dim}", [{"name": "snapshots (T states)", "x": windows,
                                       "y": [r.snapshot_bytes / 2**20 for r in rows]},
                                      {"name": "projection cache (1 state + T vectors)", "x": windows,
                                       "y": [r.projection_bytes / 2**20 for r in rows]}],
               x_label="window T, positions per verify (positions)", y_label="storage per sequence (MiB)"),
        Figure(f"projection / snapshot at T = {t} as the head dim changes", "line", False,
               f"computed: {shapes.name} with its head dim replaced",
               [{"name": "projection / snapshot", "x": list(HEAD_DIMS),
                 "y": [r.projection_bytes / r.snapshot_bytes for r in by_dim]},
                {"name": "1/4", "x": list(HEAD_DIMS), "y": [0.25] * len(HEAD_DIMS)}],
               x_label="KDA head dim D (dimensions)", y_label="projection / snapshot bytes (ratio)"),
    ]
    at = rollback_storage(shapes, t, width, accounting)
    metrics = {"projection_bytes": float(at.projection_bytes), "projection_over_snapshot": 1 / at.ratio}
    baseline = {"projection_bytes": float(at.snapshot_bytes), "projection_over_snapshot": 1.0}
    labels = {"projection_bytes": f"rollback bytes per sequence at T = {t} (computed)",
              "projection_over_snapshot": "projection / snapshot bytes",
              "recorded_bytes": f"bytes recorded on {lab.model_name} (measured)",
              "rollback_ms": "rollback time (ms, measured)", "verify_ms": "verify forward incl. recording (ms)"}
    notes = [f"{shapes.name}: projection takes <= 1/4 of snapshots from T = {first_quarter} on" if first_quarter
             else f"{shapes.name}: projection never reaches 1/4 of snapshots for T <= {windows[-1]}"]
    small_d = rollback_storage(dataclasses.replace(shapes, head_dim=16), t, width, accounting)
    notes.append(f"at T = {t} the ratio is {1 / at.ratio:.2f} with D = {shapes.head_dim}, {1 / small_d.ratio:.2f} with "
                 f"D = 16: it tends to 1/T only when D^2 dwarfs the per-position vectors (6P + NH per position).")
    if params["repeats"] > 0:
        progress(0.4, "measuring on the model")
        kept = params["kept"]  # <= t (`check`)
        measured = measure(lab, t, kept, params["repeats"], progress, cancel)
        for key in ("recorded_bytes", "rollback_ms", "verify_ms"):
            metrics[key] = measured["projection"][key]
            baseline[key] = measured["snapshot"][key]
        source = f"RollbackCache on {lab.model_name}, medians of {params['repeats']} on this machine"
        figures.append(Figure(f"Bytes recorded on {lab.model_name}: T = {t}, keep {kept}", "bar", True, source,
                              [{"name": "recorded", "x": ["snapshot", "projection"],
                                "y": [measured[m]["recorded_bytes"] / 1024 for m in ("snapshot", "projection")]}],
                              y_label="recorded per sequence (KiB)"))
        figures.append(Figure(f"Rollback time on {lab.model_name}: T = {t}, keep {kept}", "bar", True, source,
                              [{"name": "rollback", "x": ["snapshot", "projection"],
                                "y": [measured[m]["rollback_ms"] for m in ("snapshot", "projection")]}],
                              y_label="rollback time (ms)"))
    # the shortest window from which the projection cache holds fewer bytes (it stores one state either way, then
    # vectors per position against a whole state per position)
    smallest = next((w for w in range(1, 257) if (r := rollback_storage(shapes, w, width, accounting))
                     .projection_bytes < r.snapshot_bytes), None)
    flips_when = (f"for {shapes.name} it holds fewer bytes from a window of {smallest} positions on and more below"
                  if smallest is not None else f"for {shapes.name} it never holds fewer bytes up to 256 positions")
    if smallest == 1:
        flips_when = f"for {shapes.name} it holds fewer bytes at every window, from 1 position on"
    verdict = judge(f"The projection cache (T = {t})", "snapshots", "projection_bytes", "bytes per sequence",
                    at.projection_bytes, at.snapshot_bytes, higher_is_better=False, words=("fewer", "more"),
                    flips_when=flips_when)
    progress(1.0, "done")
    return LabResult(metrics, baseline, figures, labels, metrics_name="projection cache", verdict=verdict,
                     baseline_name="snapshots", notes=notes,
                     related_commands=[f"k3serve spec-storage --max-window {params['max_window']}"])


def check(params) -> None:
    if 0 < params["repeats"] < MIN_REPEATS:
        raise LabParamError("repeats", f"must be 0 (computed only) or >= {MIN_REPEATS} (medians), got "
                                       f"{params['repeats']}")
    if params["kept"] > params["window"]:
        raise LabParamError("kept", f"must be <= window ({params['window']}), got {params['kept']}")


MODULE = LabModule(
    id="rollback", number=13, title="Rollback: snapshots vs the projection cache",
    summary="Storage and replay cost of undoing rejected drafts in KDA layers; where 'about 1/4' holds.",
    explanation=(
        "After a speculative verify window of T positions keeps only n, KDA layers must go back to the state after "
        "n positions. Snapshots keep T states (T x NH D^2 per layer). The projection cache keeps one state S_0 plus, "
        "per position, the vectors the delta rule consumed (k, v, g, beta and the conv inputs) and replays n steps: "
        "S <- diag(exp(g_t)) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T. Its storage is NH D^2 + T (6P + NH), so "
        "projection/snapshot -> 1/T as D grows: about 1/4 at T = 4 for large heads, much worse for small ones."),
    params=(Param("model", "choice", "full_k3", "whose KDA shapes", choices=("full_k3", "kimi_linear", "embedded")),
            Param("max_window", "int", 8, "windows 1..N on the chart", min=1, max=32),
            Param("window", "int", 4, "T for the head-dim chart and the measurement", min=1, max=16),
            Param("precision", "choice", "bf16", "bytes per stored value", choices=tuple(PRECISION_BYTES)),
            Param("accounting", "choice", "k3serve", "k3serve: what RollbackCache stores; anchor: the public "
                  "estimate (state only; k, u, g per position)", choices=("k3serve", "anchor")),
            Param("kept", "int", 2, "positions kept after the measured window (at most the window)", min=1,
                  max=16),
            Param("repeats", "int", 5, f"measured repeats on the model (medians; 0 = computed only, else at least "
                  f"{MIN_REPEATS})", min=0, max=50)),
    kind="both", run=run, check=check)
