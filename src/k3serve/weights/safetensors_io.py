"""A lazy safetensors reader and a deterministic writer, numpy only.

File layout (https://github.com/huggingface/safetensors, "Format"):

    [8 bytes]  N, little-endian uint64: header length
    [N bytes]  UTF-8 JSON: {name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
                            "__metadata__": {str: str}}   (optional; spaces may pad the end)
    [rest]     tensor data; offsets are relative to byte 8 + N

A checkpoint is one file, or a folder of shards with `model.safetensors.index.json` mapping each tensor name
to its shard. `SafetensorsIndex` parses every header once, validates it, and then reads any tensor (or any
byte range of one) with `os.pread` on a cached file descriptor: nothing is memory-mapped and no file is read
whole, so a 1.5 TB checkpoint costs only its headers in RAM. Reads are thread-safe (pread has no shared file
position).

The writer sorts tensors so that the output is byte-for-byte deterministic and readable by the official
library, which forbids gaps between tensors. Tensors whose byte size is a multiple of 8 come first (sorted by
name) and so all start at 8-byte-aligned offsets; the remaining ones follow sorted by (item size descending,
name), which keeps each of them aligned to at least its own item size. The header is padded with spaces so
that the data section starts at a multiple of 8 bytes from the start of the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import numpy as np

from k3serve.errors import CheckpointError
from k3serve.weights.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

INDEX_FILE_NAME = "model.safetensors.index.json"
HEADER_SIZE_BYTES = 8
DATA_ALIGNMENT = 8
METADATA_KEY = "__metadata__"
# NOTE: a sanity cap on the JSON header; real K3 shards hold a few thousand tensors (well under 1 MB each).
MAX_HEADER_BYTES = 512 * 2**20

# Storage dtype string -> little-endian numpy dtype of the stored elements (BF16 is stored as its uint16 bits).
STORAGE_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
}

# numpy dtype -> storage dtype string, for tensors written without an explicit dtype.
_INFERRED_DTYPES: dict[np.dtype, str] = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int16): "I16",
    np.dtype(np.float16): "F16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int32): "I32",
    np.dtype(np.float32): "F32",
    np.dtype(np.uint64): "U64",
    np.dtype(np.int64): "I64",
    np.dtype(np.float64): "F64",
}


class TensorNotFoundError(CheckpointError, KeyError):
    """A tensor name that the checkpoint does not hold."""

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message and wrap it in quotes.
        return str(self.args[0]) if self.args else ""


class TensorInfo(NamedTuple):
    """Where one tensor lives. `offset` is the absolute byte offset of its data in `file`."""

    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16", "F32", "U8"
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int


class _FileHeader(NamedTuple):
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------


def _pread_exact(fd: int, buffer: memoryview, offset: int, file: Path) -> None:
    """Fill `buffer` from `fd` at `offset`, looping over short reads."""
    filled = 0
    total = len(buffer)
    while filled < total:
        if hasattr(os, "preadv"):
            count = os.preadv(fd, [buffer[filled:]], offset + filled)
        else:  # pragma: no cover - platforms without preadv
            chunk = os.pread(fd, total - filled, offset + filled)
            count = len(chunk)
            buffer[filled : filled + count] = chunk
        if count == 0:
            raise CheckpointError(
                f"{file}: unexpected end of file reading {total} bytes at offset {offset} "
                f"(the file shrank after its header was validated?)"
            )
        filled += count


def _parse_header(file: Path) -> _FileHeader:
    """Read and validate the header of one .safetensors file."""
    try:
        file_size = file.stat().st_size
        with open(file, "rb") as handle:
            prefix = handle.read(HEADER_SIZE_BYTES)
            if len(prefix) < HEADER_SIZE_BYTES:
                raise CheckpointError(
                    f"{file}: file is {file_size} bytes, shorter than the {HEADER_SIZE_BYTES}-byte header length"
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > file_size - HEADER_SIZE_BYTES:
                raise CheckpointError(
                    f"{file}: header length {header_len} is larger than the rest of the file "
                    f"({file_size - HEADER_SIZE_BYTES} bytes); truncated or not a safetensors file"
                )
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(f"{file}: header length {header_len} exceeds {MAX_HEADER_BYTES} bytes")
            raw_header = handle.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read: {exc}") from exc
    if len(raw_header) != header_len:
        raise CheckpointError(f"{file}: file ended inside its {header_len}-byte header")
    try:
        header = json.loads(raw_header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: header is not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: header must be a JSON object, got {type(header).__name__}")

    data_start = HEADER_SIZE_BYTES + header_len
    data_size = file_size - data_start
    metadata = header.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError(f"{file}: {METADATA_KEY} must be an object of strings to strings")

    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        where = f"{file}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: header entry must be an object")
        dtype = entry.get("dtype")
        shape = entry.get("shape")
        offsets = entry.get("data_offsets")
        if dtype not in STORAGE_DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(STORAGE_DTYPES)})")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise CheckpointError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
        begin, end = offsets
        expected = math.prod(shape) * STORAGE_DTYPES[dtype].itemsize
        if end - begin != expected:
            raise CheckpointError(
                f"{where}: data_offsets {offsets} span {end - begin} bytes but dtype {dtype} with shape "
                f"{shape} needs {expected}"
            )
        if end > data_size:
            raise CheckpointError(
                f"{where}: data ends at byte {end} of the data section but only {data_size} bytes follow the "
                f"header; the file is truncated"
            )
        tensors[name] = TensorInfo(name, dtype, tuple(shape), file, data_start + begin, expected)
        spans.append((begin, end, name))

    spans.sort()
    covered_end, covered_by = 0, ""
    for begin, end, name in spans:
        if begin == end:
            continue  # an empty tensor occupies no bytes
        if begin < covered_end:
            raise CheckpointError(
                f"{file}: tensors {covered_by!r} and {name!r} overlap (bytes {begin}..{covered_end} of the data "
                f"section)"
            )
        covered_end, covered_by = end, name
    return _FileHeader(tensors, metadata)


class SafetensorsIndex:
    """All tensors of a checkpoint (one file or a folder of shards), read lazily with pread.

    Use `SafetensorsIndex.open(path)`; close it (or use it as a context manager) to release file descriptors.
    """

    def __init__(self, tensors: dict[str, TensorInfo], file_metadata: dict[Path, dict[str, str]]) -> None:
        self._tensors = tensors
        self._file_metadata = file_metadata
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- construction -------------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> SafetensorsIndex:
        """Index a .safetensors file, a folder with `model.safetensors.index.json`, or a folder of shards."""
        root = Path(path)
        if root.is_file():
            header = _parse_header(root)
            return cls(dict(header.tensors), {root: header.metadata})
        if not root.is_dir():
            raise CheckpointError(f"{root}: no such file or folder")
        index_file = root / INDEX_FILE_NAME
        if index_file.is_file():
            return cls._open_indexed(index_file)
        shard_files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
        if not shard_files:
            raise CheckpointError(f"{root}: folder holds neither {INDEX_FILE_NAME} nor any *.safetensors file")
        tensors: dict[str, TensorInfo] = {}
        file_metadata: dict[Path, dict[str, str]] = {}
        for shard in shard_files:
            header = _parse_header(shard)
            file_metadata[shard] = header.metadata
            for name, info in header.tensors.items():
                if name in tensors:
                    raise CheckpointError(f"{shard}: tensor {name!r} is also in {tensors[name].file}")
                tensors[name] = info
        return cls(tensors, file_metadata)

    @classmethod
    def _open_indexed(cls, index_file: Path) -> SafetensorsIndex:
        try:
            index = json.loads(index_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{index_file}: cannot parse: {exc}") from exc
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{index_file}: 'weight_map' must be an object of tensor names to shard files")
        root = index_file.parent
        headers: dict[Path, _FileHeader] = {}
        tensors: dict[str, TensorInfo] = {}
        for name, shard_name in weight_map.items():
            shard = root / shard_name
            if shard not in headers:
                if not shard.is_file():
                    raise CheckpointError(
                        f"{index_file}: shard {shard_name!r} (holding {name!r}) is missing: {shard} does not exist"
                    )
                headers[shard] = _parse_header(shard)
            info = headers[shard].tensors.get(name)
            if info is None:
                raise CheckpointError(f"{index_file}: tensor {name!r} is mapped to {shard} but that shard lacks it")
            tensors[name] = info
        return cls(tensors, {shard: header.metadata for shard, header in headers.items()})

    # -- lookup -------------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every tensor name, in index order (weight_map order, or per file in header order)."""
        return list(self._tensors)

    def files(self) -> list[Path]:
        """The .safetensors files this index reads."""
        return list(self._file_metadata)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def info(self, name: str) -> TensorInfo:
        """Dtype, shape and location of one tensor; TensorNotFoundError if absent."""
        info = self._tensors.get(name)
        if info is None:
            files = ", ".join(str(f) for f in self._file_metadata) or "(no files)"
            raise TensorNotFoundError(f"tensor {name!r} is not in the checkpoint ({len(self)} tensors in {files})")
        return info

    def metadata(self, file: str | os.PathLike[str] | None = None) -> dict[str, str]:
        """The `__metadata__` of `file` (a path, or a file name within the checkpoint).

        With `file=None`: the metadata of the only file, or, for several shards, the union of all of them
        (shards in sorted order, later shards winning on conflicts).
        """
        if file is None:
            merged: dict[str, str] = {}
            for path in sorted(self._file_metadata):
                merged.update(self._file_metadata[path])
            return merged
        wanted = Path(file)
        for path, metadata in self._file_metadata.items():
            if path == wanted or path.name == str(file):
                return dict(metadata)
        raise CheckpointError(f"{file}: not a file of this checkpoint ({', '.join(map(str, self._file_metadata))})")

    # -- reading ------------------------------------------------------------------------------------------

    def _fd(self, file: Path) -> int:
        if self._closed:
            raise ValueError("read from a closed SafetensorsIndex")
        fd = self._fds.get(file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file)
                if fd is None:
                    try:
                        fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    except OSError as exc:
                        raise CheckpointError(f"{file}: cannot open: {exc}") from exc
                    self._fds[file] = fd
        return fd

    def _read_into(self, info: TensorInfo, buffer: np.ndarray, start: int = 0) -> None:
        if buffer.nbytes:
            _pread_exact(self._fd(info.file), memoryview(buffer).cast("B"), info.offset + start, info.file)

    def read_raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes as a fresh uint8 array [nbytes]."""
        info = self.info(name)
        buffer = np.empty(info.nbytes, dtype=np.uint8)  # [nbytes]
        self._read_into(info, buffer)
        return buffer

    def read(self, name: str) -> np.ndarray:
        """The tensor as a fresh, writeable numpy array of its header shape.

        BF16 is widened to float32 exactly, F16 stays float16, every other dtype maps to its numpy dtype.
        """
        info = self.info(name)
        stored = STORAGE_DTYPES[info.dtype]
        raw = self.read_raw(name).view(stored).reshape(info.shape)
        if info.dtype == "BF16":
            return bf16_bits_to_f32(raw)
        if not stored.isnative:  # pragma: no cover - big-endian hosts
            return raw.astype(stored.newbyteorder("="))
        return raw

    def read_range(self, name: str, start: int, length: int) -> bytes:
        """`length` bytes starting `start` bytes into the tensor's data (e.g. some rows of a matrix)."""
        info = self.info(name)
        if start < 0 or length < 0 or start + length > info.nbytes:
            raise ValueError(
                f"byte range [{start}, {start + length}) is outside tensor {name!r} ({info.nbytes} bytes)"
            )
        buffer = bytearray(length)
        if length:
            _pread_exact(self._fd(info.file), memoryview(buffer), info.offset + start, info.file)
        return bytes(buffer)

    # -- lifetime -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close every cached file descriptor; later reads raise ValueError."""
        with self._lock:
            self._closed = True
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> SafetensorsIndex:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


# ---------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------


def _storage_dtype(name: str, array: np.ndarray, dtypes: Mapping[str, str] | None) -> str:
    if dtypes is not None and name in dtypes:
        dtype = dtypes[name]
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"tensor {name!r}: unknown safetensors dtype {dtype!r}")
        return dtype
    inferred = _INFERRED_DTYPES.get(array.dtype.newbyteorder("=") if array.dtype.byteorder != "|" else array.dtype)
    if inferred is None:
        raise ValueError(f"tensor {name!r}: numpy dtype {array.dtype} has no safetensors equivalent")
    return inferred


def _stored_array(name: str, array: np.ndarray, dtype: str) -> np.ndarray:
    """The C-contiguous little-endian array whose bytes are written for this tensor.

    BF16: a floating array is rounded to nearest-even bf16; a uint16 array is taken as bf16 bit patterns.
    """
    if dtype == "BF16":
        if array.dtype == np.uint16:
            return np.ascontiguousarray(array, dtype="<u2")
        if not np.issubdtype(array.dtype, np.floating):
            raise ValueError(f"tensor {name!r}: BF16 needs a float (or uint16 bit-pattern) array, got {array.dtype}")
        return f32_to_bf16_bits(array).astype("<u2", copy=False)
    return np.ascontiguousarray(array, dtype=STORAGE_DTYPES[dtype])


def _write_order(entries: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """Names in data order: 8-byte-multiple sizes first by name, then by (item size desc, name)."""

    def nbytes(name: str) -> int:
        dtype, shape = entries[name]
        return math.prod(shape) * STORAGE_DTYPES[dtype].itemsize

    aligned = sorted(n for n in entries if nbytes(n) % DATA_ALIGNMENT == 0)
    rest = sorted(
        (n for n in entries if nbytes(n) % DATA_ALIGNMENT), key=lambda n: (-STORAGE_DTYPES[entries[n][0]].itemsize, n)
    )
    return aligned + rest


def save_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray],
    dtypes: Mapping[str, str] | None = None,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write `tensors` to one .safetensors file.

    `dtypes[name]` overrides the stored dtype (default: inferred from the array); "BF16" rounds a float array
    to bf16 (nearest, ties to even). The file is written to a temporary name and renamed into place.
    """
    out_path = Path(path)
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("safetensors metadata must map strings to strings")
    arrays = {name: np.asarray(array) for name, array in tensors.items()}
    entries = {name: (_storage_dtype(name, a, dtypes), tuple(int(d) for d in a.shape)) for name, a in arrays.items()}
    order = _write_order(entries)

    header: dict[str, Any] = {}
    if metadata:
        header[METADATA_KEY] = dict(sorted(metadata.items()))
    offset = 0
    for name in order:
        dtype, shape = entries[name]
        size = math.prod(shape) * STORAGE_DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    header_bytes += b" " * (-(HEADER_SIZE_BYTES + len(header_bytes)) % DATA_ALIGNMENT)

    tmp_path = out_path.with_name(out_path.name + ".tmp")
    with open(tmp_path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header_bytes)))
        handle.write(header_bytes)
        for name in order:
            stored = _stored_array(name, arrays[name], entries[name][0])
            if stored.nbytes:
                handle.write(memoryview(stored.reshape(-1)).cast("B"))
    os.replace(tmp_path, out_path)


def save_sharded(
    folder: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray],
    dtypes: Mapping[str, str] | None = None,
    max_shard_bytes: int = 2**30,
) -> list[Path]:
    """Write `tensors` as `model-0000i-of-0000N.safetensors` shards plus `model.safetensors.index.json`.

    Shards are filled in the mapping's insertion order; a new shard starts when the next tensor would push the
    current one past `max_shard_bytes` (a tensor larger than that gets a shard of its own). Returns the shard
    paths in order.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir = Path(folder)
    out_dir.mkdir(parents=True, exist_ok=True)

    groups: list[list[str]] = [[]]
    group_bytes = 0
    total_size = 0
    for name, array in tensors.items():
        array = np.asarray(array)
        size = array.size * STORAGE_DTYPES[_storage_dtype(name, array, dtypes)].itemsize
        if groups[-1] and group_bytes + size > max_shard_bytes:
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += size
        total_size += size

    num_shards = len(groups)
    shard_paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for number, names in enumerate(groups, start=1):
        shard_path = out_dir / f"model-{number:05d}-of-{num_shards:05d}.safetensors"
        save_safetensors(shard_path, {name: tensors[name] for name in names}, dtypes)
        shard_paths.append(shard_path)
        weight_map.update({name: shard_path.name for name in names})

    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    index_path = out_dir / INDEX_FILE_NAME
    tmp_path = index_path.with_name(index_path.name + ".tmp")
    tmp_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp_path, index_path)
    return shard_paths
