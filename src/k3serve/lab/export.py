"""A finished run's record as CSV, for a spreadsheet: one row per metric and one per plotted point.

Columns: part (`metric` or `figure`), name (the metric key or the figure title), label (what the metric is, or the
figure's y axis title), series (the trace), x, y (a heatmap's row; empty otherwise), value, baseline (a metric's
baseline), unit (the figure's y unit). A last row `verdict` holds the verdict: name = the metric it compares,
label = its sentence, series = its outcome (won, lost, even), value = its factor (the mechanism's gain, > 1
better). The JSON export is the record itself
(docs/LAB.md).
"""

from __future__ import annotations

import csv
import io

CSV_COLUMNS = ("part", "name", "label", "series", "x", "y", "value", "baseline", "unit")


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)  # full precision: the CSV is data, the page is for reading
    return str(value)


def result_csv(record: dict) -> str:
    """The run record (`registry.result_json`) as CSV text with the header `CSV_COLUMNS`."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    labels = record.get("labels", {})
    for key, value in record["metrics"].items():
        writer.writerow(["metric", key, labels.get(key, key), "", "", "", _cell(value),
                         _cell(record["baseline"].get(key)), ""])
    for figure in record["series"]:
        head = ["figure", figure["title"], figure["y_label"]]
        unit = figure.get("y_unit") or ""
        for trace in figure["traces"]:
            if figure["kind"] == "heatmap":
                for row, y in enumerate(trace["y"]):
                    for column, x in enumerate(trace["x"]):
                        writer.writerow(head + [trace["name"], _cell(x), _cell(y), _cell(trace["z"][row][column]),
                                                "", unit])
            else:
                for x, y in zip(trace["x"], trace["y"]):
                    writer.writerow(head + [trace["name"], _cell(x), "", _cell(y), "", unit])
    verdict = record.get("verdict")
    if verdict:
        writer.writerow(["verdict", verdict["metric"], verdict["sentence"], verdict["outcome"], "", "",
                         _cell(verdict["factor"]), "", ""])
    return out.getvalue()
