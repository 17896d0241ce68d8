"""The training curve as a self-contained SVG (no plotting library): loss per token against step.

    python -m k3serve.training.plot train_log.json curve.svg

Lines: training loss (mean over each eval interval), held-out code, held-out prose and, where the log has it,
held-out revision documents (copying); dashed: the unigram baselines of held-out code and prose.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

WIDTH, HEIGHT = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 60, 170, 20, 50
COLORS = {"train": "#555555", "code": "#1f77b4", "prose": "#d62728", "copy": "#2ca02c"}


def _nice_step(span: float, ticks: int) -> float:
    raw = span / ticks
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 2.5, 5, 10) if m * base >= raw)


def curve_svg(log: dict) -> str:
    curve = log["curve"]
    baselines = log["unigram_baseline"]
    series = {
        "train": [(p["step"], p["train_loss"]) for p in curve if "train_loss" in p],
        "code": [(p["step"], p["heldout_loss"]["code"]) for p in curve],
        "prose": [(p["step"], p["heldout_loss"]["prose"]) for p in curve],
        "copy": [(p["step"], p["heldout_loss"]["copy"]) for p in curve if "copy" in p["heldout_loss"]],
    }
    baselines = {k: v for k, v in baselines.items() if k in ("code", "prose")}
    max_step = max(p["step"] for p in curve) or 1
    values = [v for pts in series.values() for _, v in pts] + list(baselines.values())
    lo, hi = math.floor(min(values) * 2) / 2, math.ceil(max(values) * 2) / 2
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(step: float) -> float:
        return LEFT + plot_w * step / max_step

    def y(value: float) -> float:
        return TOP + plot_h * (hi - value) / (hi - lo)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>']
    tick = _nice_step(hi - lo, 6)
    v = math.ceil(lo / tick) * tick
    while v <= hi + 1e-9:
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
        v += tick
    tick = _nice_step(max_step, 6)
    s = 0.0
    while s <= max_step + 1e-9:
        out.append(f'<text x="{x(s):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{s:g}</text>')
        s += tick
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#888"/>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">optimizer step</text>')
    out.append(f'<text x="14" y="{TOP + plot_h / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {TOP + plot_h / 2})">loss (nats / token)</text>')
    legend_y = TOP + 10
    for name, label in (("train", "train"), ("code", "held-out code"), ("prose", "held-out prose"),
                        ("copy", "held-out revisions")):
        pts = series[name]
        if name == "copy" and not pts:
            continue
        if pts:
            path = " ".join(f"{'M' if i == 0 else 'L'}{x(a):.1f},{y(b):.1f}" for i, (a, b) in enumerate(pts))
            out.append(f'<path d="{path}" fill="none" stroke="{COLORS[name]}" stroke-width="2"/>')
        out.append(f'<line x1="{LEFT + plot_w + 12}" x2="{LEFT + plot_w + 36}" y1="{legend_y}" y2="{legend_y}" '
                   f'stroke="{COLORS[name]}" stroke-width="2"/>')
        out.append(f'<text x="{LEFT + plot_w + 42}" y="{legend_y + 4}">{label}</text>')
        legend_y += 20
    for name in ("code", "prose"):
        base = baselines[name]
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(base):.1f}" y2="{y(base):.1f}" '
                   f'stroke="{COLORS[name]}" stroke-dasharray="6 4"/>')
        out.append(f'<line x1="{LEFT + plot_w + 12}" x2="{LEFT + plot_w + 36}" y1="{legend_y}" y2="{legend_y}" '
                   f'stroke="{COLORS[name]}" stroke-dasharray="6 4"/>')
        out.append(f'<text x="{LEFT + plot_w + 42}" y="{legend_y + 4}">unigram {name}</text>')
        legend_y += 20
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3serve.training.plot", description=__doc__.split("\n")[0])
    parser.add_argument("log", type=Path, help="train_log.json written by k3serve.training.train")
    parser.add_argument("out", type=Path, help="SVG file to write")
    args = parser.parse_args(argv)
    args.out.write_text(curve_svg(json.loads(args.log.read_text())))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
