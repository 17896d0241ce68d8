"""Line charts as self-contained SVG (no plotting library): the memory ladder and the projections."""

from __future__ import annotations

import math
from typing import Sequence

WIDTH, HEIGHT = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 70, 190, 30, 50
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#555555")


def _nice_step(span: float, ticks: int) -> float:
    raw = max(span, 1e-12) / ticks
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 2.5, 5, 10) if m * base >= raw)


def line_chart(title: str, x_label: str, y_label: str, series: dict[str, Sequence[tuple[float, float]]],
               log_x: bool = True, dashed: Sequence[str] = ()) -> str:
    """series: name -> [(x, y)]. x on a log2 axis when `log_x` (RAM sizes)."""
    points = [p for s in series.values() for p in s if math.isfinite(p[1])]
    if not points:
        raise ValueError("nothing to plot")
    fx = (lambda v: math.log2(v)) if log_x else (lambda v: v)
    xs = [fx(p[0]) for p in points]
    x0, x1 = min(xs), max(xs)
    x1 = x1 if x1 > x0 else x0 + 1
    y1 = max(p[1] for p in points) * 1.08
    step = _nice_step(y1, 6)
    y1 = math.ceil(y1 / step) * step
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(v: float) -> float:
        return LEFT + (fx(v) - x0) / (x1 - x0) * pw

    def py(v: float) -> float:
        return TOP + ph - v / y1 * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{LEFT}" y="18" font-size="14">{title}</text>']
    t = 0.0
    while t <= y1 + 1e-9:
        y = py(t)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + pw}" y2="{y:.1f}" stroke="#e0e0e0"/>'
                   f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{t:g}</text>')
        t += step
    ticks = sorted({p[0] for s in series.values() for p in s})
    for v in ticks:
        x = px(v)
        label = f"{v:g}"
        out.append(f'<line x1="{x:.1f}" y1="{TOP + ph}" x2="{x:.1f}" y2="{TOP + ph + 4}" stroke="black"/>'
                   f'<text x="{x:.1f}" y="{TOP + ph + 18}" text-anchor="middle">{label}</text>')
    out.append(f'<line x1="{LEFT}" y1="{TOP + ph}" x2="{LEFT + pw}" y2="{TOP + ph}" stroke="black"/>'
               f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + ph}" stroke="black"/>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{HEIGHT - 10}" text-anchor="middle">{x_label}</text>')
    out.append(f'<text x="16" y="{TOP + ph / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {TOP + ph / 2})">{y_label}</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        pts = [p for p in pts if math.isfinite(p[1])]
        if not pts:
            continue
        dash = ' stroke-dasharray="6 4"' if name in dashed else ""
        path = " ".join(f"{'M' if j == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for j, (x, y) in enumerate(pts))
        out.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>')
        ly = TOP + 14 + 18 * i
        out.append(f'<line x1="{LEFT + pw + 12}" y1="{ly - 4}" x2="{LEFT + pw + 32}" y2="{ly - 4}" '
                   f'stroke="{color}" stroke-width="2"{dash}/><text x="{LEFT + pw + 36}" y="{ly}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
