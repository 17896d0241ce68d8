"""Splitting a RAM budget between the resident globals, pinned trunk layers, trunk streaming buffers and expert
cache slots.

Everything that holds weight bytes is sized here, once, before the first read: nothing grows later, so the
budget is never exceeded silently. Charges (bytes):

    globals          embeddings, lm_head and final norms, widened to float32 (always resident)
    pinned trunk     each pinned layer, widened to float32
    trunk streaming  when any layer is streamed: one staging buffer (the largest streamed layer's stored bytes)
                     + 3 x its float32 size (the layer being computed, the next one being built, and the
                     transient copies while fusing projections)
    expert slots     slots x the 4 KiB-aligned blob stride; at least TOPK slots (one token's experts)

Default split: the trunk first (pinning layers, largest first, while the rest still fits), then expert slots.
`pin_trunk_bytes` caps what may go to pinned layers, to move the split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from k3serve.errors import K3Error
from k3serve.weights.store import PackedStore

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


class BudgetError(K3Error):
    """The RAM budget cannot run the model, or a size could not be parsed."""


def parse_size(text: str | int) -> int:
    """'8G', '512MiB', '1.5GB', '1048576' -> bytes (K/M/G/T alone are binary units)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise BudgetError(f"cannot read size {text!r}; write e.g. 8G, 512M, 1.5GiB or a byte count")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(nbytes: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


@dataclass(frozen=True)
class BudgetPlan:
    budget_bytes: int | None  # None: unlimited
    globals_bytes: int
    pinned_layers: tuple[int, ...]
    pinned_trunk_bytes: int
    streamed_layers: tuple[int, ...]
    trunk_stream_bytes: int
    expert_slots: int
    expert_stride: int

    @property
    def expert_cache_bytes(self) -> int:
        return self.expert_slots * self.expert_stride

    @property
    def total_bytes(self) -> int:
        return self.globals_bytes + self.pinned_trunk_bytes + self.trunk_stream_bytes + self.expert_cache_bytes

    def lines(self) -> list[str]:
        budget = "unlimited" if self.budget_bytes is None else format_size(self.budget_bytes)
        return [
            f"RAM budget        {budget}: planned {format_size(self.total_bytes)} = globals "
            f"{format_size(self.globals_bytes)} + pinned trunk {format_size(self.pinned_trunk_bytes)} "
            f"({len(self.pinned_layers)} layers) + trunk buffers {format_size(self.trunk_stream_bytes)} + "
            f"expert cache {format_size(self.expert_cache_bytes)} ({self.expert_slots} slots)",
        ]


def _stream_buffer_bytes(store: PackedStore, streamed: list[int]) -> int:
    if not streamed:
        return 0
    return (max(store.layers[l].read_size for l in streamed)
            + 3 * max(store.layers[l].float32_bytes for l in streamed))


def minimum_budget_bytes(store: PackedStore, min_slots: int | None = None) -> int:
    """The smallest budget that runs one layer: globals, streaming buffers for the trunk (or the whole trunk pinned,
    if that is smaller) and `min_slots` expert slots (default: top-k)."""
    config = store.config
    min_slots = config.num_experts_per_token if min_slots is None else min_slots
    layers = range(config.num_layers)
    streaming = store.globals.float32_bytes + _stream_buffer_bytes(store, list(layers))
    all_pinned = store.globals.float32_bytes + sum(store.layers[l].float32_bytes for l in layers)
    return min(streaming, all_pinned) + min_slots * store.expert_stride


def plan_budget(store: PackedStore, budget_bytes: int | None, pin_trunk_bytes: int | None = None,
                min_slots: int | None = None) -> BudgetPlan:
    config = store.config
    num_layers = config.num_layers
    min_slots = config.num_experts_per_token if min_slots is None else min_slots
    total_experts = store.num_experts_total
    stride = store.expert_stride
    globals_bytes = store.globals.float32_bytes
    sizes = {l: store.layers[l].float32_bytes for l in range(num_layers)}
    if budget_bytes is None:
        pinned = list(range(num_layers)) if pin_trunk_bytes is None else []
        if pin_trunk_bytes is not None:
            used = 0
            for l in sorted(range(num_layers), key=lambda l: (-sizes[l], l)):
                if used + sizes[l] <= pin_trunk_bytes:
                    pinned.append(l)
                    used += sizes[l]
        streamed = [l for l in range(num_layers) if l not in pinned]
        return BudgetPlan(None, globals_bytes, tuple(sorted(pinned)), sum(sizes[l] for l in pinned),
                          tuple(streamed), _stream_buffer_bytes(store, streamed), total_experts, stride)

    minimum = minimum_budget_bytes(store, min_slots)
    if budget_bytes < minimum:
        raise BudgetError(
            f"RAM budget {format_size(budget_bytes)} cannot run one layer: the minimum is {format_size(minimum)} "
            f"({minimum} bytes: globals {format_size(globals_bytes)}, trunk streaming buffers and {min_slots} "
            f"expert slots of {format_size(stride)}); use --ram-budget {minimum} or more")
    cap = budget_bytes if pin_trunk_bytes is None else pin_trunk_bytes
    pinned: list[int] = []
    pinned_bytes = 0
    for l in sorted(range(num_layers), key=lambda l: (-sizes[l], l)):
        trial = pinned + [l]
        streamed = [x for x in range(num_layers) if x not in trial]
        need = globals_bytes + pinned_bytes + sizes[l] + _stream_buffer_bytes(store, streamed) + min_slots * stride
        if need <= budget_bytes and pinned_bytes + sizes[l] <= cap:
            pinned.append(l)
            pinned_bytes += sizes[l]
    streamed = [l for l in range(num_layers) if l not in pinned]
    stream_bytes = _stream_buffer_bytes(store, streamed)
    left = budget_bytes - globals_bytes - pinned_bytes - stream_bytes
    slots = min(total_experts, left // stride)
    assert slots >= min_slots
    return BudgetPlan(budget_bytes, globals_bytes, tuple(sorted(pinned)), pinned_bytes, tuple(streamed),
                      stream_bytes, int(slots), stride)


def plan_resident_trunk(budget_bytes: int | None, globals_bytes: int, layer_bytes: list[int], expert_stride: int,
                        total_experts: int, min_slots: int) -> BudgetPlan:
    """The split for a model whose trunk stays resident (the families' stores): globals and every layer pinned,
    the rest of the budget in expert slots (all experts when unlimited). A budget that cannot hold the trunk and
    `min_slots` slots is refused, naming the minimum."""
    trunk = globals_bytes + sum(layer_bytes)
    layers = tuple(range(len(layer_bytes)))
    if budget_bytes is None:
        return BudgetPlan(None, globals_bytes, layers, sum(layer_bytes), (), 0, total_experts, expert_stride)
    minimum = trunk + min_slots * expert_stride
    if budget_bytes < minimum:
        raise BudgetError(
            f"RAM budget {format_size(budget_bytes)} cannot run one layer: the minimum is {format_size(minimum)} "
            f"({minimum} bytes: the resident trunk {format_size(trunk)} and {min_slots} expert slots of "
            f"{format_size(expert_stride)}); use --ram-budget {minimum} or more")
    slots = min(total_experts, (budget_bytes - trunk) // expert_stride)
    return BudgetPlan(budget_bytes, globals_bytes, layers, sum(layer_bytes), (), 0, int(slots), expert_stride)
