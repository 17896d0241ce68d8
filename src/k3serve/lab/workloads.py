"""Engine workloads shared by benchmarks/bench_engine.py and the lab: drive an engine to completion, sample its KV
memory after every step, a stand-in model whose memory depends only on lengths, and the shared-prefix TTFT run.

Waste = unfilled positions / reserved positions, sampled after every step under three policies: paged blocks (what
the engine holds), reserving max_model_len per sequence, and reserving prompt + max_tokens per sequence.
"""

from __future__ import annotations

import statistics
from typing import Callable

import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.model.cache import CacheLayout, DenseSequenceCache
from k3serve.model.interface import ForwardResult
from k3serve.model.k3 import k3_cache_layout


class WasteMeter:
    """Samples, after every step, positions filled vs reserved under three policies, and the blocks in use."""

    def __init__(self, engine: LLMEngine | None, max_model_len: int) -> None:
        self.engine, self.max_model_len = engine, max_model_len
        self.filled = self.paged = self.max_len = self.exact = 0
        self.peak_used_blocks = 0

    def sample(self) -> None:
        assert self.engine is not None
        block = self.engine.config.block_size
        for seq in self.engine.scheduler.running:
            self.filled += seq.cache.num_tokens
            self.paged += len(seq.cache.block_table) * block
            self.max_len += self.max_model_len
            self.exact += seq.max_total_tokens
        self.peak_used_blocks = max(self.peak_used_blocks, self.engine.scheduler.blocks.num_used_blocks)

    def merge(self, other: WasteMeter) -> None:
        for name in ("filled", "paged", "max_len", "exact"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.peak_used_blocks = max(self.peak_used_blocks, other.peak_used_blocks)

    def result(self) -> dict[str, float]:
        def waste(reserved: int) -> float:
            return round(100.0 * (1 - self.filled / reserved), 2) if reserved else float("nan")
        return {"paged_pct": waste(self.paged), "reserve_max_len_pct": waste(self.max_len),
                "reserve_prompt_plus_max_tokens_pct": waste(self.exact)}


def run_all(engine: LLMEngine, meter: WasteMeter | None = None, between: Callable[[], None] | None = None) -> dict:
    """Step until every request finished; {request_id: final RequestOutput}. `between()` runs before each step."""
    final = {}
    while engine.has_unfinished_requests():
        if between is not None:
            between()
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if meter is not None:
            meter.sample()
    return final


class ZeroRowsModel:
    """Stand-in for memory workloads: writes zero rows and states through the cache API, random logits. The
    scheduler and the pools are the real ones; memory depends only on lengths."""

    experts = None  # no routed experts: nothing is read
    supports_nested_forward = True

    def __init__(self, config, seed: int = 0, layout: CacheLayout | None = None) -> None:
        self.config = config
        self.cache_layout = layout if layout is not None else k3_cache_layout(config)  # a family model: its own
        self._rng = np.random.default_rng(seed)

    def new_cache(self) -> DenseSequenceCache:
        return DenseSequenceCache(self.cache_layout)

    def resident_draft(self, allowed=None) -> None:
        return None

    def forward(self, items, **kwargs) -> ForwardResult:
        c = self.config
        logits = []
        for item in items:
            t = len(item.token_ids)
            for layer, width in self.cache_layout.row_widths.items():
                item.cache.append_rows(layer, np.zeros((t, width), np.float32))
            item.cache.advance(t)
            logits.append(self._rng.standard_normal((1, c.vocab_size)).astype(np.float32))
        return ForwardResult(logits=logits)


def shared_prefix_ttft(model, stop_ids, caching: bool, system_len: int, num_requests: int, rng,
                       between: Callable[[], None] | None = None) -> dict:
    """One long system prompt + 16 distinct tokens per request, requests one after another; TTFT of each. The 1st
    misses, the 2nd misses but checkpoints the branch point, the rest hit (when caching)."""
    engine = LLMEngine(model, EngineConfig(enable_prefix_caching=caching), stop_ids=stop_ids)
    vocab = model.config.vocab_size
    system = [int(t) for t in np.random.default_rng(7).integers(3, vocab, system_len)]
    ttfts = []
    for _ in range(num_requests):
        question = [int(t) for t in rng.integers(3, vocab, 16)]
        engine.add_request(system + question, SamplingParams(max_tokens=2, ignore_eos=True))
        (out,) = run_all(engine, between=between).values()
        ttfts.append(out.ttft_seconds)
    snap = engine.metrics.snapshot()
    checkpoints = engine.scheduler.prefix_cache.checkpoint_positions() if engine.scheduler.prefix_cache else []
    return {"median_ttft_s": statistics.median(ttfts), "ttfts": ttfts,
            "steady_ttft_s": statistics.median(ttfts[2:]) if len(ttfts) > 2 else float("nan"),
            "hit_tokens": snap.get("prefix_cache_hit_tokens", 0.0),
            "query_tokens": snap.get("prefix_cache_query_tokens", 0.0),
            "shared_fraction": system_len / (system_len + 16), "checkpoint_positions": sorted(checkpoints)}
