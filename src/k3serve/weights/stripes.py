"""Striping: one store file laid over N drives in chunks of C bytes, as RAID 0 lays a volume.

    virtual byte x  ->  drive (x // C) mod N, at offset (x // (C N)) C + x mod C of that drive's file

The chunks of any virtual range that land on one drive are adjacent in that drive's file, so a read of L bytes is
one contiguous read of about L / N bytes per drive, and every read, however few the extents, keeps all N drives
busy in equal shares (to within one chunk). C is a multiple of 4 KiB, so O_DIRECT reads stay aligned.

`k3serve pack --stripe` writes through `StripedWriter`; `k3serve.stream.io.StripedIO` reads with a queue per
drive; `read_striped` is the plain reader for tools and tests.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, NamedTuple, Sequence


class StripePiece(NamedTuple):
    drive: int
    drive_offset: int  # bytes into that drive's file
    start: int  # bytes into the virtual range
    length: int


def stripe_pieces(offset: int, length: int, chunk_bytes: int, num_drives: int) -> list[StripePiece]:
    """The virtual range [offset, offset + length) cut at chunk edges, each piece with its drive and its offset in
    that drive's file."""
    pieces, position, end = [], offset, offset + length
    while position < end:
        chunk, within = divmod(position, chunk_bytes)
        n = min(chunk_bytes - within, end - position)
        pieces.append(StripePiece(chunk % num_drives, chunk // num_drives * chunk_bytes + within, position - offset, n))
        position += n
    return pieces


def drive_shares(offset: int, length: int, chunk_bytes: int, num_drives: int) -> list[int]:
    """Bytes of the virtual range [offset, offset + length) on each drive (the sums of `stripe_pieces` by drive,
    in O(num_drives): the simulator's reads of a 1 GB trunk layer span thousands of chunks)."""
    shares = [0] * num_drives
    if length <= 0:
        return shares
    end = offset + length
    first, last = offset // chunk_bytes, (end - 1) // chunk_bytes
    if first == last:
        shares[first % num_drives] = length
        return shares
    shares[first % num_drives] += (first + 1) * chunk_bytes - offset
    shares[last % num_drives] += end - last * chunk_bytes
    middle = last - first - 1  # whole chunks between, dealt round robin from drive (first + 1) mod N
    for k in range(num_drives):
        extra = 1 if (k - (first + 1)) % num_drives < middle % num_drives else 0
        shares[k] += (middle // num_drives + extra) * chunk_bytes
    return shares


def striped_file_sizes(total: int, chunk_bytes: int, num_drives: int) -> list[int]:
    """Bytes each drive's file holds of a virtual file of `total` bytes."""
    full, tail = divmod(total, chunk_bytes)
    sizes = [(full // num_drives + (1 if drive < full % num_drives else 0)) * chunk_bytes
             for drive in range(num_drives)]
    if tail:
        sizes[full % num_drives] += tail
    return sizes


class StripedWriter:
    """A write-only file object over the drives' files: `write` appends to the virtual file, `tell` is its size."""

    def __init__(self, files: Sequence[BinaryIO], chunk_bytes: int) -> None:
        self.files = list(files)
        self.chunk_bytes = chunk_bytes
        self._position = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for p in stripe_pieces(self._position, len(view), self.chunk_bytes, len(self.files)):
            self.files[p.drive].write(view[p.start:p.start + p.length])  # appends: a drive's pieces come in order
        self._position += len(view)
        return len(view)

    def tell(self) -> int:
        return self._position


def read_striped(paths: Sequence[str | Path], chunk_bytes: int, offset: int, length: int) -> bytes:
    """`length` bytes at virtual `offset` of a file striped over `paths` (or of one plain file), read plainly on
    this thread; a short read raises EOFError naming the file."""
    out = bytearray(length)
    descriptors = [os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)) for p in paths]
    try:
        pieces = stripe_pieces(offset, length, chunk_bytes, len(paths)) if len(paths) > 1 else \
            [StripePiece(0, offset, 0, length)]
        for p in pieces:
            data = os.pread(descriptors[p.drive], p.length, p.drive_offset)
            if len(data) != p.length:
                raise EOFError(f"{paths[p.drive]}: {len(data)} of {p.length} bytes at offset {p.drive_offset} "
                               "(file truncated?)")
            out[p.start:p.start + p.length] = data
    finally:
        for fd in descriptors:
            os.close(fd)
    return bytes(out)
