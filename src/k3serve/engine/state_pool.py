"""The state pool: one slot of recurrent state per running sequence (or per saved checkpoint), allocated once.

A slot holds, for every recurrent layer of the model's `CacheLayout`, the state S (e.g. [NH, Dk, Dv]) and the
short-conv tail [K-1, C] (the last K-1 pre-conv inputs). Unlike attention rows, a recurrent state is only valid at
the one position where it was taken, so it is copied, never shared. Layers may differ in shape, so each layer has
its own arrays.

Shapes: NS slots; per recurrent layer S shape and [K-1, C].
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from k3serve.engine.errors import IntegrityError, PoolExhaustedError
from k3serve.model.cache import CacheLayout


class StatePool:
    """Fixed slots of recurrent state, handed out and taken back by id."""

    def __init__(self, layout: CacheLayout, num_slots: int) -> None:
        self.layout = layout
        self.num_slots = num_slots
        self.layer_index = {layer: i for i, layer in enumerate(layout.recurrent_layers)}
        shapes = [layout.recurrent_shapes[layer] for layer in layout.recurrent_layers]
        self.states = [np.zeros((num_slots,) + tuple(s), np.float32) for s, _ in shapes]  # per layer [NS, *S]
        self.conv_tails = [np.zeros((num_slots,) + tuple(t), np.float32) for _, t in shapes]  # [NS, K-1, C]
        for array in self.states + self.conv_tails:
            array.fill(0.0)  # allocated and touched once, here
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: lowest id first
        self._used: set[int] = set()

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return len(self._used)

    @property
    def slot_bytes(self) -> int:
        return sum(a[0].nbytes for a in self.states + self.conv_tails) if self.num_slots else 0

    def allocate(self) -> int:
        """A zeroed slot: the state of a fresh sequence."""
        if not self._free:
            raise PoolExhaustedError(f"all {self.num_slots} recurrent state slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        for array in self.states + self.conv_tails:
            array[slot] = 0.0
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise IntegrityError(f"state slot {slot} freed but not in use")
        self._used.remove(slot)
        self._free.append(slot)

    def read(self, slot: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Views (S, conv tail [K-1, C]) of one layer in one slot."""
        i = self.layer_index[layer]
        return self.states[i][slot], self.conv_tails[i][slot]

    def write(self, slot: int, layer: int, state: np.ndarray, conv_tail: np.ndarray) -> None:
        i = self.layer_index[layer]
        self.states[i][slot] = state
        self.conv_tails[i][slot] = conv_tail

    def copy_slot(self, source: int, target: int, source_pool: StatePool | None = None) -> None:
        """Copy every layer's state from `source` (in `source_pool`, default this pool) into `target`."""
        pool = self if source_pool is None else source_pool
        for mine, theirs in zip(self.states + self.conv_tails, pool.states + pool.conv_tails):
            mine[target] = theirs[source]

    def check_integrity(self, expected_used: Iterable[int] | None = None) -> None:
        """Free and used slots partition the pool; when given, the used slots are exactly `expected_used`."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("a state slot is on the free list twice")
        if free & self._used:
            raise IntegrityError(f"state slots both free and used: {sorted(free & self._used)[:8]}")
        if len(free) + len(self._used) != self.num_slots:
            raise IntegrityError(
                f"state slots leaked: {self.num_slots - len(free) - len(self._used)} neither free nor used"
            )
        if expected_used is not None:
            expected = list(expected_used)
            if len(set(expected)) != len(expected):
                raise IntegrityError("two holders share one state slot")
            if set(expected) != self._used:
                raise IntegrityError(
                    f"state slots in use {sorted(self._used)[:8]} differ from the holders' {sorted(expected)[:8]}"
                )
