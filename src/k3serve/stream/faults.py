"""Fault injection for the I/O layer: a stand-in for `os.preadv` that fails or shortens reads, for tests and for
drills against a running server (set `IOEngine.preadv`).

- EIO: a read that touches [start, end) of the file raises OSError(EIO), `times` times (None: always); the I/O
  engine retries (stream/io.py), so `times` below its attempts is invisible and `times` at or above them fails
  the read with an error naming the file and offset.
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
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __call__(self, fd: int, buffers: list, offset: int) -> int:
        total = sum(len(b) for b in buffers)
        if self.eio_range is not None and offset < self.eio_range[1] and offset + total > self.eio_range[0]:
            with self._lock:
                if self.times is None or self.num_failed < self.times:
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
