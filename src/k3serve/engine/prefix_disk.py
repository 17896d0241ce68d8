"""The prefix cache's disk tier: state checkpoints that leave RAM, written whole to a folder on NVMe, and restored
by a later hit instead of being recomputed (`serve --prefix-cache-dir DIR --prefix-cache-disk 64G`).

An entry is one checkpoint made self-contained: everything a sequence needs to resume at `position` p,
    rows [LA, p, W]     every attention layer's cached rows for positions [0, p) (the MLA latent blocks under the
                        checkpoint and the tail rows it keeps)
    S, conv tail        every recurrent layer's state at p (KDA: S [NH, Dk, Dv] and the conv tail [K-1, C])
    logits [V]          optional: the next-token logits at p (a prompt's end: an exact repeat hits whole)
keyed as in RAM by (h_{p//BS - 1}, the tokens after that block), so tenants and cache salts never share an entry
(the chain hash starts from H("root", tenant, salt); the root is in the header too and is checked on a hit).

File format (one file per entry, `<key>.k3pc`, every length a multiple of 4 KiB so O_DIRECT can move it):
    header      magic "K3PC", format version, model identity (16 bytes), root (16), parent (16), position,
                tail length, flags, number of logits, payload length, payload blake2b-128, the tail tokens (int64),
                then a CRC-32 of all of that; zero-padded to a 4 KiB boundary
    payload     rows, then per recurrent layer S and conv tail, then the logits (float32, C order); zero-padded
An entry is written to `<key>.k3pc.tmp.<pid>`, fsynced, renamed over its final name and the folder fsynced, so a
process killed mid-write leaves a temporary file (removed by the next start once its writer is gone), never a
half-written entry under a final name. A start scans the headers: an entry of another model or cache layout
(another identity) or another format version is left alone and ignored; a header that does not parse or a file
shorter than its header says is removed. The payload's digest is checked on every hit: a corrupt entry is a miss
(and is removed), never a wrong answer.

Replacement is the RAM cache's segmented LRU, over bytes: an entry arrives in the segment its checkpoint held in RAM
(protected stays protected), a hit protects it on a fork or its second hit, protected keeps at most
PROTECTED_FRACTION of the capacity (0 under lru), and the victim is probation's least recent entry.

O_DIRECT needs aligned buffers: they are anonymous mmaps (page aligned). A file system that refuses O_DIRECT (tmpfs)
is used through the page cache instead, with one log line saying so.

Shapes: LA attention layers, p positions, W row width, V vocabulary.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3serve.engine.errors import IntegrityError
from k3serve.engine.metrics import MetricsRegistry
from k3serve.errors import ConfigError
from k3serve.model.cache import CacheLayout

logger = logging.getLogger(__name__)

MAGIC = b"K3PC"
FORMAT_VERSION = 1
ALIGNMENT = 4096
SUFFIX = ".k3pc"
TEMP_MARK = ".tmp."
PROTECTED_FRACTION = 0.8  # as the RAM tier (engine/prefix_cache.py)
# magic, version, identity, root, parent, position, tail length, flags, logits, payload length, payload digest
_FIXED = struct.Struct("<4sI16s16s16sIIIIQ16s")
_CRC = struct.Struct("<I")
FLAG_LOGITS = 1


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def entry_key(parent: bytes, tail: tuple[int, ...]) -> str:
    """The file name stem of the checkpoint keyed (parent, tail)."""
    return hashlib.blake2b(parent + np.asarray(tail, dtype=np.int64).tobytes(), digest_size=16).hexdigest()


def layout_identity(model_identity: str, layout: CacheLayout) -> bytes:
    """The 16 bytes every entry's header carries: the model (its store or checkpoint checksum) and the cache layout
    its payload follows. Another model, store or layout ignores the folder's entries."""
    shapes = [(layer, width) for layer, width in sorted(layout.row_widths.items())]
    states = [(layer, tuple(s), tuple(t)) for layer, (s, t) in sorted(layout.recurrent_shapes.items())]
    text = f"{model_identity}\x00{shapes}\x00{states}".encode()
    return hashlib.blake2b(text, digest_size=16).digest()


@dataclass
class CheckpointPayload:
    """A checkpoint's arrays as the RAM tier holds them (see the module docstring)."""

    rows: np.ndarray  # [LA, p, W]
    states: list[np.ndarray]  # per recurrent layer [*S]
    conv_tails: list[np.ndarray]  # per recurrent layer [K-1, C]
    logits: np.ndarray | None  # [V]


@dataclass
class DiskEntry:
    """What the index keeps of one file (its header)."""

    key: str
    root: bytes
    parent: bytes
    tail: tuple[int, ...]
    position: int
    has_logits: bool
    nbytes: int  # the file's size
    num_hits: int = 0


@dataclass
class _Header:
    identity: bytes
    root: bytes
    parent: bytes
    position: int
    tail: tuple[int, ...]
    flags: int
    num_logits: int
    payload_length: int
    digest: bytes

    @property
    def length(self) -> int:
        return _align(_FIXED.size + 8 * len(self.tail) + _CRC.size)

    def pack(self) -> bytes:
        fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, self.identity, self.root, self.parent, self.position,
                            len(self.tail), self.flags, self.num_logits, self.payload_length, self.digest)
        body = fixed + np.asarray(self.tail, dtype=np.int64).tobytes()
        return body + _CRC.pack(zlib.crc32(body))


class CorruptEntry(Exception):
    """An entry that fails its checks (removed by the tier, never raised to a caller)."""


def _parse_header(data: bytes | memoryview) -> _Header:
    """The header at the start of `data`; `CorruptEntry` if it does not parse, `ValueError` for another version."""
    if len(data) < _FIXED.size:
        raise CorruptEntry("shorter than a header")
    magic, version, identity, root, parent, position, tail_len, flags, num_logits, payload_length, digest = \
        _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptEntry("bad magic")
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version}")
    end = _FIXED.size + 8 * tail_len
    if len(data) < end + _CRC.size:
        raise CorruptEntry("header cut short")
    (crc,) = _CRC.unpack_from(data, end)
    if zlib.crc32(bytes(data[:end])) != crc:
        raise CorruptEntry("header checksum mismatch")
    tail = tuple(np.frombuffer(bytes(data[_FIXED.size:end]), dtype=np.int64).tolist())
    return _Header(identity, root, parent, position, tail, flags, num_logits, payload_length, digest)


class DiskSegments:
    """The segmented LRU of `prefix_cache.SegmentedLRU`, over entry bytes: `probation` and `protected`, each least
    recent first; protected holds at most `protected_capacity` bytes."""

    def __init__(self, protected_capacity: int) -> None:
        self.protected_capacity = protected_capacity
        self.probation: OrderedDict[str, DiskEntry] = OrderedDict()
        self.protected: OrderedDict[str, DiskEntry] = OrderedDict()
        self.protected_bytes = 0

    def get(self, key: str) -> DiskEntry | None:
        return self.probation.get(key) or self.protected.get(key)

    def values(self) -> list[DiskEntry]:
        return [*self.probation.values(), *self.protected.values()]

    def add(self, entry: DiskEntry, protected: bool) -> None:
        self.probation[entry.key] = entry
        if protected:
            self._protect(entry)

    def hit(self, key: str, fork: bool) -> None:
        entry = self.get(key)
        entry.num_hits += 1
        if entry.num_hits < 2 and not fork:
            self.touch(key)
            return
        self._protect(entry)

    def touch(self, key: str) -> None:
        (self.probation if key in self.probation else self.protected).move_to_end(key)

    def _protect(self, entry: DiskEntry) -> None:
        if self.probation.pop(entry.key, None) is not None:
            self.protected_bytes += entry.nbytes
        else:
            self.protected.pop(entry.key)
        self.protected[entry.key] = entry
        while self.protected_bytes > self.protected_capacity:
            _, demoted = self.protected.popitem(last=False)
            self.protected_bytes -= demoted.nbytes
            self.probation[demoted.key] = demoted

    def remove(self, key: str) -> DiskEntry:
        entry = self.probation.pop(key, None)
        if entry is None:
            entry = self.protected.pop(key)
            self.protected_bytes -= entry.nbytes
        return entry

    def victim(self) -> DiskEntry | None:
        for segment in (self.probation, self.protected):
            if segment:
                return next(iter(segment.values()))
        return None


class PrefixDiskTier:
    """The folder of spilled checkpoints, its index (parent hash -> tail -> entry) and its byte budget."""

    def __init__(self, folder: str | Path, capacity_bytes: int, layout: CacheLayout, model_identity: str,
                 policy: str, metrics: MetricsRegistry) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"the prefix cache's disk tier needs a positive size, got {capacity_bytes}")
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--prefix-cache-dir {self.folder}: cannot create it: {exc.strerror}") from exc
        if not os.access(self.folder, os.W_OK | os.X_OK):
            raise ConfigError(f"--prefix-cache-dir {self.folder}: not writable")
        self.capacity_bytes = capacity_bytes
        self.layout = layout
        self.identity = layout_identity(model_identity, layout)
        self.num_attention_layers = len(layout.attention_layers)
        self.row_width = layout.row_width  # 0 without attention layers
        self._state_shapes = [layout.recurrent_shapes[layer] for layer in layout.recurrent_layers]
        self.direct = hasattr(os, "O_DIRECT")  # cleared (with a note) where the file system refuses it
        self.used_bytes = 0
        self._segments = DiskSegments(int(PROTECTED_FRACTION * capacity_bytes) if policy == "slru" else 0)
        self._index: dict[bytes, dict[tuple[int, ...], DiskEntry]] = {}
        self._m_writes = metrics.counter("prefix_cache_disk_writes", "checkpoints written to the disk tier")
        self._m_write_bytes = metrics.counter("prefix_cache_disk_write_bytes", "bytes written to the disk tier")
        self._m_write_failures = metrics.counter(
            "prefix_cache_disk_write_failures", "checkpoints the disk tier failed to write (a full or failing disk)")
        self._m_reads = metrics.counter("prefix_cache_disk_reads", "entries read back for a hit")
        self._m_read_bytes = metrics.counter("prefix_cache_disk_read_bytes", "bytes read back for hits")
        self._m_corrupt = metrics.counter(
            "prefix_cache_disk_corrupt", "entries found corrupt or truncated (removed; the hit became a miss)")
        self._m_evicted = metrics.counter("prefix_cache_disk_evictions", "entries evicted for space")
        self._m_entries = metrics.gauge("prefix_cache_disk_entries", "checkpoints in the disk tier")
        self._m_bytes = metrics.gauge("prefix_cache_disk_bytes", "bytes of the disk tier's entries")
        self._m_ignored = metrics.gauge(
            "prefix_cache_disk_foreign_entries", "entries of another model, layout or format left alone at start")
        self._scan()

    # ---- start ----------------------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index the folder's valid entries (oldest first, in probation), remove temporary files of dead writers and
        entries that fail their header or length checks."""
        found: list[tuple[float, DiskEntry]] = []
        foreign = 0
        for path in self.folder.iterdir():
            name = path.name
            if TEMP_MARK in name and name.split(TEMP_MARK)[0].endswith(SUFFIX):
                if not _writer_alive(name.rsplit(".", 1)[-1]):
                    _remove(path)
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                with open(path, "rb") as f:
                    head = f.read(ALIGNMENT)
                    if len(head) >= _FIXED.size:  # a long tail (a large block size) runs past the first page
                        tail_len = _FIXED.unpack_from(head, 0)[6]
                        head += f.read(max(0, _FIXED.size + 8 * tail_len + _CRC.size - len(head)))
                    size = os.fstat(f.fileno()).st_size
                    mtime = os.fstat(f.fileno()).st_mtime
                header = _parse_header(head)
            except ValueError:  # another format version: not ours to judge
                foreign += 1
                continue
            except (CorruptEntry, OSError) as exc:
                logger.warning("prefix cache disk tier: removing %s (%s)", path, exc)
                self._m_corrupt.inc()
                _remove(path)
                continue
            if header.identity != self.identity:
                foreign += 1
                continue
            if size < header.length + header.payload_length or path.stem != entry_key(header.parent, header.tail):
                logger.warning("prefix cache disk tier: removing %s (truncated or misnamed)", path)
                self._m_corrupt.inc()
                _remove(path)
                continue
            found.append((mtime, DiskEntry(path.stem, header.root, header.parent, header.tail, header.position,
                                           bool(header.flags & FLAG_LOGITS), size)))
        for _, entry in sorted(found, key=lambda item: item[0]):
            self._insert(entry, protected=False)
        while self.used_bytes > self.capacity_bytes:  # a smaller --prefix-cache-disk than last time
            self._evict(self._segments.victim())
        self._m_ignored.set(foreign)
        if found or foreign:
            logger.info("prefix cache disk tier %s: %d entries (%d bytes) indexed, %d of another model ignored",
                        self.folder, len(found), self.used_bytes, foreign)
        self._update_gauges()

    # ---- lookup ---------------------------------------------------------------------------------------------
    def group(self, parent: bytes) -> dict[tuple[int, ...], DiskEntry]:
        """The entries keyed under `parent` (tail -> entry)."""
        return self._index.get(parent, {})

    def contains(self, parent: bytes, tail: tuple[int, ...]) -> bool:
        return tail in self._index.get(parent, {})

    @property
    def num_entries(self) -> int:
        return sum(len(group) for group in self._index.values())

    def hit(self, entry: DiskEntry, fork: bool) -> None:
        if self._segments.get(entry.key) is entry:
            self._segments.hit(entry.key, fork)

    def touch(self, parent: bytes, tail: tuple[int, ...]) -> None:
        entry = self._index.get(parent, {}).get(tail)
        if entry is not None:
            self._segments.touch(entry.key)

    # ---- write ----------------------------------------------------------------------------------------------
    def payload_length(self, position: int, num_logits: int) -> int:
        rows = self.num_attention_layers * position * self.row_width
        states = sum(int(np.prod(s)) + int(np.prod(t)) for s, t in self._state_shapes)
        return 4 * (rows + states + num_logits)

    def write(self, root: bytes, parent: bytes, tail: tuple[int, ...], position: int, payload: CheckpointPayload,
              protected: bool) -> bool:
        """Write one checkpoint (atomically); False when it was already there, does not fit, or the write failed
        (counted and logged: a disk tier that cannot write costs hits, never a request)."""
        if self.contains(parent, tail):
            self.touch(parent, tail)
            return False
        num_logits = 0 if payload.logits is None else int(payload.logits.size)
        header = _Header(self.identity, root, parent, position, tail, FLAG_LOGITS if num_logits else 0, num_logits,
                         self.payload_length(position, num_logits), b"\0" * 16)
        total = header.length + _align(header.payload_length)
        if total > self.capacity_bytes:
            return False
        buffer = mmap.mmap(-1, total)  # page aligned, zero filled: O_DIRECT can write it as is
        body = np.frombuffer(buffer, dtype=np.float32, count=header.payload_length // 4, offset=header.length)
        offset = 0
        per_layer = [array for pair in zip(payload.states, payload.conv_tails) for array in pair]  # S, tail, S, ...
        for array in [payload.rows, *per_layer] + ([payload.logits] if num_logits else []):
            flat = np.asarray(array, dtype=np.float32).ravel()
            body[offset:offset + flat.size] = flat
            offset += flat.size
        if offset * 4 != header.payload_length:
            raise IntegrityError(f"a checkpoint payload of {offset * 4} bytes, expected {header.payload_length}")
        view = memoryview(buffer)
        header.digest = hashlib.blake2b(view[header.length:header.length + header.payload_length],
                                        digest_size=16).digest()
        packed = header.pack()
        buffer[:len(packed)] = packed
        key = entry_key(parent, tail)
        try:
            self._write_file(key, view)
        except OSError as exc:
            self._m_write_failures.inc()
            logger.warning("prefix cache disk tier: cannot write %s: %s (the checkpoint is dropped)",
                           self.folder / (key + SUFFIX), exc)
            return False
        finally:
            del body
            try:
                view.release()
                buffer.close()
            except BufferError:  # a failed write's traceback still holds a slice: the buffer is freed with it
                pass
        while self.used_bytes + total > self.capacity_bytes:  # room is made once the entry is safely written
            self._evict(self._segments.victim())
        self._insert(DiskEntry(key, root, parent, tail, position, bool(num_logits), total), protected)
        self._m_writes.inc()
        self._m_write_bytes.inc(total)
        self._update_gauges()
        return True

    def _write_file(self, key: str, data: memoryview) -> None:
        final = self.folder / (key + SUFFIX)
        temp = self.folder / f"{key}{SUFFIX}{TEMP_MARK}{os.getpid()}"
        fd = self._open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _remove(temp)
            raise
        os.close(fd)
        os.replace(temp, final)
        _fsync_folder(self.folder)

    def _open(self, path: Path, flags: int) -> int:
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
                logger.info("prefix cache disk tier: %s refuses O_DIRECT (tmpfs?); entries go through the page "
                            "cache", self.folder)
        return os.open(path, flags, 0o644)

    # ---- read -----------------------------------------------------------------------------------------------
    def read(self, entry: DiskEntry) -> CheckpointPayload | None:
        """The entry's arrays, or None when it is gone, corrupt or truncated (then removed and counted): a miss."""
        path = self.folder / (entry.key + SUFFIX)
        try:
            fd = self._open(path, os.O_RDONLY)
        except OSError as exc:
            return self._discard(entry, f"cannot open: {exc.strerror}")
        try:
            size = os.fstat(fd).st_size
            if size != entry.nbytes:
                return self._discard(entry, f"{size} bytes where {entry.nbytes} were written")
            buffer = mmap.mmap(-1, size)
            done = 0
            while done < size:
                n = os.preadv(fd, [memoryview(buffer)[done:]], done)
                if n <= 0:
                    return self._discard(entry, "read ended early")
                done += n
        except OSError as exc:
            return self._discard(entry, f"read failed: {exc.strerror}")
        finally:
            os.close(fd)
        self._m_reads.inc()
        self._m_read_bytes.inc(size)
        try:
            header = _parse_header(memoryview(buffer))
        except (CorruptEntry, ValueError) as exc:
            return self._discard(entry, str(exc))
        if (header.identity, header.root, header.parent, header.tail, header.position) != \
                (self.identity, entry.root, entry.parent, entry.tail, entry.position) \
                or header.length + header.payload_length > size \
                or header.payload_length != self.payload_length(header.position, header.num_logits):
            return self._discard(entry, "header disagrees with the index")
        payload = memoryview(buffer)[header.length:header.length + header.payload_length]
        if hashlib.blake2b(payload, digest_size=16).digest() != header.digest:
            return self._discard(entry, "payload checksum mismatch")
        values = np.frombuffer(buffer, dtype=np.float32, count=header.payload_length // 4, offset=header.length)
        p, offset = header.position, 0

        def take(shape: tuple[int, ...]) -> np.ndarray:
            nonlocal offset
            size = int(np.prod(shape))
            array = values[offset:offset + size].reshape(shape)
            offset += size
            return array

        rows = take((self.num_attention_layers, p, self.row_width))
        states, tails = [], []
        for state, tail in self._state_shapes:
            states.append(take(tuple(state)))
            tails.append(take(tuple(tail)))
        logits = take((header.num_logits,)) if header.flags & FLAG_LOGITS else None
        return CheckpointPayload(rows, states, tails, logits)

    # ---- removal --------------------------------------------------------------------------------------------
    def _discard(self, entry: DiskEntry, why: str) -> None:
        logger.warning("prefix cache disk tier: entry %s is unusable (%s): removed, the hit is a miss",
                       entry.key, why)
        self._m_corrupt.inc()
        if self._segments.get(entry.key) is entry:
            self._forget(entry)
        _remove(self.folder / (entry.key + SUFFIX))
        self._update_gauges()
        return None

    def _evict(self, entry: DiskEntry) -> None:
        self._forget(entry)
        _remove(self.folder / (entry.key + SUFFIX))
        self._m_evicted.inc()

    def _insert(self, entry: DiskEntry, protected: bool) -> None:
        previous = self._index.get(entry.parent, {}).get(entry.tail)
        if previous is not None:
            self._forget(previous)
        self._index.setdefault(entry.parent, {})[entry.tail] = entry
        self._segments.add(entry, protected)
        self.used_bytes += entry.nbytes

    def _forget(self, entry: DiskEntry) -> None:
        self._segments.remove(entry.key)
        group = self._index[entry.parent]
        del group[entry.tail]
        if not group:
            del self._index[entry.parent]
        self.used_bytes -= entry.nbytes

    def _update_gauges(self) -> None:
        self._m_entries.set(self.num_entries)
        self._m_bytes.set(self.used_bytes)

    def check_integrity(self) -> None:
        """The index, the segments and the byte count describe the same entries, within the capacity."""
        indexed = [entry for group in self._index.values() for entry in group.values()]
        segments = self._segments.values()
        if len(indexed) != len(segments) or any(self._segments.get(e.key) is not e for e in indexed):
            raise IntegrityError("the disk tier's index and its segments disagree")
        if sum(e.nbytes for e in indexed) != self.used_bytes:
            raise IntegrityError(f"the disk tier counts {self.used_bytes} bytes, its entries hold "
                                 f"{sum(e.nbytes for e in indexed)}")
        if self.used_bytes > self.capacity_bytes:
            raise IntegrityError(f"the disk tier holds {self.used_bytes} bytes, over its {self.capacity_bytes}")
        if sum(e.nbytes for e in self._segments.protected.values()) != self._segments.protected_bytes:
            raise IntegrityError("the disk tier's protected byte count is off")


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("prefix cache disk tier: cannot remove %s: %s", path, exc)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writer_alive(pid_text: str) -> bool:
    """Whether the process that named a temporary file is still running (its write may be in progress)."""
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    if pid == os.getpid():
        return False  # a temporary file of ours at start: left by an earlier process that had our id
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
