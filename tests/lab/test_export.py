"""The CSV export of a run record: one row per metric and per plotted point, heatmaps cell by cell."""

from __future__ import annotations

import csv
import io

from k3serve.lab.export import CSV_COLUMNS, result_csv


def test_metrics_and_points_become_rows():
    record = {"metrics": {"tok_per_s": 12.5, "missing": None}, "baseline": {"tok_per_s": 5.0},
              "labels": {"tok_per_s": "decode tokens per second"},
              "series": [{"title": "Speed, a, b", "kind": "line", "y_label": "speed (tok/s)", "y_unit": "tok/s",
                          "traces": [{"name": "on", "x": [1, 2], "y": [3.0, 4.25]}]},
                         {"title": "heat", "kind": "heatmap", "y_label": "expert (expert id)", "y_unit": "expert id",
                          "traces": [{"name": "both", "x": ["0", "1"], "y": ["0", "1"], "z": [[1, 2], [3, 4]]}]}]}
    rows = list(csv.reader(io.StringIO(result_csv(record))))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert rows[1] == ["metric", "tok_per_s", "decode tokens per second", "", "", "", "12.5", "5.0", ""]
    assert rows[2] == ["metric", "missing", "missing", "", "", "", "", "", ""]
    assert rows[3] == ["figure", "Speed, a, b", "speed (tok/s)", "on", "1", "", "3.0", "", "tok/s"]
    assert rows[4][6] == "4.25"
    heat = rows[5:]
    assert [(r[4], r[5], r[6]) for r in heat] == [("0", "0", "1"), ("1", "0", "2"), ("0", "1", "3"), ("1", "1", "4")]


def test_the_verdict_is_the_last_row():
    record = {"metrics": {"tok_per_s": 12.5}, "baseline": {"tok_per_s": 5.0}, "labels": {}, "series": [],
              "verdict": {"outcome": "won", "factor": 2.5, "metric": "tok_per_s", "flips_when": "it would lose at 1",
                          "sentence": "Speculation won here: 2.50x faster decoding. It would lose at 1."}}
    rows = list(csv.reader(io.StringIO(result_csv(record))))
    assert rows[-1] == ["verdict", "tok_per_s", record["verdict"]["sentence"], "won", "", "", "2.5", "", ""]
