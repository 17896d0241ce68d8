"""/metrics: the engine's one metrics registry in the Prometheus text format.

Counters and gauges map one to one (prefixed `k3serve_`); a histogram is exported as a Prometheus histogram when
it keeps bucket counts, else as a summary with p50/p90/p99 over its recent window.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (CollectorRegistry, CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, SummaryMetricFamily)

from k3serve.engine.metrics import Counter, Family, Gauge, Histogram, MetricsRegistry

PREFIX = "k3serve_"


class _RegistryCollector:
    def __init__(self, registry: MetricsRegistry) -> None:
        self._registry = registry

    def collect(self):
        for metric in self._registry.metrics():
            name = PREFIX + metric.name
            help_text = metric.help or metric.name
            if isinstance(metric, Counter):
                yield CounterMetricFamily(name.removesuffix("_total"), help_text, value=metric.value)
            elif isinstance(metric, Gauge):
                yield GaugeMetricFamily(name, help_text, value=metric.value)
            elif isinstance(metric, Histogram):
                buckets = getattr(metric, "cumulative_buckets", None)
                if buckets is not None:
                    bucket_list = [(_le(bound), count) for bound, count in buckets()]
                    yield HistogramMetricFamily(name, help_text, buckets=bucket_list, sum_value=metric.sum)
                else:
                    family = SummaryMetricFamily(name, help_text, count_value=metric.count, sum_value=metric.sum)
                    yield family
                    quantiles = GaugeMetricFamily(name + "_recent", help_text + " (recent window quantiles)",
                                                  labels=["quantile"])
                    for q in (0.5, 0.9, 0.99):
                        value = metric.quantile(q)
                        if value == value:  # skip NaN (no samples yet)
                            quantiles.add_metric([str(q)], value)
                    yield quantiles
        for family in self._registry.families():
            yield _labeled(family)


def _labeled(family: Family):
    """A labeled family (per tenant) as one Prometheus family with a sample set per label combination."""
    name, help_text, labels = PREFIX + family.name, family.help or family.name, list(family.label_names)
    if family.kind is Counter:
        out = CounterMetricFamily(name.removesuffix("_total"), help_text, labels=labels)
        for key, child in family.children():
            out.add_metric(list(key), child.value)
    elif family.kind is Gauge:
        out = GaugeMetricFamily(name, help_text, labels=labels)
        for key, child in family.children():
            out.add_metric(list(key), child.value)
    else:
        out = HistogramMetricFamily(name, help_text, labels=labels)
        for key, child in family.children():
            out.add_metric(list(key), [(_le(bound), count) for bound, count in child.cumulative_buckets()],
                           child.sum)
    return out


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def render_metrics(registry: MetricsRegistry) -> tuple[bytes, str]:
    registry.refresh()
    prometheus_registry = CollectorRegistry()
    prometheus_registry.register(_RegistryCollector(registry))
    return generate_latest(prometheus_registry), CONTENT_TYPE_LATEST
