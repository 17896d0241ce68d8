"""The KDA state pool: one slot per running sequence (or per saved checkpoint), allocated once.

A slot holds, for every KDA layer, the recurrent state S [NH, D, D] and the short-conv tail [K-1, 3P] (the last
K-1 pre-conv inputs of q, k, v). Unlike MLA rows, a recurrent state is only valid at the one position where it was
taken, so it is copied, never shared.

Shapes: LK KDA layers, NS slots, NH heads, D head dim, P = NH * D, K conv kernel.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from k3serve.config import K3Config
from k3serve.engine.errors import IntegrityError, PoolExhaustedError


class KDAStatePool:
    """Fixed slots of KDA state, handed out and taken back by id."""

    def __init__(self, config: K3Config, num_slots: int) -> None:
        NH, D, K, P = config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size, config.kda_proj_size
        self.num_slots = num_slots
        self.layer_index = {layer: i for i, layer in enumerate(config.kda_layer_ids)}
        LK = max(len(self.layer_index), 1)
        self.states = np.empty((LK, num_slots, NH, D, D), np.float32)  # [LK, NS, NH, D, D]
        self.conv_tails = np.empty((LK, num_slots, K - 1, 3 * P), np.float32)  # [LK, NS, K-1, 3P]
        self.states.fill(0.0)  # allocated and touched once, here
        self.conv_tails.fill(0.0)
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
        return (self.states[:, 0].nbytes + self.conv_tails[:, 0].nbytes) if self.num_slots else 0

    def allocate(self) -> int:
        """A zeroed slot: the state of a fresh sequence."""
        if not self._free:
            raise PoolExhaustedError(f"all {self.num_slots} KDA state slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        self.states[:, slot] = 0.0
        self.conv_tails[:, slot] = 0.0
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise IntegrityError(f"KDA state slot {slot} freed but not in use")
        self._used.remove(slot)
        self._free.append(slot)

    def read(self, slot: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Views (S [NH, D, D], conv tail [K-1, 3P]) of one layer in one slot."""
        i = self.layer_index[layer]
        return self.states[i, slot], self.conv_tails[i, slot]

    def write(self, slot: int, layer: int, state: np.ndarray, conv_tail: np.ndarray) -> None:
        i = self.layer_index[layer]
        self.states[i, slot] = state
        self.conv_tails[i, slot] = conv_tail

    def copy_slot(self, source: int, target: int, source_pool: KDAStatePool | None = None) -> None:
        """Copy every layer's state from `source` (in `source_pool`, default this pool) into `target`."""
        pool = self if source_pool is None else source_pool
        self.states[:, target] = pool.states[:, source]
        self.conv_tails[:, target] = pool.conv_tails[:, source]

    def check_integrity(self, expected_used: Iterable[int] | None = None) -> None:
        """Free and used slots partition the pool; when given, the used slots are exactly `expected_used`."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("a KDA state slot is on the free list twice")
        if free & self._used:
            raise IntegrityError(f"KDA state slots both free and used: {sorted(free & self._used)[:8]}")
        if len(free) + len(self._used) != self.num_slots:
            raise IntegrityError(
                f"KDA state slots leaked: {self.num_slots - len(free) - len(self._used)} neither free nor used"
            )
        if expected_used is not None:
            expected = list(expected_used)
            if len(set(expected)) != len(expected):
                raise IntegrityError("two holders share one KDA state slot")
            if set(expected) != self._used:
                raise IntegrityError(
                    f"KDA state slots in use {sorted(self._used)[:8]} differ from the holders' {sorted(expected)[:8]}"
                )
