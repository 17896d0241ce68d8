"""Verdicts: one generated sentence per result, saying whether the mechanism won or lost on this machine, by how
much, and the condition under which it would flip.

    factor = value / baseline            when a higher value is better (tok/s, hit rate)
    factor = baseline / value            when a lower value is better (ms, bytes, misses)
    outcome = won if factor > 1 + band, lost if factor < 1 / (1 + band), even otherwise

The flip condition is the module's to compute, from its own model (a break-even solved from what it measured) or
from a sweep it ran (`crossing`, where two curves meet); `judge` only words it. A module with no such model passes
"" and the sentence says nothing about flipping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from k3serve.lab.registry import Verdict

EVEN_BAND = 0.05  # within 5% of the baseline either way is "even"


def gain(value: float, baseline: float, higher_is_better: bool) -> float:
    """The mechanism's gain as a ratio, > 1 better whatever the metric's direction; nan when it cannot be formed."""
    value, baseline = float(value), float(baseline)
    if not (math.isfinite(value) and math.isfinite(baseline)):
        return math.nan
    top, bottom = (value, baseline) if higher_is_better else (baseline, value)
    if bottom == 0:
        return math.inf if top > 0 else (1.0 if top == 0 else math.nan)
    if top < 0 or bottom < 0:
        return math.nan
    return top / bottom


def outcome_of(factor: float, band: float = EVEN_BAND) -> str:
    if not math.isfinite(factor):
        return "won" if factor == math.inf else "even"
    if factor > 1 + band:
        return "won"
    if factor < 1 / (1 + band):
        return "lost"
    return "even"


def times(factor: float) -> str:
    """A factor as a person says it: '2.31x', '14.6x', '1,200x'."""
    if factor == math.inf:
        return "infinitely"
    if factor >= 100:
        return f"{factor:,.0f}x"
    return f"{factor:.1f}x" if factor >= 10 else f"{factor:.2f}x"


def sentence_case(clause: str) -> str:
    """The clause as a sentence's start: its first letter upper case, except a name spelt in lower case (k3serve)."""
    if not clause or clause.startswith("k3serve"):
        return clause
    return clause[0].upper() + clause[1:]


def judge(mechanism: str, baseline_name: str, metric: str, what: str, value: float, baseline: float,
          higher_is_better: bool, flips_when: str = "", band: float = EVEN_BAND,
          words: tuple[str, str] | None = None) -> Verdict:
    """The verdict on `metric` (`what` says it in words, e.g. "bytes read per token"): `mechanism` against
    `baseline_name`. `flips_when` is a clause the caller computed ("it would win when a read takes longer than
    0.4 ms"); `words` are (better, worse) for `what`, by default more/less or less/more by the metric's direction."""
    factor = gain(value, baseline, higher_is_better)
    outcome = outcome_of(factor, band)
    better, worse = words or (("more", "less") if higher_is_better else ("less", "more"))
    if outcome == "won":
        head = f"{mechanism} won here: {times(factor)} {better} {what} than {baseline_name}."
    elif outcome == "lost":
        inverse = 1 / factor if factor > 0 else math.inf
        head = f"{mechanism} lost here: {times(inverse)} {worse} {what} than {baseline_name}."
    elif math.isfinite(factor):
        head = f"{mechanism} was even with {baseline_name} here on {what} ({factor:.2f}x)."
    else:
        head = f"{mechanism} and {baseline_name} cannot be compared on {what} here (a figure is missing)."
    sentence = head + (f" {sentence_case(flips_when)}" if flips_when else "")
    if sentence and not sentence.endswith("."):
        sentence += "."
    return Verdict(outcome=outcome, factor=float(factor) if math.isfinite(factor) else float("nan"),
                   metric=metric, sentence=sentence, flips_when=flips_when)


def crossing(xs: Sequence[float], mechanism: Sequence[float | None], baseline: Sequence[float | None],
             higher_is_better: bool) -> float | None:
    """Where, along a sweep `xs` (ascending), the mechanism's curve crosses the baseline's (linear interpolation
    between the two sweep points around the first sign change of the gain); None when it never does in the sweep.
    Points where either curve is missing (None, not finite) are skipped."""
    points = [(float(x), float(a), float(b)) for x, a, b in zip(xs, mechanism, baseline)
              if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)]

    def margin(a: float, b: float) -> float:
        return (a - b) if higher_is_better else (b - a)

    for (x0, a0, b0), (x1, a1, b1) in zip(points, points[1:]):
        m0, m1 = margin(a0, b0), margin(a1, b1)
        if m0 == 0:
            return x0
        if (m0 > 0) != (m1 > 0) or m1 == 0:
            return x0 + (x1 - x0) * m0 / (m0 - m1)
    return None

