"""Arrays in read-only pages that several processes map: how `k3serve serve` lends the model it holds to the lab's
worker process (lab/worker.py) instead of the worker loading a second copy.

The pages are an anonymous memory file (Linux `memfd_create`): written once, then sealed against any write, growth
or shrinking (`F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL`), and mapped read-only. Numpy views of the
mapping are not writable, and the seals stop every other way to write the bytes (a writable mapping, `write()` on
the descriptor or on `/proc/PID/fd/N`), in the process that made them as in any that maps them.

The file has no name in `/dev/shm` or anywhere else: it lives while a process holds its descriptor or a mapping of
it, and the kernel frees it when the last one goes, however the processes end (a crash or SIGKILL leaks nothing, and
there is nothing stale to clean up at the next start). It reaches a child process as its descriptor, passed when the
child is spawned (`multiprocessing` does that for a `SharedPages` among a `Process`'s arguments).

An object graph (frozen dataclasses, lists, tuples, dicts) moves into the pages with `to_refs`, which writes each
array and leaves an `ArrayRef` in its place: that skeleton pickles small. `from_refs` puts read-only views back.
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from k3serve.errors import K3Error

ALIGNMENT = 64  # every array starts on a cache line
SEALS = ("F_SEAL_WRITE", "F_SEAL_GROW", "F_SEAL_SHRINK", "F_SEAL_SEAL")


class SharedPagesError(K3Error):
    """Shared pages cannot be made or mapped here (no memfd, or a descriptor that is not sealed read-only)."""


def supported() -> bool:
    """Whether this system has sealable memory files (Linux >= 3.17 with Python's `os.memfd_create`)."""
    return hasattr(os, "memfd_create") and all(hasattr(fcntl, name) for name in SEALS + ("F_ADD_SEALS",))


def _all_seals() -> int:
    flags = 0
    for name in SEALS:
        flags |= getattr(fcntl, name)
    return flags


class ArrayRef(NamedTuple):
    """Where one array lies in the pages."""

    offset: int  # bytes from the start of the pages
    dtype: str  # numpy dtype string, e.g. '<f4'
    shape: tuple[int, ...]


class SharedPagesWriter:
    """Appends arrays to a fresh memory file; `seal()` ends writing and maps the pages read-only."""

    def __init__(self, name: str) -> None:
        if not supported():
            raise SharedPagesError("shared pages need Linux's memfd_create and file seals")
        self.name = name
        self._fd: int | None = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.nbytes = 0

    def add(self, array: np.ndarray) -> ArrayRef:
        """Write `array` (copied, C order) at the next aligned offset."""
        if self._fd is None:
            raise SharedPagesError("the pages are sealed: no array can be added")
        contiguous = array if array.flags.c_contiguous else np.array(array, order="C")  # 0-d stays 0-d
        offset = (self.nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        data = memoryview(contiguous.reshape(-1).view(np.uint8))
        written = 0
        while written < len(data):
            written += os.pwrite(self._fd, data[written:], offset + written)
        self.nbytes = offset + contiguous.nbytes
        return ArrayRef(offset, contiguous.dtype.str, tuple(int(n) for n in contiguous.shape))

    def seal(self) -> SharedPages:
        fd, self._fd = self._fd, None
        if fd is None:
            raise SharedPagesError("the pages are sealed already")
        try:
            os.ftruncate(fd, max(self.nbytes, 1))  # an empty mapping is not allowed
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _all_seals())
            return SharedPages(fd, self.nbytes)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Drop unsealed pages (a failed build)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SharedPages:
    """Sealed, read-only pages mapped into this process. Pickled into a spawned child as its descriptor; unpickled
    there, it maps the same pages (no copy)."""

    def __init__(self, fd: int, nbytes: int) -> None:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & _all_seals() != _all_seals():
            os.close(fd)
            raise SharedPagesError(f"descriptor {fd} is not sealed against writes (seals {seals:#x})")
        self._fd = fd
        self.nbytes = nbytes
        self._map = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)

    @property
    def inode(self) -> int:
        """The memory file's inode: equal in every process that maps these pages (and shown in /proc/PID/maps)."""
        return os.fstat(self._fd).st_ino

    def view(self, ref: ArrayRef) -> np.ndarray:
        """A read-only view of one array (`writeable` is False and cannot be set)."""
        count = int(np.prod(ref.shape, dtype=np.int64))
        return np.frombuffer(self._map, dtype=np.dtype(ref.dtype), count=count, offset=ref.offset).reshape(ref.shape)

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _attach, (DupFd(self._fd), self.nbytes)


def _attach(fd_wrapper, nbytes: int) -> SharedPages:
    return SharedPages(fd_wrapper.detach(), nbytes)


_SCALARS = (type(None), bool, int, float, str, np.generic)


def to_refs(value: Any, writer: SharedPagesWriter) -> Any:
    """`value` with each array written to `writer` and replaced by its `ArrayRef`. Frozen dataclasses, lists,
    tuples (named ones too) and dicts are rebuilt around the references; scalars stay; anything else is refused
    (its arrays would stay private without a word)."""
    if isinstance(value, np.ndarray):
        return writer.add(value)
    return _rebuild(value, lambda inner: to_refs(inner, writer))


def from_refs(value: Any, pages: SharedPages) -> Any:
    """The inverse of `to_refs`: each `ArrayRef` becomes a read-only view of `pages`."""
    if isinstance(value, ArrayRef):
        return pages.view(value)
    return _rebuild(value, lambda inner: from_refs(inner, pages))


def _rebuild(value: Any, convert) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: convert(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(convert(item) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(convert(item) for item in value)
    if isinstance(value, dict):
        return {key: convert(item) for key, item in value.items()}
    raise TypeError(f"cannot place a {type(value).__name__} in shared pages")


@dataclass(frozen=True)
class SharedArrays:
    """An object's arrays in sealed pages, and the object with `ArrayRef`s in their place: enough for any process
    that maps the pages to rebuild the object on read-only views (`materialize`). `about` is whatever describes
    them (pickled as it is, e.g. the model's config). Pickles to a few kilobytes."""

    pages: SharedPages
    skeleton: Any
    about: Any = None

    def materialize(self) -> Any:
        return from_refs(self.skeleton, self.pages)
