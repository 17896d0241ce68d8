"""weights/huge_pages.py: small arrays gathered into one huge-page buffer, the same values, the rest untouched."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from k3serve.weights import huge_pages
from k3serve.weights.huge_pages import gather_small_arrays


@dataclasses.dataclass(frozen=True)
class _Part:
    small: np.ndarray
    big: np.ndarray
    strided: np.ndarray
    label: str


def _parts():
    rng = np.random.default_rng(0)
    shared = rng.standard_normal((40, 7)).astype(np.float32)
    return [_Part(small=rng.integers(0, 1 << 16, (33, 5)).astype(np.uint16), big=np.ones(300, np.float32),
                  strided=shared[:, ::2], label=f"layer {i}") for i in range(3)]


@pytest.mark.skipif(not huge_pages.supported(), reason="no MADV_HUGEPAGE on this system")
def test_small_arrays_move_into_one_buffer_with_the_same_values():
    parts = _parts()
    gathered = gather_small_arrays(parts, max_bytes=1024)  # small: 330 B each; big: 1200 B
    assert [p.label for p in gathered] == [p.label for p in parts]
    for before, after in zip(parts, gathered):
        np.testing.assert_array_equal(after.small, before.small)
        assert after.small.dtype == before.small.dtype and after.small.flags.c_contiguous
        assert not np.shares_memory(after.small, before.small)
        assert after.small.ctypes.data % huge_pages.ALIGNMENT == 0
        assert after.big is before.big  # at or over max_bytes: kept
        assert after.strided is before.strided  # not C-contiguous: kept (a copy would change BLAS's layout)
    base = gathered[0].small.base
    while isinstance(base, np.ndarray) and base.base is not None and isinstance(base.base, np.ndarray):
        base = base.base
    assert all(np.shares_memory(p.small, base) for p in gathered)  # one buffer
    gathered[1].small[0, 0] += 1  # writable, and private to this copy
    assert gathered[1].small[0, 0] != parts[1].small[0, 0]


def test_nothing_small_or_no_support_leaves_the_value_as_it_is(monkeypatch):
    parts = _parts()
    assert gather_small_arrays(parts, max_bytes=1) is parts
    monkeypatch.setattr(huge_pages, "supported", lambda: False)
    assert gather_small_arrays(parts) is parts


def test_the_same_array_twice_is_copied_once():
    if not huge_pages.supported():
        pytest.skip("no MADV_HUGEPAGE on this system")
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    first, second = gather_small_arrays((array, {"again": array}))
    assert second["again"] is first
    np.testing.assert_array_equal(first, array)
