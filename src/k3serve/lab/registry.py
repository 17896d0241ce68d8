"""What a lab module declares, how its parameters are checked, and the registry of all modules.

A module is one file in `k3serve/lab/modules/` that defines `MODULE = LabModule(...)`. Its `run(params, progress,
cancel, lab)` gets validated parameters (every declared one, defaults filled in), a progress callback
`progress(fraction, message)`, a `CancelToken` to check between units of work, and the shared `LabFixtures`; it
returns a `LabResult`: metrics and the baseline's metrics (the mechanism off, or the other policy), figures, and
notes. The registry adds the module id, the parameters, the timing and the reproducing command.

A range that depends on the model (a MoE layer id, the number of expert slots, the trace's length) comes from the
module's `limits(lab)`: the page shows it, and a value outside it is refused before the run (HTTP 400 naming the
parameter). No module caps a value silently: what runs is what the reproducing command says.

Every figure says whether it was measured on this machine or computed by a model (`Figure.measured`), and what
exactly it came from (`Figure.source`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib
import math
import pkgutil
import re
import shlex
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from k3serve.errors import K3Error

ParamType = Literal["int", "float", "choice", "bool"]
Kind = Literal["measured", "simulated", "both"]
ProgressFn = Callable[[float, str], None]


class LabParamError(K3Error):
    """A lab parameter is unknown, of the wrong type or out of range; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"parameter {param!r}: {message}")
        self.param = param


class UnknownModuleError(K3Error):
    """No lab module has that id."""


class RunCancelled(K3Error):
    """A run was cancelled (raised by `CancelToken.check`)."""


class CancelToken:
    """Set by whoever cancels; a module calls `check()` between units of work and stops at the next one. `event` is
    a `threading.Event` by default; the lab's worker process passes a `multiprocessing` one that its parent sets."""

    def __init__(self, event=None) -> None:
        self._event = event if event is not None else threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise RunCancelled("the run was cancelled")


@dataclass(frozen=True)
class Param:
    name: str
    type: ParamType
    default: Any
    help: str = ""
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    unit: str = ""

    def __post_init__(self) -> None:
        if self.type == "choice" and not self.choices:
            raise ValueError(f"choice parameter {self.name} needs choices")
        self.coerce(self.default)  # a module's own default must be valid

    def coerce(self, value: Any) -> Any:
        """The value as this parameter's type, or LabParamError naming the parameter. Strings are parsed (the CLI's
        `--param k=v`); JSON numbers and booleans are taken as they are."""
        name = self.name
        if self.type == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                return value.lower() in ("true", "1", "yes", "on")
            raise LabParamError(name, f"must be true or false, got {value!r}")
        if self.type == "choice":
            if not isinstance(value, str) or value not in self.choices:
                raise LabParamError(name, f"must be one of {', '.join(self.choices)}; got {value!r}")
            return value
        if isinstance(value, bool):
            raise LabParamError(name, f"must be a number, got {value!r}")
        if isinstance(value, str):
            try:
                value = int(value) if self.type == "int" else float(value)
            except ValueError:
                raise LabParamError(name, f"must be {'an integer' if self.type == 'int' else 'a number'}, "
                                          f"got {value!r}") from None
        if self.type == "int":
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if not isinstance(value, int):
                raise LabParamError(name, f"must be an integer, got {value!r}")
        else:
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise LabParamError(name, f"must be a finite number, got {value!r}")
            value = float(value)
        if self.min is not None and value < self.min:
            raise LabParamError(name, f"must be >= {self.min:g}, got {value:g}")
        if self.max is not None and value > self.max:
            raise LabParamError(name, f"must be <= {self.max:g}, got {value:g}")
        return value

    def to_json(self) -> dict:
        return {"name": self.name, "type": self.type, "default": self.default, "min": self.min, "max": self.max,
                "choices": list(self.choices) if self.choices else None, "unit": self.unit, "help": self.help}


# What may stand in an axis title's last parentheses, "what it is (unit)": one unit per axis. Sizes and times in
# human units (never raw bytes), ratios as "x", counts by what they count.
AXIS_UNITS = frozenset({
    "B", "KiB", "MiB", "GiB", "KB", "MB", "GB", "TB", "KiB/token", "MiB/token", "MB/token",
    "ms", "s", "ms/token", "s/token", "tok/s", "MiB/s", "$/Mtok",
    "%", "x", "ratio", "bits",
    "tokens", "positions", "requests", "blocks", "reads", "reads/token", "checkpoints", "experts", "slots",
    "replicas", "count", "index", "expert id", "dimensions"})


def axis_unit(label: str) -> str | None:
    """The unit of an axis title "what it is (unit)", or None when it names none."""
    found = re.search(r"\(([^()]*)\)\s*$", label)
    return found.group(1).strip() if found else None


class FigureError(ValueError):
    """A figure declares an axis without a known unit, or a log scale the chart cannot carry honestly."""


@dataclass
class Figure:
    """One chart. kind 'bar' or 'line': traces [{name, x, y}]; 'heatmap': traces [{name, z, x, y}].

    Every numeric axis is titled "what it is (unit)" with a unit from `AXIS_UNITS` (a bar chart's x axis holds
    categories and needs no unit). The page starts linear axes at 0; `log_y` is for line charts only, because a bar's
    length on a log axis exaggerates, and the page says "log scale" on the axis. `highlight` names the bar category
    or trace of the chosen policy, which the page draws in the accent colour."""

    title: str
    kind: Literal["bar", "line", "heatmap"]
    measured: bool  # True: measured on this machine; False: computed by a model (shapes, a simulator)
    source: str  # what exactly it came from, e.g. "the embedded model, 64 tokens" or "full K3 shapes"
    traces: list[dict]
    x_label: str = ""
    y_label: str = ""
    log_y: bool = False
    highlight: str | None = None
    # a figure shown from a stored record, not measured by this run: its date ("2026-12-06"); the mark then says
    # "recorded <date>" and `source` names the machine and the command that measured it
    recorded: str | None = None

    def __post_init__(self) -> None:
        numeric_axes = {"bar": ("y_label",), "line": ("x_label", "y_label"), "heatmap": ("x_label", "y_label")}
        for name in numeric_axes[self.kind]:
            label = getattr(self, name)
            if axis_unit(label) not in AXIS_UNITS:
                raise FigureError(f"figure {self.title!r}: {name} {label!r} must end with a unit in parentheses, "
                                  f"one of {sorted(AXIS_UNITS)}")
        if self.log_y and self.kind != "line":
            raise FigureError(f"figure {self.title!r}: a log scale is for line charts only (bars would exaggerate)")

    def to_json(self) -> dict:
        return {"title": self.title, "kind": self.kind, "measured": self.measured,
                "mark": f"recorded {self.recorded}" if self.recorded else
                        "measured on this machine" if self.measured else "simulated (model)",
                "source": self.source, "traces": self.traces, "x_label": self.x_label, "y_label": self.y_label,
                "log_y": self.log_y, "highlight": self.highlight, "recorded": self.recorded,
                "x_unit": axis_unit(self.x_label), "y_unit": axis_unit(self.y_label)}


@dataclass(frozen=True)
class Verdict:
    """One generated sentence on a result: did the mechanism win or lose here, by how much, and when it would flip.

    `outcome` is "won", "lost" or "even" (within `even_band` of 1.0); `factor` is the mechanism's gain as a ratio
    (>1 is better, whatever the metric's direction); `flips_when` names the condition under which the outcome would
    reverse, computed from the module's own model or a sweep (never prose written by hand), or "" when the module
    has no such model. `sentence` is what the page shows."""

    outcome: Literal["won", "lost", "even"]
    factor: float
    metric: str  # the metric key the factor compares
    sentence: str
    flips_when: str = ""


@dataclass
class LabResult:
    metrics: dict[str, float]  # the mechanism on (or the policy under study)
    baseline: dict[str, float]  # the mechanism off (or the reference policy), same keys where comparable
    figures: list[Figure]
    labels: dict[str, str] = field(default_factory=dict)  # metric key -> "what it is (unit)"
    baseline_name: str = "baseline"
    metrics_name: str = "with the mechanism"
    notes: list[str] = field(default_factory=list)
    related_commands: list[str] = field(default_factory=list)  # native k3serve commands for the same figures
    verdict: Verdict | None = None  # the generated verdict sentence (see Verdict)


@dataclass(frozen=True)
class LabModule:
    id: str
    number: int  # its place on the page
    title: str
    summary: str  # one sentence
    explanation: str  # what the mechanism does and why it pays; the equation where there is one
    params: tuple[Param, ...]
    kind: Kind
    run: Callable[..., LabResult]  # run(params, progress, cancel, lab) -> LabResult
    check: Callable[[dict[str, Any]], None] | None = None  # rules across parameters; raises LabParamError
    # ranges the model sets: limits(lab) -> {name: (min, max)}, narrowing the declared ones (a top-level function:
    # modules travel to the lab's worker process by pickling)
    limits: Callable[[Any], dict[str, tuple[float, float]]] | None = None

    def params_for(self, lab: Any = None) -> tuple[Param, ...]:
        """The parameters with the ranges of `lab`'s model (`limits`), or as declared when there is no lab."""
        if self.limits is None or lab is None:
            return self.params
        ranges = self.limits(lab)
        out = []
        for p in self.params:
            if p.name in ranges:
                low, high = ranges[p.name]
                p = dataclasses.replace(p, min=low, max=high, default=min(max(p.default, low), high))
            out.append(p)
        return tuple(out)

    def validate(self, raw: dict[str, Any] | None, lab: Any = None) -> dict[str, Any]:
        """Every declared parameter, defaults filled in; unknown or bad ones raise LabParamError naming them. With
        `lab`, the ranges are its model's (`limits`)."""
        raw = dict(raw or {})
        params = self.params_for(lab)
        known = {p.name: p for p in params}
        for name in raw:
            if name not in known:
                raise LabParamError(name, f"unknown for module {self.id!r}; its parameters are "
                                          f"{', '.join(known) or '(none)'}")
        values = {p.name: p.coerce(raw[p.name]) if p.name in raw else p.default for p in params}
        if self.check is not None:
            self.check(values)
        return values

    def command(self, params: dict[str, Any], model: str | None = None) -> str:
        """The shell command that reproduces a run with these (validated) parameters."""
        parts = ["k3serve", "lab", "run", self.id]
        if model:
            parts += ["--model", model]
        for p in self.params:
            value = params[p.name]
            if value != p.default:
                text = ("true" if value else "false") if p.type == "bool" else f"{value:g}" \
                    if isinstance(value, float) else str(value)
                parts += ["--param", f"{p.name}={text}"]
        return " ".join(shlex.quote(x) for x in parts)

    def to_json(self, lab: Any = None) -> dict:
        return {"id": self.id, "number": self.number, "title": self.title, "summary": self.summary,
                "explanation": self.explanation, "params": [p.to_json() for p in self.params_for(lab)],
                "kind": self.kind}


def _finite(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def verdict_json(verdict: Verdict | None) -> dict | None:
    if verdict is None:
        return None
    return {"outcome": verdict.outcome, "factor": _finite(verdict.factor), "metric": verdict.metric,
            "sentence": verdict.sentence, "flips_when": verdict.flips_when}


def result_json(module: LabModule, params: dict[str, Any], result: LabResult, seconds: float,
                model: str | None = None) -> dict:
    """The documented run record: {id, params, measured, metrics, baseline, series, command, seconds, verdict,
    date, ...}; `date` is when it finished (UTC, ISO 8601)."""
    command = module.command(params, model)
    series = []
    for figure in result.figures:
        entry = figure.to_json()
        entry["command"] = command
        series.append(entry)
    return {"id": module.id, "params": params, "measured": any(f.measured for f in result.figures),
            "metrics": {k: _finite(v) for k, v in result.metrics.items()},
            "baseline": {k: _finite(v) for k, v in result.baseline.items()},
            "labels": result.labels, "metrics_name": result.metrics_name, "baseline_name": result.baseline_name,
            "series": series, "notes": result.notes, "command": command,
            "related_commands": result.related_commands, "seconds": round(seconds, 3),
            "verdict": verdict_json(result.verdict),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


@functools.cache
def _discover() -> tuple[LabModule, ...]:
    from k3serve.lab import modules as package

    found: list[LabModule] = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if isinstance(getattr(module, "MODULE", None), LabModule):
            found.append(module.MODULE)
    ids = [m.id for m in found]
    if len(set(ids)) != len(ids):
        raise RuntimeError(f"two lab modules share an id: {sorted(ids)}")
    return tuple(sorted(found, key=lambda m: (m.number, m.id)))


def modules() -> dict[str, LabModule]:
    """Every module in k3serve/lab/modules (each file's `MODULE`), by id, in page order."""
    return {m.id: m for m in _discover()}


def get_module(module_id: str) -> LabModule:
    found = modules().get(module_id)
    if found is None:
        raise UnknownModuleError(f"no lab module {module_id!r}; the modules are {', '.join(modules())}")
    return found
