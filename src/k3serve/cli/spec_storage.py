"""`k3serve spec-storage`: rollback bytes per sequence for the two rollback methods (model/rollback.py), for the
full K3, Kimi Linear and the embedded model."""

from __future__ import annotations

PRECISIONS = {"fp32": 4, "bf16": 2}


def storage_report(max_window: int = 8) -> tuple[list[str], dict]:
    """Rollback bytes per sequence for the full K3, Kimi Linear and the embedded model, windows 1..max_window."""
    from k3serve.config import full_k3_config, load_config
    from k3serve.loading import default_model_dir
    from k3serve.model.rollback import KIMI_LINEAR_SHAPES, RecurrentShapes, rollback_storage

    models = [RecurrentShapes.of("Kimi K3 (full)", full_k3_config()), KIMI_LINEAR_SHAPES]
    try:
        models.append(RecurrentShapes.of("embedded default", load_config(default_model_dir())))
    except Exception as exc:  # noqa: BLE001 - the table is still useful without it
        models.append(RecurrentShapes("embedded default (unavailable: " + str(exc)[:40] + ")", 0, 1, 1, 0))
    lines: list[str] = []
    record: dict = {"models": []}
    for shapes in models:
        lines.append(f"== {shapes.name}: {shapes.num_kda_layers} KDA layers, {shapes.num_heads} heads x "
                     f"{shapes.head_dim}, conv {shapes.conv_kernel}")
        entry: dict = {"name": shapes.name, "num_kda_layers": shapes.num_kda_layers, "heads": shapes.num_heads,
                       "head_dim": shapes.head_dim, "rows": []}
        if shapes.num_kda_layers == 0:
            record["models"].append(entry)
            continue
        lines.append(f"{'T':>2} {'accounting':>10} {'prec':>4} {'snapshot MiB':>13} {'projection MiB':>15} "
                     f"{'ratio':>6} {'proj/snap':>9}")
        first_four: dict[str, int | None] = {}
        for accounting in ("anchor", "k3serve"):
            for precision, width in PRECISIONS.items():
                first_four[f"{accounting}/{precision}"] = None
                for window in range(1, max_window + 1):
                    s = rollback_storage(shapes, window, width, accounting)
                    lines.append(f"{window:>2} {accounting:>10} {precision:>4} {s.snapshot_bytes / 2**20:>13.3f} "
                                 f"{s.projection_bytes / 2**20:>15.3f} {s.ratio:>6.2f} "
                                 f"{s.projection_bytes / s.snapshot_bytes:>9.1%}")
                    entry["rows"].append({"window": window, "accounting": accounting, "precision": precision,
                                          "snapshot_bytes": s.snapshot_bytes, "projection_bytes": s.projection_bytes,
                                          "ratio": s.ratio})
                    if s.ratio >= 4 and first_four[f"{accounting}/{precision}"] is None:
                        first_four[f"{accounting}/{precision}"] = window
        entry["first_window_at_4_to_1"] = first_four
        for key, window in first_four.items():
            lines.append(f"   ratio >= 4:1 first at T = {window} ({key})" if window is not None
                         else f"   ratio never reaches 4:1 for T <= {max_window} ({key})")
        record["models"].append(entry)
    lines.append("anchor = S per snapshot vs checkpoint + T x (k, u, g) [the public estimate]; k3serve = what "
                 "RollbackCache keeps (conv tails, beta and the 3P pre-conv inputs too). The ratio does not depend "
                 "on the precision when state and vectors share one; it tends to T as D grows.")
    return lines, record
