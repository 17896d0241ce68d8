"""A GGUF file (llama.cpp's single-file format), read through the `gguf` package: metadata and tensors by name.

The file is memory-mapped by `gguf.GGUFReader`; opening it reads the header and the tensor table only, and a
tensor's bytes are touched when it (or one slice of it, e.g. one expert of a stacked [E, R, C] tensor) is read.

Shapes here are numpy order (rows first), the reverse of ggml's `ne`. Tensor types and what a read gives:
- F32, F16, BF16: float32 (BF16 widening is exact).
- Q8_0: blocks of 32 values along a row, each an f16 scale d and 32 int8 q (34 bytes); value = d * q, which is
  exact in float32. `f32` widens it; a K3 trunk matrix is kept as its blocks instead (`weights/gguf_k3.py`, a
  `QuantizedMatrix` the Q8_0 kernel multiplies), and a family's experts take `q8_0` (values and block scales).
- MXFP4: blocks of 32 values along a row, 17 bytes each: an E8M0 exponent byte e, then 16 bytes whose byte j holds
  value j in its low nibble and value j + 16 in its high nibble. The nibble codes are the E2M1 codes of K3_SPEC
  section 4 and the value is E2M1[code] * 2^(e - 127) in both formats (ggml stores doubled magnitudes with a
  halved scale, which is the same number), so `mxfp4(name)` converts the blocks to our layout (byte j of a row =
  value 2j low, 2j + 1 high; one scale byte per 32 values) with integer operations only, never through floats.
  One difference: scale byte 255 is 2^128 to ggml and 0 to us (K3_SPEC); converters never write it.
Any other type is refused with a `CheckpointError` naming it.
"""

from __future__ import annotations

import logging
import math
import mmap
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from k3serve.errors import CheckpointError
from k3serve.weights.mxfp4 import dequantize_mxfp4

logger = logging.getLogger(__name__)

QK = 32  # values per Q8_0 / MXFP4 block
Q8_0_BLOCK_BYTES = 2 + QK
MXFP4_BLOCK_BYTES = 1 + QK // 2
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = FLOAT_TYPES + ("Q8_0", "MXFP4")


def _gguf_module() -> Any:
    try:
        import gguf
    except ImportError:
        raise CheckpointError("reading GGUF files needs the `gguf` package: pip install 'k3serve[gguf]' "
                              "(or pip install gguf)") from None
    return gguf


class GGUFTensor(NamedTuple):
    name: str
    type_name: str  # ggml type: F32, F16, BF16, Q8_0, MXFP4, ...
    shape: tuple[int, ...]  # numpy order
    data: np.ndarray  # the memory-mapped bytes or values as the gguf package exposes them


def is_gguf_file(path: str | Path) -> bool:
    """True for an existing file that starts with the GGUF magic (or, if unreadable, is named *.gguf)."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return path.suffix.lower() == ".gguf"


def check_gguf_path(path: str | Path) -> None:
    """Raise a CheckpointError unless `path` (named *.gguf) is an existing file that starts with the GGUF magic: a
    missing file is not a "checkpoint folder", and an empty or foreign file is not a GGUF file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"GGUF file {path} does not exist")
    if path.is_file() and not is_gguf_file(path):
        raise CheckpointError(f"{path} is not a valid GGUF file (it does not start with the GGUF magic bytes)")


def _drop_pages(mapping: mmap.mmap | None, base: int, data: np.ndarray) -> None:
    """madvise(MADV_DONTNEED) over the whole pages of `data`, a contiguous view of `mapping` (mapped at `base`)."""
    if (mapping is None or mapping.closed or not data.flags.c_contiguous or data.nbytes == 0
            or not hasattr(mmap, "MADV_DONTNEED")):  # Linux and macOS have it
        return
    start = data.ctypes.data - base
    if start < 0 or start + data.nbytes > len(mapping):
        return  # not a view of this map (a copy somewhere along the way)
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        mapping.madvise(mmap.MADV_DONTNEED, first, last - first)


# Rows a mapped embedding's lookups may leave mapped before `_Dropper` drops the tensor's pages. Each drop is a
# madvise that flushes the TLBs of every core the process runs on: in a VM, where that is an inter-processor
# interrupt per core, 0.19-0.20 ms a decode step on Moonlight's 163,840 x 2,048 Q8_0 embedding (16 us alone in a
# one-thread process), occasionally 5-7 ms. Every 8 rows amortizes it; what stays mapped meanwhile is 8 rows' fault
# windows (64 KB each on Linux, a large page-cache folio at most: 2 MiB).
DROP_EVERY_ROWS = 8


class _Dropper:
    """`_drop_pages(mapping, base, data)` when called with no rows, or once every DROP_EVERY_ROWS rows reported."""

    def __init__(self, mapping: mmap.mmap | None, base: int, data: np.ndarray) -> None:
        self.mapping, self.base, self.data = mapping, base, data
        self.pending = 0

    def __call__(self, rows: np.ndarray | None = None) -> None:
        if rows is not None:
            self.pending += int(np.size(rows))
            if self.pending < DROP_EVERY_ROWS:
                return
        self.pending = 0
        _drop_pages(self.mapping, self.base, self.data)


class GGUFFile:
    """Metadata (key -> Python value) and tensors (name -> `GGUFTensor`) of one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        gguf = _gguf_module()
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file {self.path} does not exist")
        try:
            reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as exc:  # the package raises ValueError, IndexError, struct errors... on bad bytes
            raise CheckpointError(f"{self.path} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
                                  "is it truncated or corrupt?") from exc
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                value = field.contents()
            except Exception as exc:
                raise CheckpointError(f"{self.path}: metadata key {key!r} cannot be read: {exc}") from exc
            if isinstance(value, float) and field.types == [gguf.GGUFValueType.FLOAT32]:
                # a float32 key holds the decimal its writer meant (1e-05, not 9.999999747378752e-06)
                value = float(str(np.float32(value)))
            self.metadata[key] = value
        file_size = self.path.stat().st_size
        self.tensors: dict[str, GGUFTensor] = {}
        for tensor in reader.tensors:
            type_name = tensor.tensor_type.name
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            if int(tensor.data_offset) + int(tensor.n_bytes) > file_size or tensor.data.nbytes != int(tensor.n_bytes):
                raise CheckpointError(f"{self.path}: tensor {tensor.name!r} runs past the end of the file "
                                      f"({file_size} bytes); the file is truncated")
            self.tensors[tensor.name] = GGUFTensor(tensor.name, type_name, shape, tensor.data)
        # No reference to the reader is kept (the tensors' views and `_mapping` keep the map open): its fields hold
        # numpy views of every metadata value's parts (a length and the bytes of each vocabulary string and merge),
        # ~220 MiB of a process's peak RSS at a 152k vocabulary, resident beside the weights for the model's life
        # until 2026-12-08; the values were copied into `metadata` above
        self._mapping = getattr(reader.data, "_mmap", None)  # the mmap under the reader's memmap, if numpy has one
        self._base = reader.data.ctypes.data if self._mapping is not None else 0
        self.architecture = self.metadata.get("general.architecture")
        if not isinstance(self.architecture, str):
            raise CheckpointError(f"{self.path}: GGUF metadata has no general.architecture")

    # ---- metadata ----------------------------------------------------------------------------------------------

    def has(self, key: str) -> bool:
        return key in self.metadata

    def get(self, key: str, default: Any = ...) -> Any:
        """A metadata value; `{arch}` in `key` is the file's architecture. Without a default, absence is an error."""
        key = key.replace("{arch}", self.architecture)
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise CheckpointError(f"{self.path} ({self.architecture}): GGUF metadata lacks {key!r}")
        return default

    # ---- tensors ------------------------------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> GGUFTensor:
        found = self.tensors.get(name)
        if found is None:
            raise CheckpointError(f"{self.path} ({self.architecture}): GGUF file lacks tensor {name!r} "
                                  f"({len(self.tensors)} tensors present)")
        return found

    def _check_type(self, tensor: GGUFTensor, allowed: tuple[str, ...]) -> None:
        if tensor.type_name not in allowed:
            raise CheckpointError(f"{self.path}: tensor {tensor.name!r} has GGUF type {tensor.type_name}, which "
                                  f"k3serve does not read (supported: {', '.join(allowed)})")

    def f32(self, name: str, index: int | None = None) -> np.ndarray:
        """Tensor `name` (or its slice `index` along the first axis) as a float32 array of its numpy shape."""
        tensor = self.tensor(name)
        self._check_type(tensor, SUPPORTED_TYPES)
        shape = tensor.shape if index is None else tensor.shape[1:]
        data = tensor.data if index is None else tensor.data[index]
        if tensor.type_name in FLOAT_TYPES:
            if tensor.type_name == "F32":
                values = np.array(data, dtype=np.float32).reshape(shape)
            elif tensor.type_name == "F16":
                values = np.asarray(data, dtype=np.float16).astype(np.float32).reshape(shape)
            else:
                bits = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
                values = bits.view(np.float32).reshape(shape)
            self.release(data)
            return values
        if tensor.type_name == "Q8_0":
            values, scales = self.q8_0(name, index)
            return (values.reshape(*scales.shape, QK).astype(np.float32) * scales[:, :, None]).reshape(shape)
        packed, scales = self.mxfp4(name, index)
        return dequantize_mxfp4(packed, scales).reshape(shape)

    def q8_0(self, name: str, index: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """A Q8_0 tensor (or slice) as it is stored, every leading dimension folded into R: (values i8 [R, C],
        scales f16 [R, C/32]), fresh arrays: 1.0625 bytes a value, as in the file."""
        tensor = self.tensor(name)
        self._check_type(tensor, ("Q8_0",))
        shape = tensor.shape if index is None else tensor.shape[1:]
        rows = math.prod(shape[:-1])
        data = tensor.data if index is None else tensor.data[index]
        blocks = np.ascontiguousarray(data).reshape(rows, shape[-1] // QK, Q8_0_BLOCK_BYTES)  # [R, G, 34]
        scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[:, :, 0].copy()  # [R, G]
        values = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, shape[-1])  # [R, C]
        self.release(data)
        return values, scales

    def mxfp4(self, name: str, index: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """An MXFP4 tensor (or slice) in our layout: (packed u8 [R, C/2], scales u8 [R, C/32]), every leading
        dimension folded into R."""
        tensor = self.tensor(name)
        self._check_type(tensor, ("MXFP4",))
        shape = tensor.shape if index is None else tensor.shape[1:]
        cols = shape[-1]
        rows = math.prod(shape[:-1])
        data = tensor.data if index is None else tensor.data[index]
        blocks = np.ascontiguousarray(data).reshape(rows, cols // QK, MXFP4_BLOCK_BYTES)  # [R, G, 17]
        scales = np.ascontiguousarray(blocks[:, :, 0])  # [R, G]
        qs = blocks[:, :, 1:]  # [R, G, 16]: byte j = value j (low nibble) | value j + 16 (high nibble)
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # [R, G, 32] in value order
        packed = (codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)).reshape(rows, cols // 2)  # [R, C/2]
        packed = np.ascontiguousarray(packed, dtype=np.uint8)
        self.release(data)
        return packed, scales

    def release(self, data: np.ndarray) -> None:
        """Drop this process's mapped pages of `data` (a contiguous part of the mapped file) once its bytes have been
        copied out: every read above (`f32`, `q8_0`, `mxfp4`) converts into new arrays, and without this the file's
        pages stay resident beside the copies, so an MXFP4 GGUF's experts counted twice in the high-water mark
        (4.4 GB for a 2.0 GB file at Qwen3-30B-A3B's widths). Only whole pages inside `data` are dropped; the
        mapping is shared and read-only, so a later read (a trunk matrix kept as its Q8_0 blocks, views of the
        map) faults them back in from the page cache. A no-op where numpy exposes no mmap."""
        _drop_pages(self._mapping, self._base, data)

    def dropper(self, data: np.ndarray) -> Callable[..., None]:
        """`release(data)` as a call that outlives `close()` (it holds the mmap itself, which `data` keeps open):
        at once when called with no rows, else once the rows reported reach DROP_EVERY_ROWS (`_Dropper`)."""
        return _Dropper(self._mapping, self._base, data)

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for tensor in self.tensors.values():
            counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
        return counts

    def close(self) -> None:
        # the gguf package holds a numpy memmap; dropping the references lets it unmap
        self.tensors = {}
        self._mapping = None
