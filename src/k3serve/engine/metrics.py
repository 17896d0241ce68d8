"""One metrics registry for the engine: counters, gauges and histograms, in plain Python.

Every component reports into the same `MetricsRegistry`; the CLI report, the benchmarks, the lab and (later) the
HTTP `/metrics` endpoint read `snapshot()`. Thread-safe: the engine thread writes while a server thread reads.
Histograms keep count and sum of every sample and the most recent `window` samples for quantiles.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections import deque
from typing import Any, Callable

logger = logging.getLogger(__name__)


class Counter:
    """A value that only goes up (tokens generated, preemptions)."""

    def __init__(self, name: str, help: str, lock: threading.Lock) -> None:
        self.name, self.help, self._lock = name, help, lock
        self._value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (inc by {amount})")
        with self._lock:
            self._value += amount

    def advance_to(self, total: float) -> None:
        """Follow a total kept elsewhere (it never goes down; a smaller total is ignored)."""
        with self._lock:
            self._value = max(self._value, float(total))

    @property
    def value(self) -> float:
        return self._value


class Gauge:
    """A value that is set to the current state (queue length, blocks in use)."""

    def __init__(self, name: str, help: str, lock: threading.Lock) -> None:
        self.name, self.help, self._lock = name, help, lock
        self._value = 0.0

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    @property
    def value(self) -> float:
        return self._value


# upper bounds in seconds, for latencies from a fast decode step to a long prefill under a RAM budget
DEFAULT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   math.inf)


class Histogram:
    """Samples of a quantity (TTFT, inter-token latency): count, sum, cumulative bucket counts since start (for a
    Prometheus histogram), and quantiles over a recent window."""

    def __init__(self, name: str, help: str, lock: threading.Lock, window: int = 10_000,
                 buckets: tuple[float, ...] = DEFAULT_BUCKETS) -> None:
        self.name, self.help, self._lock = name, help, lock
        self._recent: deque[float] = deque(maxlen=window)
        self.count = 0
        self.sum = 0.0
        self._bounds = buckets
        self._bucket_counts = [0] * len(buckets)

    def observe(self, value: float) -> None:
        value = float(value)
        with self._lock:
            self._recent.append(value)
            self.count += 1
            self.sum += value
            self._bucket_counts[bisect.bisect_left(self._bounds, value)] += 1

    def cumulative_buckets(self) -> list[tuple[float, int]]:
        """(upper bound, samples <= bound) for every bound, the last one +inf = count."""
        with self._lock:
            counts = list(self._bucket_counts)
        total, out = 0, []
        for bound, count in zip(self._bounds, counts):
            total += count
            out.append((bound, total))
        return out

    def samples(self) -> list[float]:
        with self._lock:
            return list(self._recent)

    def quantile(self, q: float) -> float:
        return _quantile(sorted(self.samples()), q)

    def summary(self) -> dict[str, float]:
        values = sorted(self.samples())
        return {"count": self.count, "sum": self.sum, "p50": _quantile(values, 0.5),
                "p90": _quantile(values, 0.9), "p99": _quantile(values, 0.99)}


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    position = q * (len(sorted_values) - 1)
    low = int(math.floor(position))
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


class Family:
    """One metric per combination of label values (per tenant, per tenant and reason):
    `family.labels("alice").inc()`. Children are created on first use and never removed."""

    def __init__(self, kind: type, name: str, help: str, label_names: tuple[str, ...]) -> None:
        self.kind, self.name, self.help, self.label_names = kind, name, help, label_names
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], Counter | Gauge | Histogram] = {}

    def labels(self, *values: str) -> Any:
        if len(values) != len(self.label_names):
            raise ValueError(f"metric {self.name} takes labels {self.label_names}, got {values}")
        key = tuple(str(v) for v in values)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self.kind(self.name, self.help, threading.Lock())
            return child

    def children(self) -> list[tuple[tuple[str, ...], Counter | Gauge | Histogram]]:
        with self._lock:
            return list(self._children.items())


class MetricsRegistry:
    """Named metrics, created on first use: `registry.counter("x").inc()`. Asking again returns the same one.
    Labeled families (`registry.family(Counter, "x", "help", ("tenant",))`) live beside them, in `families()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}
        self._families: dict[str, Family] = {}
        self._refreshers: list[Callable[[MetricsRegistry], None]] = []

    def add_refresher(self, refresher: Callable[[MetricsRegistry], None]) -> None:
        """`refresher(registry)` runs before every read (`refresh`): for counters another component keeps (a
        weight source's bytes read), copied in when someone looks rather than on every step."""
        with self._lock:
            self._refreshers.append(refresher)

    def refresh(self) -> None:
        """Run the refreshers; one that fails is logged and skipped (its metrics keep their last values)."""
        with self._lock:
            refreshers = list(self._refreshers)
        for refresher in refreshers:
            try:
                refresher(self)
            except Exception as exc:  # a scrape must not fail because one source could not answer
                logger.warning("metrics refresher %s failed: %s", getattr(refresher, "__name__", refresher), exc)

    def _get(self, kind: type, name: str, help: str) -> Any:
        with self._lock:
            metric = self._metrics.get(name)
            if metric is None:
                metric = self._metrics[name] = kind(name, help, threading.Lock())
            elif not isinstance(metric, kind):
                raise TypeError(f"metric {name} is a {type(metric).__name__}, not a {kind.__name__}")
            return metric

    def counter(self, name: str, help: str = "") -> Counter:
        return self._get(Counter, name, help)

    def gauge(self, name: str, help: str = "") -> Gauge:
        return self._get(Gauge, name, help)

    def histogram(self, name: str, help: str = "") -> Histogram:
        return self._get(Histogram, name, help)

    def metrics(self) -> list[Counter | Gauge | Histogram]:
        with self._lock:
            return list(self._metrics.values())

    def family(self, kind: type, name: str, help: str, label_names: tuple[str, ...]) -> Family:
        """The labeled family `name` of `kind` (Counter, Gauge or Histogram), created on first use."""
        with self._lock:
            family = self._families.get(name)
            if family is None:
                family = self._families[name] = Family(kind, name, help, label_names)
            elif family.kind is not kind or family.label_names != label_names:
                raise TypeError(f"metric family {name} is a {family.kind.__name__}{family.label_names}")
            return family

    def families(self) -> list[Family]:
        with self._lock:
            return list(self._families.values())

    def snapshot(self) -> dict[str, Any]:
        """Every metric by name: a number for counters and gauges, a summary dict for histograms."""
        self.refresh()
        out: dict[str, Any] = {}
        for metric in self.metrics():
            out[metric.name] = metric.summary() if isinstance(metric, Histogram) else metric.value
        for family in self.families():  # {"tenant_requests": {"alice": 3.0}}; several labels joined by "/"
            out[family.name] = {"/".join(key): child.summary() if isinstance(child, Histogram) else child.value
                                for key, child in family.children()}
        return out
