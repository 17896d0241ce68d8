"""A dense matrix held in its quantized bytes (Q8_0 or MXFP4): the trunk's matrices at a quantized trunk precision.

Shape letters: R = rows, C = columns, G = C / 32 blocks per row.

    q8_0   data uint8 [R, G * 34] (llama.cpp's blocks, `k3serve.weights.q8_0`), scales None
    mxfp4  data uint8 [R, C / 2] packed nibbles, scales uint8 [R, G] E8M0 bytes (`k3serve.weights.mxfp4`)

`k3serve.model.kernels.linear` multiplies one straight from these bytes. In a packed store's trunk file a matrix is
one tensor entry of dtype "Q8_0" or "MXFP4" (`to_bytes` / `from_bytes`). An MXFP4 entry is laid out by rows (store
format 3): each row's C / 2 nibble bytes, then its G scale bytes, 17 C / 32 bytes a row, so that `data` and `scales`
are two strided views of the entry, a fused group's parts back to back are one matrix, and a row is one read (as a
Q8_0 row is). Stores of format 1 and 2 hold an MXFP4 entry planar: all the nibbles, then all the scales
(`rows=False`): it decodes to views too, but a fused group of them is not one matrix, nor a row one read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from k3serve.weights.bf16 import bf16_bits_to_f32
from k3serve.weights.mxfp4 import dequantize_mxfp4, mxfp4_nbytes, quantize_mxfp4
from k3serve.weights.q8_0 import BLOCK_BYTES, GROUP_SIZE, dequantize_q8_0, q8_0_nbytes, quantize_q8_0

TRUNK_PRECISIONS = ("bf16", "q8_0", "mxfp4")  # `k3serve pack --trunk-precision`; bf16 keeps the stored bytes
# `generate` / `serve` / `load_model(trunk_precision=...)`: the trunk matrices as stored ("native", alias "bf16"), or
# quantized at load to Q8_0 / MXFP4 (`quantize_matrix`), as `pack --trunk-precision` stores them
LOAD_TRUNK_PRECISIONS = ("native", "bf16", "q8_0", "mxfp4")
QUANTIZE_BLOCK_ROWS = 4096  # rows widened to float32 at a time by `quantize_matrix` (a bounded transient)
STORE_DTYPES = {"q8_0": "Q8_0", "mxfp4": "MXFP4"}  # trunk-file tensor dtype of each quantized precision


def check_load_trunk_precision(precision: str) -> str:
    """`precision` normalized ("bf16" -> "native"); an unknown one is a ValueError naming the known ones."""
    if precision not in LOAD_TRUNK_PRECISIONS:
        raise ValueError(f"unknown trunk precision {precision!r}; choose one of {', '.join(LOAD_TRUNK_PRECISIONS)}")
    return "native" if precision == "bf16" else precision


def quantize_matrix(values: np.ndarray | QuantizedMatrix, precision: str,
                    block_rows: int = QUANTIZE_BLOCK_ROWS) -> QuantizedMatrix:
    """A trunk matrix quantized at load: bf16 bits (uint16), float values or another precision's bytes [R, C] ->
    `precision` ("q8_0" / "mxfp4"), `block_rows` rows at a time, so that a 600 MB bf16 lm_head never exists
    widened in full. The same bytes as `QuantizedMatrix.quantize` of the whole float32 matrix (rows are
    independent); bytes already at `precision` are returned as they are."""
    if isinstance(values, QuantizedMatrix):
        if values.precision == precision:
            return values
    elif values.ndim != 2 or values.shape[1] % GROUP_SIZE:
        raise ValueError(f"{precision} needs a [R, C] matrix with C % {GROUP_SIZE} == 0, got {values.shape}")
    rows, cols = values.shape
    if precision == "q8_0":
        data = np.empty((rows, cols // GROUP_SIZE * BLOCK_BYTES), np.uint8)
        scales = None
    elif precision == "mxfp4":
        data, scales = np.empty((rows, cols // 2), np.uint8), np.empty((rows, cols // GROUP_SIZE), np.uint8)
    else:
        raise ValueError(f"unknown quantized precision {precision!r} (known: {', '.join(STORE_DTYPES)})")
    for start in range(0, rows, max(1, block_rows)):
        end = min(rows, start + max(1, block_rows))
        if isinstance(values, QuantizedMatrix):
            part = QuantizedMatrix(values.precision, values.data[start:end],
                                   None if values.scales is None else values.scales[start:end], cols).dequantize()
        elif values.dtype == np.uint16:  # bf16 bits: widening is exact
            part = bf16_bits_to_f32(values[start:end])
        else:
            part = np.asarray(values[start:end], dtype=np.float32)
        chunk = QuantizedMatrix.quantize(part, precision)
        data[start:end] = chunk.data
        if scales is not None:
            scales[start:end] = chunk.scales
    return QuantizedMatrix(precision, data, scales, cols)


def quantized_nbytes(precision: str, rows: int, cols: int) -> int:
    if precision == "q8_0":
        return q8_0_nbytes(rows, cols)
    if precision == "mxfp4":
        return mxfp4_nbytes(rows, cols)
    raise ValueError(f"unknown quantized precision {precision!r} (known: {', '.join(STORE_DTYPES)})")


@dataclass(frozen=True)
class QuantizedMatrix:
    """A [rows, cols] matrix as its Q8_0 or MXFP4 bytes (see the module docstring)."""

    precision: str  # "q8_0" or "mxfp4"
    data: np.ndarray  # uint8 [R, G * 34] (q8_0) or [R, C / 2] (mxfp4)
    scales: np.ndarray | None  # uint8 [R, G] (mxfp4), None (q8_0: the scales are inside the blocks)
    cols: int

    def __post_init__(self) -> None:
        rows = self.data.shape[0] if self.data.ndim == 2 else -1
        if self.data.dtype != np.uint8 or rows < 0 or self.cols % GROUP_SIZE:
            raise ValueError(f"{self.precision} matrix: data must be uint8 [R, ...] and C % {GROUP_SIZE} == 0")
        if self.precision == "q8_0":
            ok = self.scales is None and self.data.shape[1] == self.cols // GROUP_SIZE * BLOCK_BYTES
        elif self.precision == "mxfp4":
            ok = (self.scales is not None and self.data.shape[1] == self.cols // 2
                  and self.scales.shape == (rows, self.cols // GROUP_SIZE) and self.scales.dtype == np.uint8)
        else:
            raise ValueError(f"unknown quantized precision {self.precision!r} (known: {', '.join(STORE_DTYPES)})")
        if not ok:
            raise ValueError(f"{self.precision} bytes {self.data.shape} do not hold a [{rows}, {self.cols}] matrix")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    @property
    def store_dtype(self) -> str:
        return STORE_DTYPES[self.precision]

    @staticmethod
    def quantize(x: np.ndarray, precision: str) -> QuantizedMatrix:
        """float32 [R, C] -> the matrix at `precision` (llama.cpp's Q8_0 encoder, or K3_SPEC's MXFP4 encoder)."""
        x = np.asarray(x, dtype=np.float32)
        if precision == "q8_0":
            return QuantizedMatrix("q8_0", quantize_q8_0(x), None, x.shape[1])
        if precision == "mxfp4":
            packed, scales = quantize_mxfp4(x)
            return QuantizedMatrix("mxfp4", packed, scales, x.shape[1])
        raise ValueError(f"unknown quantized precision {precision!r} (known: {', '.join(STORE_DTYPES)})")

    def dequantize(self) -> np.ndarray:
        """float32 [R, C], exact."""
        if self.precision == "q8_0":
            return dequantize_q8_0(self.data)
        assert self.scales is not None
        return dequantize_mxfp4(self.data, self.scales)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` [T] decoded to float32 [T, C] (an embedding lookup)."""
        ids = np.asarray(ids)
        scales = None if self.scales is None else self.scales[ids]
        return QuantizedMatrix(self.precision, self.data[ids], scales, self.cols).dequantize()

    def copy(self) -> QuantizedMatrix:
        return QuantizedMatrix(self.precision, self.data.copy(), None if self.scales is None else self.scales.copy(),
                               self.cols)

    def to_bytes(self, rows: bool = True) -> bytes:
        """The trunk-file entry: Q8_0 blocks; MXFP4 by rows (each row's nibbles, then its scales), or with
        `rows=False` planar (every nibble, then every scale: stores of format 1 and 2)."""
        if self.scales is None:
            return self.data.tobytes()
        if not rows:
            return self.data.tobytes() + self.scales.tobytes()
        return np.concatenate([self.data, self.scales], axis=1).tobytes()  # [R, C/2 + G]

    @staticmethod
    def from_bytes(store_dtype: str, raw: np.ndarray, shape: tuple[int, ...], rows: bool = True) -> QuantizedMatrix:
        """Views into raw u8 [nbytes] (a trunk-file entry of dtype "Q8_0" or "MXFP4", laid out as `to_bytes(rows)`
        writes it) as a [R, C] matrix; no byte is copied."""
        precisions = {v: k for k, v in STORE_DTYPES.items()}
        if store_dtype not in precisions or len(shape) != 2:
            raise ValueError(f"not a quantized 2-D trunk entry: {store_dtype} {shape}")
        precision, (num_rows, cols) = precisions[store_dtype], shape
        if raw.size != quantized_nbytes(precision, num_rows, cols):
            raise ValueError(f"{store_dtype} [{num_rows}, {cols}] needs "
                             f"{quantized_nbytes(precision, num_rows, cols)} bytes, got {raw.size}")
        if precision == "q8_0":
            return QuantizedMatrix(precision, raw.reshape(num_rows, -1), None, cols)
        if rows:
            by_row = raw.reshape(num_rows, cols // 2 + cols // GROUP_SIZE)  # [R, C/2 + G]
            return QuantizedMatrix(precision, by_row[:, :cols // 2], by_row[:, cols // 2:], cols)
        split = num_rows * cols // 2
        return QuantizedMatrix(precision, raw[:split].reshape(num_rows, cols // 2),
                               raw[split:].reshape(num_rows, cols // GROUP_SIZE), cols)

    def take_rows(self, rows: np.ndarray) -> QuantizedMatrix:
        """Rows `rows` [R'] of the matrix, in that order (a copy). Exact: a row's blocks are its own."""
        scales = None if self.scales is None else np.ascontiguousarray(self.scales[rows])
        return QuantizedMatrix(self.precision, np.ascontiguousarray(self.data[rows]), scales, self.cols)

    @staticmethod
    def stack(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
        """Row-wise concatenation of matrices of one precision and width (a fused projection)."""
        first = parts[0]
        if any(p.precision != first.precision or p.cols != first.cols for p in parts):
            raise ValueError("only matrices of one precision and width stack")
        scales = None if first.scales is None else np.concatenate([p.scales for p in parts])  # type: ignore
        return QuantizedMatrix(first.precision, np.concatenate([p.data for p in parts]), scales, first.cols)


@dataclass(frozen=True)
class MappedQuantizedMatrix(QuantizedMatrix):
    """A matrix read in place from a mapped file (an untied GGUF Q8_0 embedding): the pages lookups fault in are
    dropped from the process after them (`after_rows(ids)`, told the rows read: the GGUF's dropper drops every 8
    rows, `gguf_file.DROP_EVERY_ROWS`; `after_rows()` at once). A fault on a mapped file maps the pages around it
    too (64 KB on Linux), so the 2,000-3,000 random rows a benchmark's prompts look up in a 163,840-row embedding
    made 170-190 MB resident, more than the copy they saved."""
    after_rows: Callable[..., None] | None = field(default=None, compare=False, repr=False)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        try:
            return super().rows(ids)
        finally:
            if self.after_rows is not None:
                self.after_rows(np.asarray(ids))

