"""A model's small weight arrays gathered into one buffer on transparent huge pages.

numpy advises huge pages itself for arrays of 4 MB and more (the stacked experts), but a trunk of small matrices
(the widened K3's [2048, 128] bf16 matrices, 0.25-0.5 MB each) lives on 4 KB pages. At decode those matrices are
read from DRAM (the routed experts stream through the caches in between), and on 4 KB pages each one costs a
page walk per 4 KB, nested under a VM: copied onto 2 MB pages, the widened K3's MoE trunk took 0.67 instead of
0.80 ms a step (docs/BENCHMARKS.md, "The bf16 trunk of the MoE block at decode"). The copy has the same values
(the bits of every product are unchanged); where the system has no `MADV_HUGEPAGE`, nothing is moved.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
from typing import Any, Callable

import numpy as np

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
NUMPY_HUGE_PAGE_MIN_BYTES = 4 << 20  # numpy advises huge pages for arrays from this size on
ALIGNMENT = 64  # each gathered array starts on a cache line


def _rebuild(value: Any, convert: Callable[[np.ndarray], np.ndarray]) -> Any:
    """`value` with each array replaced by convert(array); frozen dataclasses, named tuples, lists, tuples and
    dicts are rebuilt around them; anything else is kept as it is."""
    if isinstance(value, np.ndarray):
        return convert(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _rebuild(getattr(value, f.name), convert)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_rebuild(item, convert) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(item, convert) for item in value)
    if isinstance(value, dict):
        return {key: _rebuild(item, convert) for key, item in value.items()}
    return value


def supported() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap.mmap, "madvise")


def gather_small_arrays(value: Any, max_bytes: int = NUMPY_HUGE_PAGE_MIN_BYTES) -> Any:
    """`value` (weights in dataclasses, lists, tuples, dicts) with each C-contiguous array under `max_bytes` (and not
    empty) replaced by a copy in one buffer advised as huge pages; larger arrays and everything else are kept. Returns
    `value` itself where the system cannot advise huge pages or nothing is small."""
    small: dict[int, np.ndarray] = {}

    def collect(array: np.ndarray) -> np.ndarray:
        if 0 < array.nbytes < max_bytes and array.flags.c_contiguous:  # the copy keeps the layout (BLAS's bits)
            small.setdefault(id(array), array)
        return array

    _rebuild(value, collect)
    if not small or not supported():
        return value
    offsets: dict[int, int] = {}
    total = 0
    for key, array in small.items():
        offsets[key] = total
        total += (array.nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    arena = mmap.mmap(-1, total + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = np.frombuffer(arena, np.uint8)  # keeps the mapping alive as long as any view of it
    start = (-buffer.ctypes.data) % HUGE_PAGE_BYTES
    try:
        arena.madvise(mmap.MADV_HUGEPAGE, start, (total + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    except OSError as exc:  # refused (THP disabled): plain pages would only cost a copy
        logger.info("no huge pages for the small weights: %s", exc)
        del buffer
        arena.close()
        return value
    copies: dict[int, np.ndarray] = {}
    for key, array in small.items():
        begin = start + offsets[key]
        copy = buffer[begin:begin + array.nbytes].view(array.dtype).reshape(array.shape)
        copy[...] = array
        copies[key] = copy
    logger.info("%d small weight arrays (%.1f MB) gathered onto huge pages", len(copies), total / 1e6)
    return _rebuild(value, lambda array: copies.get(id(array), array))
