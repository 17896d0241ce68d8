"""The training-curve SVG is well-formed and draws one line per series at the logged values."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from k3serve.training.plot import curve_svg

LOG = {"unigram_baseline": {"code": 6.0, "prose": 6.1},
       "curve": [{"step": 0, "heldout_loss": {"code": 7.4, "prose": 7.5}},
                 {"step": 100, "train_loss": 4.0, "heldout_loss": {"code": 3.5, "prose": 4.2}},
                 {"step": 200, "train_loss": 3.0, "heldout_loss": {"code": 3.0, "prose": 3.9}}]}


def test_curve_svg():
    root = ET.fromstring(curve_svg(LOG))
    ns = "{http://www.w3.org/2000/svg}"
    paths = root.findall(f"{ns}path")
    assert len(paths) == 3
    # train has two points, the held-out series three; every series ends at the right edge
    counts = sorted(p.get("d").count("L") + 1 for p in paths)
    assert counts == [2, 3, 3]
    ends = {p.get("d").split("L")[-1].split(",")[0] for p in paths}
    assert len(ends) == 1
    # the y axis grows upward: a falling loss ends lower on the page (larger SVG y)
    code = next(p for p in paths if p.get("stroke") == "#1f77b4").get("d")
    first_y = float(code.split(",")[1].split("L")[0])
    last_y = float(code.split(",")[-1])
    assert last_y > first_y
    labels = [t.text for t in root.findall(f"{ns}text")]
    assert "unigram code" in labels and "held-out prose" in labels
