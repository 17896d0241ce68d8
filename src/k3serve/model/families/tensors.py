"""Lazy access to a Hugging Face checkpoint's tensors, by name, as float32.

Every read goes through `SafetensorsIndex` (one `pread` per tensor, nothing memory-mapped), so opening a checkpoint
costs only its headers and a tensor is read when a layer is built or an expert is first used. Whatever dtype the
header says (BF16, F16, F32) comes back as float32; BF16 widening is exact.

Some tensors have several spellings: the names of the released checkpoint and the names transformers uses inside
its modules (for example `self_attn.f_a_proj` and `self_attn.forget_gate.f_a_proj`). `first(...)` takes the first
present and, if none is, raises a `CheckpointError` that lists every spelling it tried.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from k3serve.errors import CheckpointError
from k3serve.model.families.gguf_families import GGUFTensorIndex
from k3serve.model.weights import keep_bf16
from k3serve.weights.q8_0 import BLOCK_BYTES, GROUP_SIZE
from k3serve.weights.quantized import (MappedQuantizedMatrix, QuantizedMatrix, check_load_trunk_precision,
                                      quantize_matrix)
from k3serve.weights.safetensors_io import SafetensorsIndex

_FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}


class TensorReader:
    """`index` is a `SafetensorsIndex` (a checkpoint folder) or a `GGUFTensorIndex` (a GGUF file mapped to our
    names, `gguf_families.py`).

    `trunk_precision` "native" gives every trunk matrix as the source stores it; "q8_0" or "mxfp4" quantizes, at
    load, each `matrix` and the embedding that the source does not already hold at that precision (llama.cpp's
    Q8_0 and MXFP4_MOE files hold their trunk, embedding and output matrix in Q8_0)."""

    trunk_precision = "native"  # also for readers with no index (`synthetic._RandomReader`)
    # name -> each matrix `matrix` quantized, recorded only where a caller set a dict (the family packer stores
    # them); left None, the reader, which the expert store keeps, holds no second reference to a fused part
    quantized_at_load: dict[str, QuantizedMatrix] | None = None

    def __init__(self, index: SafetensorsIndex | GGUFTensorIndex, family: str, path: Path,
                 trunk_precision: str = "native") -> None:
        self.index = index
        self.family = family
        self.path = path
        self.trunk_precision = check_load_trunk_precision(trunk_precision)

    @classmethod
    def open(cls, folder: str | Path, family: str, trunk_precision: str = "native") -> TensorReader:
        return cls(SafetensorsIndex.open(folder), family, Path(folder), trunk_precision)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def exists(self, *names: str) -> bool:
        return any(name in self.index for name in names)

    def _missing(self, names: Sequence[str]) -> CheckpointError:
        spelled = " or ".join(repr(n) for n in names)
        return CheckpointError(
            f"{self.family} checkpoint {self.path} lacks tensor {spelled} ({len(self.index)} tensors present)"
        )

    def name_of(self, *names: str) -> str:
        """The first of `names` that the checkpoint holds."""
        for name in names:
            if name in self.index:
                return name
        raise self._missing(names)

    def f32(self, *names: str, shape: tuple[int, ...] | None = None, size: int | None = None) -> np.ndarray:
        """The first present of `names` as a C-contiguous float32 array, checked against `shape` (or, for a
        tensor whose layout varies between writers, its number of elements `size`) if given."""
        name = self.name_of(*names)
        info = self.index.info(name)
        if shape is not None and self._stored_blocks(name, shape) is not None:  # a family store's Q8_0 trunk
            return self._stored_blocks(name, shape).dequantize()  # type: ignore[union-attr]
        if info.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"{self.family} checkpoint {self.path}: tensor {name!r} has dtype {info.dtype}; this loader reads "
                f"float tensors (BF16, F16, F32) only"
            )
        array = np.ascontiguousarray(self.index.read(name), dtype=np.float32)
        if shape is not None:
            self._check_shape(name, array.shape, shape)
        if size is not None and array.size != size:
            raise CheckpointError(
                f"{self.family} checkpoint {self.path}: tensor {name!r} has {array.size} values "
                f"(shape {list(array.shape)}), the config implies {size}"
            )
        return array

    def _check_shape(self, name: str, actual: Sequence[int], shape: Sequence[int]) -> None:
        if tuple(actual) != tuple(shape):
            raise CheckpointError(
                f"{self.family} checkpoint {self.path}: tensor {name!r} has shape {list(actual)}, the config "
                f"implies {list(shape)}"
            )

    def _stored_blocks(self, name: str, shape: Sequence[int], mapped: bool = False) -> QuantizedMatrix | None:
        """`name`'s Q8_0 blocks where the source holds them: a GGUF file's Q8_0 trunk tensor, or, in a family store
        packed from one, a U8 tensor [R, C / 32 * 34] standing for a float [R, C] (`stream/family_pack.py`). A copy
        of the blocks, and a GGUF file's pages of them dropped once copied (`GGUFFile.release`: the copy and the
        mapped pages had both stayed resident); `mapped` keeps a GGUF tensor as views of the mapped file instead,
        for an embedding, whose lookups touch only the rows they read."""
        if len(shape) != 2 or shape[1] % GROUP_SIZE:
            return None
        rows, cols = shape
        if isinstance(self.index, GGUFTensorIndex):
            matrix = self.index.q8_0_blocks(name)
            if matrix is None or matrix.shape != (rows, cols):
                return None
            if mapped:  # views of the map, its pages dropped after each lookup
                return MappedQuantizedMatrix(matrix.precision, matrix.data, matrix.scales, matrix.cols,
                                             after_rows=self.index.file.dropper(matrix.data))
            held = matrix.copy()
            self.index.file.release(matrix.data)
            return held
        info = self.index.info(name)
        if info.dtype == "U8" and tuple(info.shape) == (rows, cols // GROUP_SIZE * BLOCK_BYTES):
            return QuantizedMatrix("q8_0", np.array(self.index.read(name), np.uint8), None, cols)
        return None

    def matrix(self, *names: str, shape: tuple[int, int], mapped: bool = False) -> np.ndarray | QuantizedMatrix:
        """A trunk matrix multiplied by `kernels.linear`: its Q8_0 blocks where the source stores it as Q8_0 (a GGUF
        Q8_0 file, kept as llama.cpp holds it; `mapped`: as views of the file, see `_stored_blocks`), else its
        values as bf16 bits when they are bf16, else float32; at a quantized `trunk_precision`, those quantized to
        it (a matrix whose rows are not whole 32-blocks stays as stored)."""
        name = self.name_of(*names)
        requantized = self.trunk_precision not in ("native", "q8_0") and shape[1] % GROUP_SIZE == 0
        blocks = self._stored_blocks(name, shape, mapped and not requantized)  # mapped only if kept as stored
        if self.trunk_precision != "native" and shape[1] % GROUP_SIZE == 0:
            if blocks is not None and blocks.precision == self.trunk_precision:
                return blocks
            matrix = quantize_matrix(blocks if blocks is not None else self.values(name, shape=shape),
                                     self.trunk_precision)
            if self.quantized_at_load is not None:
                self.quantized_at_load[name] = matrix
            return matrix
        return blocks if blocks is not None else self.values(name, shape=shape)

    def q8_0(self, name: str, shape: tuple[int, int]) -> QuantizedMatrix | None:
        """`name`'s Q8_0 blocks where the source holds it as Q8_0 (a GGUF's Q8_0 tensor, a family store's blocks),
        whatever `trunk_precision`; else (or if absent) None."""
        return self._stored_blocks(name, shape) if self.exists(name) else None

    def values(self, *names: str, shape: tuple[int, ...]) -> np.ndarray:
        """The first present of `names` as bf16 bits (uint16) when its values are bf16, else float32 (`keep_bf16`
        of `f32`). A checkpoint's BF16 tensor is read as stored: widening it first cost 4-6x its size in transient
        copies (a 622 MB lm_head peaked the load at 3.8 GB)."""
        name = self.name_of(*names)
        bits = self._stored_bf16(name, shape)
        return bits if bits is not None else keep_bf16(self.f32(name, shape=shape))

    def _stored_bf16(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """`name`'s stored bits (uint16 of `shape`) where a checkpoint holds it as BF16, else None."""
        if not isinstance(self.index, SafetensorsIndex) or sys.byteorder != "little":
            return None
        info = self.index.info(name)
        if info.dtype != "BF16" or self._stored_blocks(name, shape) is not None:
            return None
        self._check_shape(name, info.shape, shape)
        return self.index.read_raw(name).view(np.uint16).reshape(shape)

    def kept(self, name: str) -> tuple[str, np.ndarray, np.ndarray] | None:
        """A matrix the source stores quantized (a GGUF's MXFP4 or Q8_0 expert) as stored
        (`GGUFTensorIndex.kept`), else None."""
        if isinstance(self.index, GGUFTensorIndex):
            return self.index.kept(name)
        return None

    def close(self) -> None:
        self.index.close()
