"""`PagedSequenceCache`: the model's per-sequence state backed by the engine's pools.

Attention rows live in blocks of the `BlockPool`, addressed through this sequence's block table (position i is row
i % BS of block table[i // BS]); recurrent state lives in one slot of the `StatePool`. Both pools are built from
the model's `CacheLayout`. The scheduler calls `reserve(n)` before a forward so that every block the forward will
write is allocated and private; `append_rows` still allocates and copies on write by itself, for callers that do
not reserve.

Shapes: LA attention layers, BS block size, W row width (a narrower layer uses the first of its W columns),
n cached positions.
"""

from __future__ import annotations

import numpy as np

from k3serve.engine.errors import IntegrityError
from k3serve.engine.paged_kv import BlockPool
from k3serve.engine.state_pool import StatePool
from k3serve.model.cache import CacheLayout, SequenceCache


class PagedSequenceCache(SequenceCache):
    """One sequence's state: a block table into the attention block pool and a recurrent state slot."""

    def __init__(self, blocks: BlockPool, states: StatePool, slot: int | None = None) -> None:
        self.blocks = blocks
        self.states = states
        self.slot = states.allocate() if slot is None else slot
        self.block_table: list[int] = []
        self._num_tokens = 0
        layout = states.layout
        self._row_index = {layer: i for i, layer in enumerate(layout.attention_layers)}
        self._widths = [layout.row_widths[layer] for layer in layout.attention_layers]
        self._row_len = [0] * len(self._row_index)  # rows written per attention layer; all equal between forwards
        self._released = False

    @property
    def layout(self) -> CacheLayout:
        return self.states.layout

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    # ---- SequenceCache --------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def recurrent_state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.states.read(self.slot, layer)

    def set_recurrent_state(self, layer: int, state: np.ndarray, conv_tail: np.ndarray) -> None:
        self.states.write(self.slot, layer, state, conv_tail)

    def append_rows(self, layer: int, rows: np.ndarray) -> None:
        i = self._row_index[layer]
        start = self._row_len[i]
        end = start + len(rows)
        if i == 0:  # the first attention layer of a forward makes the blocks writable for all layers
            self._make_writable(start, end)
        elif end > len(self.block_table) * self.block_size:
            raise IntegrityError(f"attention layer {layer} appends past the blocks the first one reserved")
        BS, W = self.block_size, self._widths[i]
        if end - start == 1:  # decode: one row
            self.blocks.storage[i, self.block_table[start // BS], start % BS, :W] = rows[0]
        else:
            positions = np.arange(start, end)  # [t]
            table = np.asarray(self.block_table)
            self.blocks.storage[i, table[positions // BS], positions % BS, :W] = rows
        self._row_len[i] = end

    def attention_rows(self, layer: int) -> np.ndarray:
        i = self._row_index[layer]
        n, W = self._row_len[i], self._widths[i]
        BS = self.block_size
        if n <= BS:
            return self.blocks.storage[i, self.block_table[0], :n, :W] if n else self.blocks.storage[i, 0, :0, :W]
        used = self.block_table[: -(-n // BS)]
        return self.blocks.storage[i, used].reshape(-1, self.blocks.storage.shape[-1])[:n, :W]  # [n, W]

    def advance(self, num_new_tokens: int) -> None:
        self._num_tokens += num_new_tokens
        if any(length != self._num_tokens for length in self._row_len):
            raise IntegrityError(
                f"after a forward the attention layers hold {self._row_len} rows but the sequence is at "
                f"{self._num_tokens}"
            )

    def truncate(self, num_tokens: int) -> None:
        """Speculative rollback of the attention side: the position moves back to `num_tokens` and blocks past it are
        released (they were reserved for rejected draft positions and never registered in the prefix cache)."""
        if not 0 <= num_tokens <= self._num_tokens:
            raise IntegrityError(f"cannot truncate a cache at {self._num_tokens} positions to {num_tokens}")
        keep = -(-num_tokens // self.block_size)
        for block in reversed(self.block_table[keep:]):
            self.blocks.release(block)
        del self.block_table[keep:]
        self._num_tokens = num_tokens
        self._row_len = [num_tokens] * len(self._row_len)

    # ---- reservation, copy-on-write, sharing ----------------------------------------------------------------
    def num_blocks_to_reserve(self, num_new_tokens: int) -> int:
        """Blocks an append of `num_new_tokens` positions would take from the pool (new ones plus one copy if the
        partly filled last block is shared)."""
        if num_new_tokens <= 0:
            return 0
        BS, start = self.block_size, self._num_tokens
        needed = max(0, -(-(start + num_new_tokens) // BS) - len(self.block_table))
        return needed + int(self._shared_partial_block(start))

    def reserve(self, num_new_tokens: int) -> None:
        """Allocate (and un-share) the blocks the next `num_new_tokens` positions will be written to."""
        self._make_writable(self._num_tokens, self._num_tokens + num_new_tokens)

    def _shared_partial_block(self, start: int) -> bool:
        index = start // self.block_size
        return start % self.block_size != 0 and index < len(self.block_table) \
            and self.blocks.ref_counts[self.block_table[index]] > 1

    def _make_writable(self, start: int, end: int) -> None:
        if end <= start:
            return
        if self._shared_partial_block(start):
            index = start // self.block_size
            self.block_table[index] = self.blocks.copy_on_write(self.block_table[index])
        while len(self.block_table) * self.block_size < end:
            self.block_table.append(self.blocks.allocate())

    def adopt_prefix(self, block_ids: list[int], num_tokens: int) -> None:
        """Start from shared cached blocks that hold positions [0, num_tokens) (full blocks only; the caller has
        already taken a reference on each). Used by the prefix cache on a hit."""
        if self._num_tokens or self.block_table:
            raise IntegrityError("a prefix can only be adopted by an empty cache")
        if len(block_ids) * self.block_size != num_tokens:
            raise IntegrityError(f"{len(block_ids)} full blocks cannot hold exactly {num_tokens} positions")
        self.block_table = list(block_ids)
        self._num_tokens = num_tokens
        self._row_len = [num_tokens] * len(self._row_len)

    def write_rows(self, rows: np.ndarray) -> None:
        """Append rows for all attention layers at once, [LA, t, W], advancing the position: restores the
        partial-block tail of a prefix-cache checkpoint (the recurrent state is restored separately)."""
        t = rows.shape[1]
        if t == 0:
            return
        self._make_writable(self._num_tokens, self._num_tokens + t)
        positions = np.arange(self._num_tokens, self._num_tokens + t)
        table = np.asarray(self.block_table)
        self.blocks.storage[: len(self._row_len), table[positions // self.block_size],
                            positions % self.block_size] = rows
        self._num_tokens += t
        self._row_len = [self._num_tokens] * len(self._row_len)

    def tail_rows(self, position: int) -> np.ndarray:
        """Rows of the partly filled block that ends at `position`, for every attention layer:
        [LA, position % BS, W]."""
        t = position % self.block_size
        block = self.block_table[position // self.block_size] if t else 0
        return self.blocks.storage[: len(self._row_len), block, :t].copy()

    def fork(self) -> PagedSequenceCache:
        """A copy that shares every block (ref counts up; the partial last block is copied on first write) and
        holds its own copy of the recurrent state."""
        child = PagedSequenceCache(self.blocks, self.states)
        self.states.copy_slot(self.slot, child.slot)
        for block in self.block_table:
            self.blocks.acquire(block)
        child.block_table = list(self.block_table)
        child._num_tokens = self._num_tokens
        child._row_len = list(self._row_len)
        return child

    def release(self) -> None:
        """Give back every block (last first, so the tail of a prefix is evicted before its head) and the slot."""
        if self._released:
            raise IntegrityError("a sequence cache was released twice")
        for block in reversed(self.block_table):
            self.blocks.release(block)
        self.block_table = []
        self.states.free(self.slot)
        self._released = True

    def nbytes(self) -> int:
        """Attention bytes this sequence's blocks occupy (counting shared blocks in full) plus its state slot."""
        return len(self.block_table) * self.blocks.storage[:, 0].nbytes + self.states.slot_bytes

    def check_integrity(self) -> None:
        if self._released:
            raise IntegrityError("a released cache is still attached to a sequence")
        if any(length != self._num_tokens for length in self._row_len):
            raise IntegrityError(f"attention rows {self._row_len} differ from the position {self._num_tokens}")
        if len(self.block_table) * self.block_size < self._num_tokens:
            raise IntegrityError(
                f"{len(self.block_table)} blocks cannot hold {self._num_tokens} positions"
            )
        if len(set(self.block_table)) != len(self.block_table):
            raise IntegrityError("a block appears twice in one block table")
        for block in self.block_table:
            if self.blocks.ref_counts[block] < 1:
                raise IntegrityError(f"block {block} is in a block table but has no reference")
