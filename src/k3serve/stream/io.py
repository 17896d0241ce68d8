"""The I/O engine: reads of byte extents of one file into caller-owned buffers.

Modes:
- mmap:   the naive baseline. The file is memory-mapped and each extent is copied out on the calling thread
          (page faults, page-cache readahead, one extent at a time). The copied range is then dropped from this
          process's mapping (MADV_DONTNEED) so mapped file pages never pile up outside the budget.
- pread:  a thread pool of `queue_depth` workers issuing preadv through the page cache.
- direct: the same pool on an O_DIRECT descriptor (no page cache; buffers and offsets 4 KiB-aligned).

A batch of extents is sorted by offset and runs of adjacent extents (one ends where the next starts) are
coalesced into one preadv into the extents' own buffers, up to `max_coalesce_bytes`, so the number of system
calls falls when adjacent blobs are missed together. A short read or an OSError is retried (`max_attempts`);
after that the error names the file, offset and length. Checksums are verified on the worker right after the
read, in parallel; the caller decides what a mismatch means.

Striping (`k3serve pack --stripe DIR1,DIR2,...`): a store file is one virtual file laid over N drives in chunks of
C bytes, as RAID 0 lays it (`k3serve.weights.stripes`). A
`StripedIO` holds one `IOEngine` per drive, each with its own pool of `queue_depth` workers (a queue per device):
a batch is coalesced in the virtual file as above, then every run is cut at chunk edges and each piece is sent to
its drive's queue. The pieces of one run that land on one drive are adjacent in that drive's file, so the drive's
engine merges them back into one preadv: a read of L bytes costs one system call per drive of about L / N bytes,
and every read, however small the batch, keeps all N drives busy in equal shares (to within one chunk).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from k3serve.errors import CheckpointError

IO_MODES = ("mmap", "pread", "direct")
DEFAULT_MAX_COALESCE_BYTES = 8 << 20
MAX_IOVECS = 1024  # buffers per preadv (IOV_MAX on Linux)


class StoreIOError(CheckpointError):
    """A read failed or came back short after its retries."""


@dataclass
class Extent:
    offset: int
    buffer: memoryview  # writable, exactly the read length
    check_bytes: int = 0  # verify CRC-32 of buffer[:check_bytes] against `crc32` when > 0
    crc32: int = 0
    tag: object = None


@dataclass
class IOCounters:
    bytes_read: int = 0
    num_reads: int = 0  # system calls (or mmap copies) issued
    num_retries: int = 0
    busy_seconds: float = 0.0  # summed over workers
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def coalesce(extents: Sequence[Extent], max_coalesce_bytes: int) -> list[list[Extent]]:
    """Extents in offset order, adjacent ones (one ends where the next starts) merged into runs of at most
    `max_coalesce_bytes`: one system call per run. The simulator schedules the same runs."""
    runs: list[list[Extent]] = []
    for extent in sorted(extents, key=lambda e: e.offset):
        if runs:
            last = runs[-1][-1]
            run_bytes = last.offset + len(last.buffer) - runs[-1][0].offset
            if last.offset + len(last.buffer) == extent.offset and \
                    run_bytes + len(extent.buffer) <= max_coalesce_bytes:
                runs[-1].append(extent)
                continue
        runs.append([extent])
    return runs


class IOEngine:
    def __init__(self, path: str | Path, mode: str = "pread", queue_depth: int = 8,
                 max_coalesce_bytes: int = DEFAULT_MAX_COALESCE_BYTES, max_attempts: int = 3,
                 name: str | None = None) -> None:
        """`name`: the workers' thread name prefix after k3io- (default: the file's stem)."""
        if mode not in IO_MODES:
            raise ValueError(f"unknown I/O mode {mode!r}; choose one of {', '.join(IO_MODES)}")
        if queue_depth < 1:
            raise ValueError("queue depth must be at least 1")
        self.path = Path(path)
        self.mode = mode
        self.queue_depth = queue_depth
        self.max_coalesce_bytes = max_coalesce_bytes
        self.max_attempts = max_attempts
        self.counters = IOCounters()
        # test hook: called as fault(offset, buffer) after every successful read (to corrupt or to raise)
        self.fault: Callable[[int, memoryview], None] | None = None
        # the read system call, replaceable by a fault injector (stream/faults.py): preadv(fd, buffers, offset)
        self.preadv: Callable[[int, list, int], int] = os.preadv
        self._size = os.path.getsize(self.path)
        self._mmap: mmap.mmap | None = None
        self._pool: ThreadPoolExecutor | None = None
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        if mode == "direct":
            if not hasattr(os, "O_DIRECT"):
                raise StoreIOError("O_DIRECT is not available on this platform; use --io pread")
            flags |= os.O_DIRECT
        try:
            self._fd = os.open(self.path, flags)
        except OSError as exc:
            raise StoreIOError(f"{self.path}: cannot open for {mode} reads: {exc}") from exc
        if mode == "mmap":
            self._mmap = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ) if self._size else None
        else:
            self._pool = ThreadPoolExecutor(max_workers=queue_depth,
                                            thread_name_prefix=f"k3io-{name or self.path.stem}")

    # ---- submission --------------------------------------------------------------------------------------------
    def submit(self, extents: Sequence[Extent]) -> dict[int, Future]:
        """Start reading every extent; returns {id(extent): future}. A future's result is the list of extents of
        its run whose checksum failed (empty when all passed); read errors raise from the future."""
        runs = coalesce(extents, self.max_coalesce_bytes) if self.mode != "mmap" else \
            [[e] for e in sorted(extents, key=lambda e: e.offset)]
        futures: dict[int, Future] = {}
        for run in runs:
            if self._pool is None:
                future: Future = Future()
                try:
                    future.set_result(self._read_run(run))
                except BaseException as exc:  # noqa: BLE001 - delivered through the future like the pool does
                    future.set_exception(exc)
            else:
                future = self._pool.submit(self._read_run, run)
            for extent in run:
                futures[id(extent)] = future
        return futures

    def read_now(self, extent: Extent) -> list[Extent]:
        """Read one extent on the calling thread (the re-read after a checksum failure)."""
        return self._read_run([extent])

    def submit_scatter(self, offset: int, buffers: list[memoryview]) -> Future:
        """Read the bytes at `offset` into `buffers`, in order, as one read (a striped file's share of a run on this
        drive: `StripedIO`); no checksum here, the caller verifies whole extents. The future's result is []."""
        if self._pool is None:
            future: Future = Future()
            try:
                future.set_result(self._read_scatter(offset, buffers))
            except BaseException as exc:  # noqa: BLE001 - delivered through the future like the pool does
                future.set_exception(exc)
            return future
        return self._pool.submit(self._read_scatter, offset, buffers)

    # ---- the read itself ---------------------------------------------------------------------------------------
    def _read_run(self, run: list[Extent]) -> list[Extent]:
        started = time.perf_counter()
        total = sum(len(e.buffer) for e in run)
        calls = self._read_with_retries(run[0].offset, [e.buffer for e in run], total, run)
        failed = [e for e in run if e.check_bytes and zlib.crc32(e.buffer[:e.check_bytes]) != e.crc32]
        self._count(total, calls, started)
        return failed

    def _read_scatter(self, offset: int, buffers: list[memoryview]) -> list[Extent]:
        started = time.perf_counter()
        total = sum(len(b) for b in buffers)
        self._count(total, self._read_with_retries(offset, buffers, total, ()), started)
        return []

    def _read_with_retries(self, offset: int, buffers: list[memoryview], total: int, run: Sequence[Extent]) -> int:
        """The system calls it took; `run`: the extents the `fault` hook sees after each read."""
        attempts = 0
        while True:
            try:
                calls = self._read_into(offset, buffers, total)
                if self.fault is not None:
                    for extent in run:
                        self.fault(extent.offset, extent.buffer)
                return calls
            except (OSError, StoreIOError) as exc:
                attempts += 1
                with self.counters.lock:
                    self.counters.num_retries += 1
                if attempts >= self.max_attempts:
                    raise StoreIOError(f"{self.path}: read of {total} bytes at offset {offset} failed after "
                                       f"{attempts} attempts: {exc}") from exc

    def _count(self, nbytes: int, calls: int, started: float) -> None:
        with self.counters.lock:
            self.counters.bytes_read += nbytes
            self.counters.num_reads += calls
            self.counters.busy_seconds += time.perf_counter() - started

    def _read_into(self, offset: int, buffers: list[memoryview], total: int) -> int:
        if offset + total > self._size and self.mode != "direct":
            raise StoreIOError(f"short read: {self._size - offset} of {total} bytes left at offset {offset} "
                               "(file truncated?)")
        if self._mmap is not None:
            position = offset
            for buffer in buffers:
                n = len(buffer)
                buffer[:] = self._mmap[position:position + n]
                position += n
            self._drop_mapping(offset, total)
            return len(buffers)
        calls, done = 0, 0
        pending = list(buffers)
        while pending:
            n = self.preadv(self._fd, pending, offset + done)
            calls += 1
            if n <= 0:
                raise StoreIOError(f"short read: got {done} of {total} bytes at offset {offset} (end of file)")
            done += n
            while pending and n >= len(pending[0]):
                n -= len(pending[0])
                pending.pop(0)
            if pending and n:
                pending[0] = pending[0][n:]
        return calls

    def _drop_mapping(self, offset: int, length: int) -> None:
        page = mmap.PAGESIZE
        start = offset // page * page
        end = min(self._size, (offset + length + page - 1) // page * page)
        if self._mmap is not None and hasattr(self._mmap, "madvise") and end > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    # ---- page cache control (benchmarks) -----------------------------------------------------------------------
    def drop_page_cache(self) -> None:
        """Ask the kernel to drop this file's clean cached pages (posix_fadvise DONTNEED)."""
        if hasattr(os, "posix_fadvise"):
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# ---- striping: one virtual file over several drives (the layout: k3serve.weights.stripes) --------------------------
class StripedIO:
    """The `IOEngine` interface over a file striped across drives: one engine, so one queue, per drive."""

    def __init__(self, paths: Sequence[str | Path], chunk_bytes: int, mode: str = "pread", queue_depth: int = 8,
                 max_coalesce_bytes: int = DEFAULT_MAX_COALESCE_BYTES, max_attempts: int = 3) -> None:
        if len(paths) < 2:
            raise ValueError("a striped file needs at least two drives")
        if chunk_bytes < 1:
            raise ValueError("the stripe chunk must be at least one byte")
        self.paths = [Path(p) for p in paths]
        self.path = self.paths[0].parent
        self.chunk_bytes = chunk_bytes
        self.mode = mode
        self.queue_depth = queue_depth
        self.max_coalesce_bytes = max_coalesce_bytes
        self.drives: list[IOEngine] = []
        try:
            for k, path in enumerate(self.paths):
                self.drives.append(IOEngine(path, mode, queue_depth, max_coalesce_bytes, max_attempts,
                                            name=f"{path.stem}-drive{k}"))
        except BaseException:
            self.close()
            raise

    @property
    def num_drives(self) -> int:
        return len(self.drives)

    @property
    def counters(self) -> IOCounters:
        """Summed over the drives (a fresh record: read it, don't write it)."""
        total = IOCounters()
        for engine in self.drives:
            c = engine.counters
            total.bytes_read += c.bytes_read
            total.num_reads += c.num_reads
            total.num_retries += c.num_retries
            total.busy_seconds += c.busy_seconds
        return total

    def drive_counters(self) -> list[IOCounters]:
        return [engine.counters for engine in self.drives]

    def submit(self, extents: Sequence[Extent]) -> dict[int, Future]:
        """As `IOEngine.submit`: {id(extent): future of its run's failed checksums}."""
        runs = coalesce(extents, self.max_coalesce_bytes) if self.mode != "mmap" else \
            [[e] for e in sorted(extents, key=lambda e: e.offset)]
        futures: dict[int, Future] = {}
        for run in runs:
            reads = []
            for engine, (start, buffers) in zip(self.drives, self._split(run)):
                for offset, group in self._groups(start, buffers):
                    reads.append(engine.submit_scatter(offset, group))
            future = _RunFuture(run, reads)
            for extent in run:
                futures[id(extent)] = future
        return futures

    def _split(self, run: list[Extent]) -> list[tuple[int, list[memoryview]]]:
        """Each drive's share of a run: its first offset in the drive's file and the run's buffer slices that land
        there, in order (they are adjacent in the drive's file: `k3serve.weights.stripes`)."""
        chunk_bytes, n = self.chunk_bytes, self.num_drives
        starts, parts = [-1] * n, [[] for _ in range(n)]
        position = run[0].offset
        for extent in run:
            buffer, length, done = extent.buffer, len(extent.buffer), 0
            while done < length:
                chunk, within = divmod(position, chunk_bytes)
                take = min(chunk_bytes - within, length - done)
                drive = chunk % n
                if starts[drive] < 0:
                    starts[drive] = chunk // n * chunk_bytes + within
                parts[drive].append(buffer[done:done + take])
                done += take
                position += take
        return list(zip(starts, parts))

    def _groups(self, start: int, buffers: list[memoryview]) -> list[tuple[int, list[memoryview]]]:
        """A drive's share as reads of at most `max_coalesce_bytes` and `MAX_IOVECS` buffers each."""
        groups, offset, group, size = [], start, [], 0
        for buffer in buffers:
            if group and (size + len(buffer) > self.max_coalesce_bytes or len(group) == MAX_IOVECS):
                groups.append((offset, group))
                offset, group, size = offset + size, [], 0
            group.append(buffer)
            size += len(buffer)
        if group:
            groups.append((offset, group))
        return groups

    def read_now(self, extent: Extent) -> list[Extent]:
        return self.submit([extent])[id(extent)].result()

    def drop_page_cache(self) -> None:
        for engine in self.drives:
            engine.drop_page_cache()

    def close(self) -> None:
        for engine in self.drives:
            engine.close()


class _RunFuture(Future):
    """One virtual run read as pieces on several drives: done when every piece is; its result is the run's extents
    whose checksum failed, verified on the thread that finished the last piece."""

    def __init__(self, run: list[Extent], pieces: list[Future]) -> None:
        super().__init__()
        self._run = run
        self._waiting = {id(f): f for f in pieces}  # a drive's coalesced read serves several pieces
        self._all = list(self._waiting.values())
        self._lock = threading.Lock()
        for future in self._all:
            future.add_done_callback(self._piece_done)

    def _piece_done(self, future: Future) -> None:
        with self._lock:
            if self._waiting.pop(id(future), None) is None or self._waiting:
                return
        errors = [f.exception() for f in self._all if f.exception() is not None]
        if errors:
            self.set_exception(errors[0])
            return
        self.set_result([e for e in self._run if e.check_bytes and zlib.crc32(e.buffer[:e.check_bytes]) != e.crc32])


def open_reader(paths: Sequence[str | Path], chunk_bytes: int, mode: str = "pread",
                queue_depth: int = 8) -> IOEngine | StripedIO:
    """The reader of one store file: an `IOEngine` on a plain file (one path), a `StripedIO` on a striped one."""
    if len(paths) == 1:
        return IOEngine(paths[0], mode, queue_depth)
    return StripedIO(paths, chunk_bytes, mode, queue_depth)
