"""A dependency-free PNG writer (zlib + struct) for co-activation heatmaps.

PNG: signature, IHDR (width, height, bit depth 8, colour type 2 = RGB), one IDAT of zlib-compressed scanlines
each prefixed by filter byte 0, IEND; every chunk is length, type, data, CRC-32 of type + data.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png(path: str | Path, rgb: np.ndarray) -> None:
    """rgb: uint8 [height, width, 3]."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    height, width, _ = rgb.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), rgb.reshape(height, width * 3)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    Path(path).write_bytes(_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
                           + _chunk(b"IEND", b""))


def heatmap_rgb(matrix: np.ndarray, cell: int = 8) -> np.ndarray:
    """matrix [N, N] of counts -> uint8 [N*cell, N*cell, 3]: white (0) through orange to dark red (max)."""
    values = matrix.astype(np.float64)
    top = values.max() if values.size and values.max() > 0 else 1.0
    t = np.sqrt(values / top)  # [N, N] in 0..1; sqrt lifts the weak pairs into view
    anchors = np.array([[255, 255, 255], [253, 174, 97], [215, 48, 39], [103, 0, 13]], np.float64)
    position = t * (len(anchors) - 1)
    low = np.clip(np.floor(position).astype(int), 0, len(anchors) - 2)
    frac = (position - low)[..., None]
    rgb = anchors[low] * (1 - frac) + anchors[low + 1] * frac  # [N, N, 3]
    return np.repeat(np.repeat(rgb, cell, axis=0), cell, axis=1).round().astype(np.uint8)
