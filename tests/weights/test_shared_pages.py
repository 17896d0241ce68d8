"""Sealed shared pages (weights/shared_pages.py): arrays come back equal and read-only; the seals refuse every way
to write them, in the process that made them and in a spawned one that maps the same pages; they have no name to
leak; an object graph goes in and out through `to_refs` / `from_refs`."""

from __future__ import annotations

import dataclasses
import mmap
import multiprocessing
import os
from typing import NamedTuple

import numpy as np
import pytest

from k3serve.weights.shared_pages import (ArrayRef, SharedArrays, SharedPagesError, SharedPagesWriter, from_refs,
                                          supported, to_refs)

pytestmark = pytest.mark.skipif(not supported(), reason="shared pages need Linux's memfd_create")


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((3, 5)).astype(np.float32), np.arange(7, dtype=np.uint8),
            rng.integers(0, 2**16, (2, 3, 4)).astype(np.uint16), np.zeros((0, 4), np.float32),
            np.array(2.5, np.float64), np.asfortranarray(rng.standard_normal((4, 3)))]


def _sealed(arrays: list[np.ndarray]):
    writer = SharedPagesWriter("k3serve-test")
    refs = [writer.add(a) for a in arrays]
    return writer.seal(), refs


def test_arrays_come_back_equal_aligned_and_read_only():
    arrays = _arrays()
    pages, refs = _sealed(arrays)
    for array, ref in zip(arrays, refs):
        view = pages.view(ref)
        assert view.dtype == array.dtype and view.shape == array.shape and np.array_equal(view, array)
        assert ref.offset % 64 == 0
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view.setflags(write=True)
        if view.size:
            with pytest.raises(ValueError, match="read-only"):
                view[...] = 0
    assert pages.nbytes == refs[-1].offset + arrays[-1].nbytes


def test_the_seals_refuse_every_write_and_the_pages_have_no_name():
    pages, refs = _sealed(_arrays())
    fd = pages._fd
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", 0)
    with pytest.raises(PermissionError):
        mmap.mmap(fd, pages.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(PermissionError):  # reopening the file for writing does not get round the seals
        with open(f"/proc/self/fd/{fd}", "r+b") as reopened:
            reopened.write(b"x")
            reopened.flush()
    with pytest.raises(PermissionError):
        os.ftruncate(fd, pages.nbytes + 4096)
    assert pages.view(refs[1])[0] == 0  # unchanged
    link = os.readlink(f"/proc/self/fd/{fd}")
    assert link.startswith("/memfd:k3serve-test") and link.endswith("(deleted)")  # no file in /dev/shm to leak
    if os.path.isdir("/dev/shm"):
        assert not [name for name in os.listdir("/dev/shm") if "k3serve-test" in name]


def test_a_sealed_writer_takes_no_more_arrays():
    writer = SharedPagesWriter("k3serve-test")
    writer.add(np.ones(3, np.float32))
    writer.seal()
    with pytest.raises(SharedPagesError, match="sealed"):
        writer.add(np.ones(3, np.float32))


def _child_reads(conn, shared: SharedArrays) -> None:
    """In a spawned process: the pages' inode, the arrays' sum, and whether a write through a view and one through
    the descriptor were refused."""
    arrays = shared.materialize()
    view_refused = file_refused = False
    try:
        arrays["a"][0] = 1.0
    except ValueError:
        view_refused = True
    try:
        os.pwrite(shared.pages._fd, b"x", 0)
    except PermissionError:
        file_refused = True
    conn.send((shared.pages.inode, float(sum(a.sum() for a in arrays.values())), view_refused, file_refused))


def test_a_spawned_process_maps_the_same_pages_and_cannot_write_them():
    writer = SharedPagesWriter("k3serve-test")
    skeleton = to_refs({"a": np.arange(6, dtype=np.float32), "b": np.full((2, 2), 3, np.int64)}, writer)
    shared = SharedArrays(writer.seal(), skeleton)
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_child_reads, args=(child, shared))
    process.start()
    try:
        assert parent.poll(60)
        inode, total, view_refused, file_refused = parent.recv()
    finally:
        process.join(10)
    assert inode == shared.pages.inode
    assert total == 15.0 + 12.0
    assert view_refused and file_refused


@dataclasses.dataclass(frozen=True)
class _Part:
    weight: np.ndarray
    bias: np.ndarray | None
    gated: bool


class _Pair(NamedTuple):
    left: np.ndarray
    right: np.ndarray


def test_an_object_graph_goes_in_and_out_with_references_in_its_place():
    rng = np.random.default_rng(1)
    value = {"parts": [_Part(rng.standard_normal((2, 3)), None, True), _Part(np.ones(4), np.zeros(4), False)],
             "pair": _Pair(np.arange(3), np.arange(4)), "stack": (np.ones((2, 2), np.uint8),), "name": "x", "n": 3}
    writer = SharedPagesWriter("k3serve-test")
    skeleton = to_refs(value, writer)
    assert isinstance(skeleton["parts"][0].weight, ArrayRef) and skeleton["parts"][0].bias is None
    assert isinstance(skeleton["pair"], _Pair) and isinstance(skeleton["pair"].left, ArrayRef)
    back = from_refs(skeleton, writer.seal())
    assert back["name"] == "x" and back["n"] == 3 and back["parts"][0].gated is True
    assert np.array_equal(back["parts"][0].weight, value["parts"][0].weight)
    assert np.array_equal(back["parts"][1].bias, np.zeros(4)) and np.array_equal(back["pair"].right, np.arange(4))
    assert not back["stack"][0].flags.writeable


def test_an_object_it_cannot_rebuild_is_refused():
    class Holder:
        def __init__(self) -> None:
            self.array = np.ones(3)

    writer = SharedPagesWriter("k3serve-test")
    with pytest.raises(TypeError, match="Holder"):
        to_refs([Holder()], writer)
    writer.close()
