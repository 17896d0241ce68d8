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

With `trunk_dtype="bf16"` the trunk is held as the engine then holds it (`weights.held.held_bytes`: every
bf16-stored matrix as bf16 bits, multiplied by `kernels.linear`; norms, conv taps, routers widened):
    globals          the globals blob's read buffer (embedding and lm_head are views of it), plus the bounded
                     float32 transient of `kernels.linear` (BF16_WIDEN_BLOCK_BYTES of rows at a time)
    pinned trunk     each pinned layer's held bytes
    trunk streaming  staging + 2 x the held bytes (computing, next being built from views of the staging
                     buffer); when that does not fit, the
                     read-ahead is dropped (`trunk_read_ahead=False`: staging + 1 x held; each streamed layer is
                     read when it is needed, and next-layer prefetch, which needs the next layer's router, is off)

With a bf16 trunk dtype on a store whose fused groups are adjacent (format 2), its trunk stored as bf16, Q8_0 or
MXFP4 by rows (format 3; `builds_views`), the engine holds the trunk as views of what it read (`trunk_views`), and
the charges are the memory floor's (stream/trunk_spans.py says what is read):
    globals          the small globals widened (final norm, output residual query), the bounded float32 transient
                     of `kernels.linear`, and the lm_head's read span when it is pinned. The embedding is never
                     held: its rows are read on demand, one per token
    pinned item      a layer: its read span (the views) + its float32 copies (norms, conv taps, routers,
                     `held.widened_bytes`); the lm_head: its read span. Pinned largest first, the lm_head among
                     the layers
    trunk streaming  a staging ring of 1 or 2 buffers (2 with the read-ahead), each the largest piece of a streamed
                     layer (a dense layer is three pieces) or at least one lm_head row, + as many times the largest
                     float32 copies of a streamed layer. A streamed lm_head is read through the same ring in row
                     chunks

Default split: the trunk first (pinning layers, largest first, while the rest still fits), then expert slots.
`pin_trunk_bytes` caps what may go to pinned layers, to move the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3serve.errors import K3Error
from k3serve.units import format_size
from k3serve.weights.store import PackedStore

class BudgetError(K3Error):
    """The RAM budget cannot run the model."""


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
    trunk_dtype: str = "float32"
    trunk_read_ahead: bool = True  # False: streamed layers are read when needed (a bf16 trunk in a tight budget)
    trunk_views: bool = False  # the trunk built as views of its read buffers (the memory floor's mode)
    head_pinned: bool = True  # False: the lm_head is read in row chunks through the staging ring every step
    staging_bytes: int = 0  # one staging buffer (views mode): the largest piece read into it
    ring_buffers: int = 0  # staging buffers (views mode): 2 with the read-ahead, 1 without, 0 when nothing streams

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
            f"expert cache {format_size(self.expert_cache_bytes)} ({self.expert_slots} slots)"
            + (f"; trunk {self.trunk_dtype}" if self.trunk_dtype != "float32" else "")
            + ("" if self.trunk_read_ahead or not self.streamed_layers else ", no read-ahead")
            + (f"; views of a staging ring of {self.ring_buffers} x {format_size(self.staging_bytes)}"
               if self.trunk_views and self.ring_buffers else "")
            + ("; lm_head streamed in row chunks" if not self.head_pinned else ""),
        ]


TRUNK_DTYPES = ("float32", "bf16")


def _check_dtype(trunk_dtype: str) -> None:
    if trunk_dtype not in TRUNK_DTYPES:
        raise BudgetError(f"trunk dtype must be one of {', '.join(TRUNK_DTYPES)}, got {trunk_dtype!r}")


def _globals_bytes(store: PackedStore, trunk_dtype: str) -> int:
    if trunk_dtype == "float32":
        return store.globals.float32_bytes
    from k3serve.model.kernels import BF16_WIDEN_BLOCK_BYTES

    # the read buffer, plus the float32 transient `kernels.linear` makes of a bf16 matrix for 32+ tokens
    # (row blocks of at most BF16_WIDEN_BLOCK_BYTES; a matrix widens to at most twice its blob's bytes)
    largest = max([store.globals.size] + [b.size for b in store.layers])
    return store.globals.read_size + min(BF16_WIDEN_BLOCK_BYTES, 2 * largest)


def _layer_bytes(store: PackedStore, trunk_dtype: str) -> dict[int, int]:
    if trunk_dtype == "float32":
        return {l: store.layers[l].float32_bytes for l in range(store.config.num_layers)}
    return {l: store.layers[l].held_bytes(trunk_dtype) for l in range(store.config.num_layers)}


def _stream_buffer_bytes(store: PackedStore, streamed: list[int], trunk_dtype: str = "float32",
                         read_ahead: bool = True, held: dict[int, int] | None = None) -> int:
    if not streamed:
        return 0
    staging = max(store.layers[l].read_size for l in streamed)
    if trunk_dtype == "float32":
        return staging + 3 * max(store.layers[l].float32_bytes for l in streamed)
    held = held if held is not None else _layer_bytes(store, trunk_dtype)
    return staging + (2 if read_ahead else 1) * max(held[l] for l in streamed)


VIEW_DTYPES = ("BF16", "Q8_0", "MXFP4")  # stored matrix dtypes whose fused groups and rows are contiguous (MXFP4
# from store format 3, laid out by rows)


def builds_views(store: PackedStore, trunk_dtype: str) -> bool:
    """Whether the engine holds this store's trunk as views of what it read: a bf16 trunk dtype, fused groups
    adjacent (format 2), the embedding and lm_head stored as bf16, Q8_0 or MXFP4 (`pack --trunk-precision`), and
    no MXFP4 matrix laid out planar (format 2: an MXFP4 entry there is its nibbles then its scales, so a fused group
    is stacked as a copy and a row is not one read; such a trunk is built as copies and charged `held_bytes`)."""
    if trunk_dtype != "bf16" or not getattr(store, "adjacent_groups", False):
        return False
    from k3serve.weights import names

    if not getattr(store, "mxfp4_rows", False) and any(
            t[1] == "MXFP4" for blob in [store.globals] + list(store.layers) for t in blob.tensors):
        return False
    return all(store.globals.tensor(n).dtype in VIEW_DTYPES for n in (names.EMBED, names.LM_HEAD))


class ViewSizes:
    """The views mode's sizes of one store (stream/trunk_spans.py): per layer its largest piece's span, its pinned
    bytes (read span + float32 copies) and its float32 copies; the lm_head's span and row; the small globals."""

    def __init__(self, store: PackedStore) -> None:
        from k3serve.model.kernels import BF16_WIDEN_BLOCK_BYTES
        from k3serve.stream.trunk_spans import head_min_staging, piece_spans, span
        from k3serve.weights import names

        num_layers = store.config.num_layers
        self.piece = {l: max(s.length for s in piece_spans(b.offset, b.entries, b.size))
                      for l, b in enumerate(store.layers[:num_layers])}
        self.widened = {l: store.layers[l].widened_bytes("bf16") for l in range(num_layers)}
        self.pinned = {l: store.layers[l].read_size + self.widened[l] for l in range(num_layers)}
        g = store.globals
        head = g.tensor(names.LM_HEAD)
        self.head_span = span(g.offset + head.offset, head.nbytes)
        self.head_rows, self.head_row_bytes = head.shape[0], head.nbytes // head.shape[0]
        self.head_min_staging = head_min_staging(self.head_row_bytes)
        small = [t for t in g.entries if t.name not in (names.EMBED, names.LM_HEAD)]
        self.small_span = span(g.offset, max(t.offset + t.nbytes for t in small))
        self.small_bytes = sum(int(np.prod(t.shape)) * 4 for t in small)
        largest = max([head.nbytes] + [b.size for b in store.layers])
        self.transient = min(BF16_WIDEN_BLOCK_BYTES, 2 * largest)

    def globals_bytes(self, head_pinned: bool) -> int:
        return self.small_bytes + self.transient + (self.head_span.length if head_pinned else 0)

    def staging(self, streamed: list[int], head_streamed: bool) -> int:
        if not streamed and not head_streamed:
            return 0
        size = max((self.piece[l] for l in streamed), default=0)
        if head_streamed:
            size = max(size, self.head_min_staging if streamed else max(self.piece.values()))
        return size

    def stream_bytes(self, streamed: list[int], head_streamed: bool, ring: int) -> int:
        staging = self.staging(streamed, head_streamed)
        if not staging:
            return 0
        ring = ring if streamed else 1  # the lm_head alone streams through one buffer
        return ring * (staging + max((self.widened[l] for l in streamed), default=0))


HEAD = -1  # the lm_head as an item of the views mode's pinning order


def _views_minimum(store: PackedStore, min_slots: int) -> int:
    """Everything streamed through one staging buffer (lm_head included), or everything pinned if smaller."""
    sizes = ViewSizes(store)
    layers = list(range(store.config.num_layers))
    streaming = sizes.globals_bytes(False) + sizes.stream_bytes(layers, True, 1)
    all_pinned = sizes.globals_bytes(True) + sum(sizes.pinned.values())
    return min(streaming, all_pinned) + min_slots * store.expert_stride


def _plan_views(store: PackedStore, budget_bytes: int | None, pin_trunk_bytes: int | None,
                min_slots: int) -> BudgetPlan:
    config = store.config
    num_layers = config.num_layers
    stride, total_experts = store.expert_stride, store.num_experts_total
    sizes = ViewSizes(store)
    items = {**sizes.pinned, HEAD: sizes.head_span.length}
    order = sorted(items, key=lambda i: (-items[i], i))

    def plan(pinned: list[int], read_ahead: bool, slots: int) -> BudgetPlan:
        layers = sorted(l for l in pinned if l != HEAD)
        streamed = [l for l in range(num_layers) if l not in layers]
        head_pinned = HEAD in pinned
        ring = (2 if read_ahead else 1) if streamed else (1 if not head_pinned else 0)
        return BudgetPlan(budget_bytes, sizes.globals_bytes(head_pinned), tuple(layers),
                          sum(sizes.pinned[l] for l in layers), tuple(streamed),
                          sizes.stream_bytes(streamed, not head_pinned, ring), slots, stride, "bf16",
                          read_ahead or not streamed, True, head_pinned,
                          sizes.staging(streamed, not head_pinned), ring)

    def need(pinned: list[int], read_ahead: bool) -> int:
        return plan(pinned, read_ahead, min_slots).total_bytes

    if budget_bytes is None:
        pinned = list(items) if pin_trunk_bytes is None else []
        if pin_trunk_bytes is not None:
            used = 0
            for i in order:
                if used + items[i] <= pin_trunk_bytes:
                    pinned.append(i)
                    used += items[i]
        return plan(pinned, True, total_experts)
    minimum = _views_minimum(store, min_slots)
    if budget_bytes < minimum:
        staging = format_size(sizes.staging(list(range(num_layers)), True))
        raise BudgetError(
            f"RAM budget {format_size(budget_bytes)} cannot run one layer: the minimum is {format_size(minimum)} "
            f"({minimum} bytes: small globals, one staging buffer of {staging} for the trunk and lm_head, and "
            f"{min_slots} expert slots of {format_size(stride)}, trunk held as bf16 views); use --ram-budget "
            f"{minimum} or more")
    read_ahead = need([], True) <= budget_bytes
    cap = budget_bytes if pin_trunk_bytes is None else pin_trunk_bytes
    pinned: list[int] = []
    for i in order:
        trial = pinned + [i]
        if need(trial, read_ahead) <= budget_bytes and sum(items[x] for x in trial) <= cap:
            pinned.append(i)
    if need(pinned, read_ahead) > budget_bytes:  # only the whole trunk pinned fits (a model smaller than a ring)
        pinned = list(items)
    base = plan(pinned, read_ahead, 0)
    slots = min(total_experts, (budget_bytes - base.total_bytes) // stride)
    assert slots >= min_slots
    return plan(pinned, read_ahead, int(slots))


def minimum_budget_bytes(store: PackedStore, min_slots: int | None = None, trunk_dtype: str = "float32") -> int:
    """The smallest budget that runs one layer: globals, streaming buffers for the trunk (or the whole trunk pinned,
    if that is smaller) and `min_slots` expert slots (default: top-k). A bf16 trunk may drop the read-ahead; held
    as views (`builds_views`) it is the memory floor (`_plan_views`)."""
    _check_dtype(trunk_dtype)
    config = store.config
    if builds_views(store, trunk_dtype):
        min_slots = config.num_experts_per_token if min_slots is None else min_slots
        return _views_minimum(store, min_slots)
    min_slots = config.num_experts_per_token if min_slots is None else min_slots
    layers = list(range(config.num_layers))
    held = _layer_bytes(store, trunk_dtype)
    globals_bytes = _globals_bytes(store, trunk_dtype)
    streaming = globals_bytes + _stream_buffer_bytes(store, layers, trunk_dtype, trunk_dtype == "float32", held)
    all_pinned = globals_bytes + sum(held.values())
    return min(streaming, all_pinned) + min_slots * store.expert_stride


def plan_budget(store: PackedStore, budget_bytes: int | None, pin_trunk_bytes: int | None = None,
                min_slots: int | None = None, trunk_dtype: str = "float32") -> BudgetPlan:
    _check_dtype(trunk_dtype)
    config = store.config
    num_layers = config.num_layers
    min_slots = config.num_experts_per_token if min_slots is None else min_slots
    if builds_views(store, trunk_dtype):
        return _plan_views(store, budget_bytes, pin_trunk_bytes, min_slots)
    total_experts = store.num_experts_total
    stride = store.expert_stride
    globals_bytes = _globals_bytes(store, trunk_dtype)
    sizes = _layer_bytes(store, trunk_dtype)

    def stream_bytes(streamed: list[int], read_ahead: bool) -> int:
        return _stream_buffer_bytes(store, streamed, trunk_dtype, read_ahead, sizes)

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
                          tuple(streamed), stream_bytes(streamed, True), total_experts, stride, trunk_dtype)

    minimum = minimum_budget_bytes(store, min_slots, trunk_dtype)
    if budget_bytes < minimum:
        raise BudgetError(
            f"RAM budget {format_size(budget_bytes)} cannot run one layer: the minimum is {format_size(minimum)} "
            f"({minimum} bytes: globals {format_size(globals_bytes)}, trunk streaming buffers and {min_slots} "
            f"expert slots of {format_size(stride)}, trunk held as {trunk_dtype}); use --ram-budget {minimum} or more")
    # a bf16 trunk keeps its read-ahead when the budget allows it with every layer streamed, else drops it
    read_ahead = (trunk_dtype == "float32" or globals_bytes + stream_bytes(list(range(num_layers)), True)
                  + min_slots * stride <= budget_bytes)
    cap = budget_bytes if pin_trunk_bytes is None else pin_trunk_bytes
    pinned: list[int] = []
    pinned_bytes = 0
    for l in sorted(range(num_layers), key=lambda l: (-sizes[l], l)):
        trial = pinned + [l]
        streamed = [x for x in range(num_layers) if x not in trial]
        need = globals_bytes + pinned_bytes + sizes[l] + stream_bytes(streamed, read_ahead) + min_slots * stride
        if need <= budget_bytes and pinned_bytes + sizes[l] <= cap:
            pinned.append(l)
            pinned_bytes += sizes[l]
    streamed = [l for l in range(num_layers) if l not in pinned]
    buffers = stream_bytes(streamed, read_ahead)
    left = budget_bytes - globals_bytes - pinned_bytes - buffers
    slots = min(total_experts, left // stride)
    assert slots >= min_slots
    return BudgetPlan(budget_bytes, globals_bytes, tuple(sorted(pinned)), pinned_bytes, tuple(streamed),
                      buffers, int(slots), stride, trunk_dtype, read_ahead or not streamed)


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
