"""Fault injection for the I/O layer: a stand-in for `os.preadv` that fails or shortens reads, for tests and for
drills against a running server (set `IOEngine.preadv`).

- EIO: a read that touches [start, end) of the file raises OSError(EIO), `times` times (None: every read, always);
  the I/O engine retries (stream/io.py), so `times` below its attempts is invisible and `times` at or above them
  fails the read with an error naming the file and offset. With `times` set, the failures all land on the first
  read that touched the range (its offset), so that reads running at once on the reader threads cannot share them
  out (two reads each failing twice would both succeed on a third try, and the outcome would hang on thread order).
- Short reads: each call returns at most `max_bytes_per_call` bytes, as a loaded disk or a network file system
  may; the I/O engine must keep reading until the extent is whole.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass, field


@dataclass
class FaultyReads:
    eio_range: tuple[int, int] | None = None  # [start, end) file offsets whose reads fail
    times: int | None = None  # how many reads fail (None: every one)
    max_bytes_per_call: int | None = None  # short reads: at most this many bytes per call
    num_failed: int = 0  # reads failed so far
    num_short: int = 0  # calls cut short so far
    failing_offset: int | None = None  # with `times`: the offset of the read the failures land on
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __call__(self, fd: int, buffers: list, offset: int) -> int:
        total = sum(len(b) for b in buffers)
        if self.eio_range is not None and offset < self.eio_range[1] and offset + total > self.eio_range[0]:
            with self._lock:
                if self.times is None:
                    self.num_failed += 1
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                if self.num_failed < self.times and self.failing_offset in (None, offset):
                    self.failing_offset = offset
                    self.num_failed += 1
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
        if self.max_bytes_per_call is not None and total > self.max_bytes_per_call:
            with self._lock:
                self.num_short += 1
            limit, cut = self.max_bytes_per_call, []
            for buffer in buffers:  # the leading buffers up to the limit, the last one truncated
                if limit <= 0:
                    break
                cut.append(buffer[:limit])
                limit -= len(cut[-1])
            return os.preadv(fd, cut, offset)
        return os.preadv(fd, buffers, offset)
