"""One routed expert of a family as named arrays in a fixed blob layout (the family store's expert blob, written by
`k3serve pack`), and back: the arrays of a blob viewed, without a copy, as the very expert the resident loader
builds at the same precision, so streamed and resident experts compute bit for bit the same.

Blob kinds (from the expert's class; the parts in blob order, each starting on a 64-byte boundary):
    bf16   BF16Expert       gate_up u16 [2I, H] | down u16 [H, I]
    f32    FloatExpert      gate_up f32 [2I, H] | down f32 [H, I]          (float32 checkpoints at "native")
    int8   QuantizedExpert  gate_up i8 [2I, H] | gate_up_scales f32 [2I] | down i8 [H, I] | down_scales f32 [H]
                            (a GGUF's Q8_0 experts: scales f32 [2I, H/32] and [H, I/32], one per block of 32)
    mxfp4  QuantizedExpert  {gate, up, down}_packed u8 [R, C/2] and {gate, up, down}_scales u8 [R, C/32]
Shapes: H hidden, I expert intermediate, R x C a matrix (gate, up [I, H]; down [H, I]).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from k3serve.errors import CheckpointError
from k3serve.model.families.experts import (BF16Expert, Expert, FloatExpert, Int8Matrix, MXFP4Matrix,
                                            QuantizedExpert)

BLOB_KINDS = ("bf16", "f32", "int8", "mxfp4")
PART_ALIGNMENT = 64


class BlobPart(NamedTuple):
    name: str
    dtype: str  # numpy dtype string: "<u2", "<f4", "|i1", "|u1"
    shape: tuple[int, ...]
    offset: int  # bytes into the blob
    nbytes: int

    def to_json(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @staticmethod
    def from_json(raw: list) -> BlobPart:
        name, dtype, shape, offset, nbytes = raw
        return BlobPart(str(name), str(dtype), tuple(int(d) for d in shape), int(offset), int(nbytes))


def expert_arrays(expert: Expert) -> tuple[str, dict[str, np.ndarray]]:
    """(kind, {part name: array}) of a packed expert, in blob order."""
    if isinstance(expert, BF16Expert):
        return "bf16", {"gate_up": expert.gate_up, "down": expert.down}
    if isinstance(expert, FloatExpert):
        return "f32", {"gate_up": expert.gate_up, "down": expert.down}
    if isinstance(expert, QuantizedExpert) and isinstance(expert.down, Int8Matrix):
        if expert.gate_up is None:
            raise CheckpointError("an int8 expert without its fused gate_up matrix cannot be packed")
        return "int8", {"gate_up": expert.gate_up.values, "gate_up_scales": expert.gate_up.scales,
                        "down": expert.down.values, "down_scales": expert.down.scales}
    if isinstance(expert, QuantizedExpert) and isinstance(expert.down, MXFP4Matrix):
        arrays = {}
        for name in ("gate", "up", "down"):
            matrix = getattr(expert, name)
            arrays[f"{name}_packed"], arrays[f"{name}_scales"] = matrix.packed, matrix.scales
        return "mxfp4", arrays
    raise CheckpointError(f"cannot pack an expert of type {type(expert).__name__}")


def blob_parts(arrays: dict[str, np.ndarray]) -> list[BlobPart]:
    """The blob layout of `arrays` (each part 64-byte aligned, in the given order)."""
    parts, offset = [], 0
    for name, array in arrays.items():
        offset = (offset + PART_ALIGNMENT - 1) // PART_ALIGNMENT * PART_ALIGNMENT
        parts.append(BlobPart(name, array.dtype.str, tuple(array.shape), offset, array.nbytes))
        offset += array.nbytes
    return parts


def blob_size(parts: list[BlobPart]) -> int:
    return max((p.offset + p.nbytes for p in parts), default=0)


def write_blob(arrays: dict[str, np.ndarray], parts: list[BlobPart], blob: bytearray | memoryview) -> None:
    """Copy `arrays` into `blob` at `parts`; an array whose dtype or shape differs from its part is an error."""
    if [p.name for p in parts] != list(arrays):
        raise CheckpointError(f"expert parts {list(arrays)} differ from the store's {[p.name for p in parts]}")
    for p in parts:
        array = arrays[p.name]
        if array.dtype.str != p.dtype or tuple(array.shape) != p.shape:
            raise CheckpointError(f"expert part {p.name}: {array.dtype.str} {list(array.shape)}, the store holds "
                                  f"{p.dtype} {list(p.shape)}")
        blob[p.offset:p.offset + p.nbytes] = np.ascontiguousarray(array).tobytes()


def view_expert(kind: str, parts: list[BlobPart], blob: np.ndarray) -> Expert:
    """blob: u8 [>= blob size] -> the expert of `kind` whose arrays are views into it (no copy)."""
    v = {p.name: blob[p.offset:p.offset + p.nbytes].view(np.dtype(p.dtype)).reshape(p.shape) for p in parts}
    if kind == "bf16":
        return BF16Expert(v["gate_up"], v["down"])
    if kind == "f32":
        return FloatExpert(v["gate_up"], v["down"])
    if kind == "int8":
        width = v["gate_up"].shape[0] // 2
        gate_up = Int8Matrix(v["gate_up"], v["gate_up_scales"])
        return QuantizedExpert(Int8Matrix(v["gate_up"][:width], v["gate_up_scales"][:width]),
                               Int8Matrix(v["gate_up"][width:], v["gate_up_scales"][width:]),
                               Int8Matrix(v["down"], v["down_scales"]), gate_up=gate_up)
    if kind == "mxfp4":
        return QuantizedExpert(*(MXFP4Matrix(v[f"{m}_packed"], v[f"{m}_scales"]) for m in ("gate", "up", "down")))
    raise CheckpointError(f"unknown expert blob kind {kind!r} (known: {', '.join(BLOB_KINDS)})")
