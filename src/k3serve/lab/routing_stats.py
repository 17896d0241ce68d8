"""Routing statistics of a model on real text: how much a cache and a prefetcher can hope to gain.

Three figures per MoE layer, measured with the engine's own forward pass and routing trace:
- skew: the share of (token, expert) requests taken by the 10% most requested experts of that layer
  (uniform routing gives 10%);
- reuse: the share of a token's experts that the previous token of the same sequence also chose in that layer
  (uniform routing gives TOPK / NE);
- next-layer recall: run layer l+1's router (its post-attention norm, router and selection bias) on the hidden
  state that layer l's MoE reads, take the top-k, and count how many of layer l+1's real experts it names
  (uniform guessing gives TOPK / NE). This is the guess `--prefetch next-layer` issues.

`measure_routing(model, sequences)` runs prefill forwards (routing is causal, so each token routes as it would in
decode) through a recording wrapper around the model's weight source; `TraceWriter` can keep the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from k3serve.model.routing import Routing
from k3serve.stream.trace import TracedSource


@dataclass
class LayerRouting:
    layer: int
    skew_top10: float
    reuse_prev: float
    next_layer_recall: float | None  # this layer's experts guessed from the previous layer; None after a dense one
    experts_used: int  # experts chosen at least once


@dataclass
class RoutingReport:
    num_experts: int
    top_k: int
    num_tokens: int
    layers: list[LayerRouting] = field(default_factory=list)

    @property
    def uniform_reuse(self) -> float:
        return self.top_k / self.num_experts

    def mean(self, name: str) -> float:
        values = [getattr(l, name) for l in self.layers if getattr(l, name) is not None]
        return float(np.mean(values)) if values else float("nan")

    def table(self) -> str:
        lines = [f"{'layer':>5}  {'top-10% share':>13}  {'reuse prev token':>16}  {'guessed from l-1':>17}  "
                 f"{'experts used':>12}"]
        for l in self.layers:
            recall = "-" if l.next_layer_recall is None else f"{l.next_layer_recall:.1%}"
            lines.append(f"{l.layer:>5}  {l.skew_top10:>13.1%}  {l.reuse_prev:>16.1%}  {recall:>17}  "
                         f"{l.experts_used:>8}/{self.num_experts}")
        lines.append(f"{'mean':>5}  {self.mean('skew_top10'):>13.1%}  {self.mean('reuse_prev'):>16.1%}  "
                     f"{self.mean('next_layer_recall'):>17.1%}")
        lines.append(f"{'unif.':>5}  {0.1:>13.1%}  {self.uniform_reuse:>16.1%}  {self.uniform_reuse:>17.1%}  "
                     f"(uniform routing; {self.num_tokens} tokens)")
        return "\n".join(lines)


class _RecordingSource(TracedSource):
    """Forwards to the inner source (and an optional trace writer); keeps each MoE layer's expert ids and the
    model's next-layer guess per token (asked for at every layer: it is `prefetching`, and it passes the guess on
    only when the inner source reads ahead)."""

    def __init__(self, inner, writer=None) -> None:
        super().__init__(inner, writer)
        self.actual: dict[int, list[np.ndarray]] = {}
        self.predicted: dict[int, list[np.ndarray]] = {}  # keyed by the layer predicted

    @property
    def prefetching(self) -> bool:
        return True

    def prefetch(self, layer: int, guess: Routing) -> None:
        self.predicted.setdefault(layer, []).append(np.array(guess.expert_ids))
        if self.inner.prefetching:
            self.inner.prefetch(layer, guess)

    def note_routing(self, layer: int, expert_ids: np.ndarray) -> None:
        self.actual.setdefault(layer, []).append(np.array(expert_ids))
        super().note_routing(layer, expert_ids)


def _skew(ids: np.ndarray, num_experts: int) -> float:
    counts = np.sort(np.bincount(ids.ravel(), minlength=num_experts))[::-1]
    top = max(1, int(round(0.1 * num_experts)))
    return float(counts[:top].sum() / counts.sum())


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of |a_row & b_row| / TOPK."""
    k = a.shape[1]
    hits = (a[:, :, None] == b[:, None, :]).any(axis=2).sum()
    return float(hits / (a.shape[0] * k))


def measure_routing(model, sequences: Sequence[Sequence[int]], writer=None,
                    progress: Callable[[int, int], None] | None = None) -> RoutingReport:
    """Route every sequence through `model` (one whose `routing_traces` is true) and summarise; `writer` (a TraceWriter) also records the
    requests as a routing trace; `progress(done, total)` hears of each sequence routed. Sequences are independent:
    reuse is counted within a sequence only."""
    from k3serve.model.interface import ForwardItem
    from k3serve.model.k3 import K3Model

    config = model.config
    recorder = _RecordingSource(model.source, writer)
    traced = K3Model(recorder, chunk_size=model.chunk_size, attention_blocks=model.attention_blocks)
    reuse_pairs: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    num_tokens = 0
    total_tokens = sum(len(seq) for seq in sequences)
    for seq in sequences:
        ids = np.asarray(seq, dtype=np.int64)
        if len(ids) == 0:
            continue
        before = {l: len(v) for l, v in recorder.actual.items()}
        traced.forward([ForwardItem(ids, traced.new_cache())])
        num_tokens += len(ids)
        if progress is not None:
            progress(num_tokens, total_tokens)
        for layer, rows in recorder.actual.items():
            if len(rows) > before.get(layer, 0) and len(ids) > 1:
                latest = rows[-1]
                reuse_pairs.setdefault(layer, []).append((latest[1:], latest[:-1]))
    report = RoutingReport(config.num_experts, config.num_experts_per_token, num_tokens)
    for layer in sorted(recorder.actual):
        actual = np.concatenate(recorder.actual[layer])
        reuse = _overlap(np.concatenate([p[0] for p in reuse_pairs[layer]]),
                         np.concatenate([p[1] for p in reuse_pairs[layer]])) if layer in reuse_pairs else 0.0
        recall = None
        if layer in recorder.predicted:
            recall = _overlap(actual, np.concatenate(recorder.predicted[layer]))
        report.layers.append(LayerRouting(layer, _skew(actual, config.num_experts), reuse, recall,
                                          int(len(np.unique(actual)))))
    return report
