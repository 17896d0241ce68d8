"""Routed experts of the families, kept at a chosen precision, read from the checkpoint on first use.

An expert is a SiLU-GLU MLP: y = W_down (SiLU(W_gate x) * (W_up x)), W_gate and W_up [I, H], W_down [H, I].
The checkpoints ship experts in bf16 (or f32 in tests). The precision is a load option:
- "native" (alias "bf16"): the stored values, exactly. bf16 checkpoints stay bf16 in RAM (uint16 bits) and are
  multiplied by a kernel that widens each lane on the fly (`k3serve.model.kernels.dense_experts_run`); other
  stored values (float32 test checkpoints) are held as float32 and multiplied by the same kernel.
- "mxfp4": each matrix quantized row-wise to MXFP4 (K3_SPEC section 4, `k3serve.weights.mxfp4`) and multiplied by
  the fused kernel (`k3serve.model.kernels.mxfp4_experts_run`), as K3's experts are. Needs H and I multiples of 32.
- "int8": symmetric per-row 8-bit, w[r, c] ~ q[r, c] * s[r], s[r] = max_c |w[r, c]| / 127, q rounded to nearest;
  y = (x @ q^T) * s, by the same kernel as bf16.
A GGUF's Q8_0 experts (int8 with one f16 scale per block of 32 values) are kept as stored at "native" (int8
values and their float16 block scales apart: 1.0625 bytes a weight, the file's size; float32 scales, 1.125 bytes,
until 2026-12-07) and multiplied on Q8_0 activations (below), or by the same float kernel, each block's dot
scaled (`dense_experts_run`, which takes float32 scales: each routed expert's scales widened at its call).
One MoE layer's active experts run in ONE compiled call, as K3's do: the resident store keeps each layer's packed
experts in stacked [NE, ...] arrays (a packed expert is a view into its layer's stack; pages of experts never used
are never touched), and the kernel takes the stack, the active expert ids and the token rows of each. A streaming
store's experts live in slots, so it calls the same kernel once per expert on a stack of one (the same bits per
row: each output row is one row dot, whatever the other rows of the call).
Dense experts (float32, bf16, int8 with a scale per row) run the row dot's 2 x 4 tiles at every token count
(`dense_experts_run`: each dot the bits of the one-token row dot), until bf16 and float32 ones with
DENSE_BLAS_MIN_TOKENS tokens or more widen to float32 (a transient copy, never kept) and use BLAS. Block-scaled
ones (a GGUF's Q8_0 experts) on float activations (below) with DENSE_TILE_MIN_TOKENS or more run the tiled kernel
(`dense_experts_tiled`: each weight row widened once and multiplied by four tokens at a time, all such experts in
one compiled call). MXFP4 experts run the MXFP4 row dot at every count (`mxfp4_experts_run`; from
`kernels.MXFP4_TILE_TOKENS` tokens two rows against four tokens a pass, each dot the one-token bits), or with
`K3SERVE_MXFP4_ACTIVATIONS=q8` the int8 path, whose tiles serve 8 or 4 tokens a pass over a decoded row. A GGUF's
Q8_0 experts (block scales) multiply Q8_0 activations with int8 dot products at every token count by default
(`kernels.q8_0_experts_run`, llama.cpp's ggml_vec_dot_q8_0_q8_0 arithmetic on the file's numbers, as the file's
Q8_0 trunk matrices already did: 1.25-1.9x the float path's speed from 1 to 64 tokens an expert);
`K3SERVE_INT8_ACTIVATIONS=f32` keeps them on the float path above. With `K3SERVE_INT8_ACTIVATIONS=q8` the "int8"
experts (per-row scales, packed by k3serve) multiply Q8_0 activations too (`kernels.int8_experts_q8`, every token
count, one call); widths not multiples of 32 stay on the float path.
With `K3SERVE_BF16_ACTIVATIONS=bf16` (`--bf16-activations bf16`) bf16 experts run `kernels.bf16_experts_run` at
every token count instead.
Quantization happens once, when an expert is first read (the packing step); parity with transformers is checked
at "native". Shapes: n tokens routed to an expert, H hidden, I expert intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence, Union

import numpy as np

from k3serve.errors import CheckpointError, ConfigError
from k3serve.model import kernels
from k3serve.model.kernels import (bf16_experts_on, bf16_experts_run, dense_expert_reference, dense_experts_run,
                                   dense_experts_tiled, mxfp4_experts_run)
from k3serve.model.expert_source import ExpertSource
from k3serve.model.routing import ExpertPairs
from k3serve.weights.mxfp4 import GROUP_SIZE, dequantize_mxfp4, quantize_mxfp4

EXPERT_PRECISIONS = ("native", "mxfp4", "int8")
_ZERO = np.zeros(1, np.int64)
# a packed expert as the kernels take it: ("dense", (gate_up, gate_up scales or None, down, down scales or None))
# or ("mxfp4", (gate packed, gate scales, up packed, up scales, down packed, down scales)); stacked: [E, ...] each
ExpertParts = tuple[str, tuple]
# Tokens of one expert from which another kernel beats the row dot's 2 x 4 tiles (`dense_experts_run`), measured
# at Qwen3-30B-A3B's expert shape (768 x 2048, 16 experts a call, 2 cores; benchmarks/bench_dense_expert_paths.py,
# docs/BENCHMARKS.md "Experts at prefill: the row dot at every count"): per-row int8, bf16 and float32 experts take
# the row dot up to DENSE_BLAS_MIN_TOKENS (int8 0.76 / 2.34 / 4.80 ms an expert at 8 / 32 / 64 tokens; the float
# tile 1.15 / 3.42 / 6.77 ms), so a token's bits do not depend on how many others share its expert; bf16 and
# float32 then BLAS (bf16 at 256: 17.6 against 19.2 ms); int8 never BLAS (widening in numpy: 9-15 ms an expert).
# Block-scaled experts (a GGUF's Q8_0) have no row-dot tile: the float tile from DENSE_TILE_MIN_TOKENS (0.89 ms
# against 2.10 at 8 tokens, 6.40 against 16.26 at 64).
DENSE_TILE_MIN_TOKENS = 4
DENSE_BLAS_MIN_TOKENS = 256
PRECISION_ALIASES = {"bf16": "native"}


def normalize_precision(precision: str) -> str:
    name = PRECISION_ALIASES.get(precision, precision)
    if name not in EXPERT_PRECISIONS:
        choices = ", ".join(list(EXPERT_PRECISIONS) + list(PRECISION_ALIASES))
        raise ConfigError(f"unknown expert precision {precision!r} (choices: {choices})")
    return name


class Expert(Protocol):
    nbytes: int

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [n, H] -> [n, H]."""

    def parts(self) -> ExpertParts:
        """The arrays the kernels take (`ExpertParts`)."""


@dataclass(frozen=True)
class FloatExpert:
    gate_up: np.ndarray  # [2I, H]
    down: np.ndarray  # [H, I]

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return run_one_expert(self, x)

    def parts(self) -> ExpertParts:
        return "dense", (self.gate_up, None, self.down, None)


def is_bf16_exact(w: np.ndarray) -> bool:
    """True when every float32 value has zero low 16 bits (it came from bf16)."""
    return w.dtype == np.float32 and not np.any(w.view(np.uint32) & np.uint32(0xFFFF))


def _bf16_bits(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray((np.ascontiguousarray(w, np.float32).view(np.uint32) >> 16).astype(np.uint16))


@dataclass(frozen=True)
class BF16Expert:
    """A bf16 expert kept as its bf16 bits; no float32 copy is held."""

    gate_up: np.ndarray  # u16 [2I, H]
    down: np.ndarray  # u16 [H, I]

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return run_one_expert(self, x)

    def parts(self) -> ExpertParts:
        return "dense", (self.gate_up, None, self.down, None)


@dataclass(frozen=True)
class MXFP4Matrix:
    packed: np.ndarray  # u8 [R, C/2]
    scales: np.ndarray  # u8 [R, C/32]

    @classmethod
    def quantize(cls, w: np.ndarray) -> MXFP4Matrix:
        packed, scales = quantize_mxfp4(w)
        return cls(packed, scales)

    def dequantize(self) -> np.ndarray:
        return dequantize_mxfp4(self.packed, self.scales)


@dataclass(frozen=True)
class Int8Matrix:
    """Symmetric int8: w[r, c] = values[r, c] * scales[r] (our "int8"), or * scales[r, c // 32] (GGUF's Q8_0,
    kept as stored)."""

    values: np.ndarray  # i8 [R, C]
    scales: np.ndarray  # f32 [R] or [R, C/32]

    @classmethod
    def quantize(cls, w: np.ndarray) -> Int8Matrix:
        scales = np.max(np.abs(w), axis=1) / np.float32(127.0)  # [R]
        scales = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32)
        values = np.clip(np.rint(w / scales[:, None]), -127, 127).astype(np.int8)
        return cls(values, scales)

    def dequantize(self) -> np.ndarray:
        rows = self.values.shape[0]
        blocks = self.values.reshape(rows, self.scales.reshape(rows, -1).shape[1], -1).astype(np.float32)
        return (blocks * self.scales.reshape(rows, -1, 1)).reshape(self.values.shape)


StoredMatrix = Union[np.ndarray, MXFP4Matrix, Int8Matrix]  # a matrix as a checkpoint holds it


def widen(m: StoredMatrix) -> np.ndarray:
    """A stored matrix as float32 values (quantized ones dequantized)."""
    return m.dequantize() if isinstance(m, (MXFP4Matrix, Int8Matrix)) else m


@dataclass(frozen=True)
class QuantizedExpert:
    gate: MXFP4Matrix | Int8Matrix
    up: MXFP4Matrix | Int8Matrix
    down: MXFP4Matrix | Int8Matrix
    gate_up: Int8Matrix | None = None  # int8: gate and up as one [2I, H] matrix (gate and up are views into it)

    @property
    def nbytes(self) -> int:  # gate and up (views into gate_up for int8) counted once
        return sum(a.nbytes for m in (self.gate, self.up, self.down) for a in vars(m).values())

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return run_one_expert(self, x)

    def parts(self) -> ExpertParts:
        if isinstance(self.down, MXFP4Matrix):
            return "mxfp4", tuple(a for m in (self.gate, self.up, self.down) for a in (m.packed, m.scales))
        if self.gate_up is None:
            raise ConfigError("an int8 expert needs its fused gate_up matrix")
        return "dense", (self.gate_up.values, self.gate_up.scales, self.down.values, self.down.scales)


def expert_from_parts(expert: Expert, parts: tuple) -> Expert:
    """An expert of `expert`'s type over `parts` (the same shapes, e.g. views into a layer's stack)."""
    if isinstance(expert, (BF16Expert, FloatExpert)):
        return type(expert)(parts[0], parts[2])
    if len(parts) == 6:
        return QuantizedExpert(*(MXFP4Matrix(parts[i], parts[i + 1]) for i in (0, 2, 4)))
    gate_up, gate_up_scales, down, down_scales = parts
    width = gate_up.shape[0] // 2
    return QuantizedExpert(Int8Matrix(gate_up[:width], gate_up_scales[:width]),
                           Int8Matrix(gate_up[width:], gate_up_scales[width:]), Int8Matrix(down, down_scales),
                           gate_up=Int8Matrix(gate_up, gate_up_scales))


def run_experts(kind: str, stacked: tuple, pairs: ExpertPairs, x: np.ndarray) -> np.ndarray:
    """y [N, H]: y[n] = Expert_e(x[pairs.tokens[n]]) for e = pairs.expert_ids[k] on rows starts[k]:ends[k],
    every expert in one compiled call over the stacked parts [E, ...] (`kind`, `stacked`: `ExpertParts` of a
    stack): on Q8_0 activations where the int8 switch puts them there (a GGUF's Q8_0 experts by default), else
    the float kernels, except that block-scaled experts with DENSE_TILE_MIN_TOKENS tokens or more run the tiled
    kernel, and bf16 and float32 ones with DENSE_BLAS_MIN_TOKENS or more BLAS on a transient float32 copy (see the
    module's comment)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    ids, starts, ends, tokens = pairs.expert_ids, pairs.starts, pairs.ends, pairs.tokens
    if kind == "mxfp4":  # the row dot at every count (2 rows x 4 tokens a pass from kernels.MXFP4_TILE_TOKENS)
        return mxfp4_experts_run(stacked, ids, x, tokens, starts, ends, 0.0, 0.0, activation="silu")
    gate_up, gate_up_scales, down, down_scales = stacked
    if bf16_experts_on(gate_up, gate_up_scales):  # bf16 activations: one kernel at every count, the same bits
        return bf16_experts_run(gate_up, down, ids, x, tokens, starts, ends)
    if kernels.int8_experts_q8_on(gate_up, gate_up_scales, down):  # per-row int8 x Q8_0, every token count
        return kernels.int8_experts_q8(*stacked, ids, x, tokens, starts, ends)
    if kernels.q8_0_experts_on(gate_up, gate_up_scales, down):  # a GGUF's Q8_0 x Q8_0, every token count
        return kernels.q8_0_experts_run(*stacked, ids, x, tokens, starts, ends)
    if gate_up_scales is not None and gate_up_scales.dtype == np.float16:  # the float kernels take float32 scales
        return _half_scales_one_by_one(stacked, pairs, x)
    counts = ends - starts  # [K]
    block_scaled = gate_up_scales is not None and gate_up_scales.size > gate_up.shape[0] * gate_up.shape[1]
    tiled = (counts >= DENSE_TILE_MIN_TOKENS) & block_scaled  # [K]
    many = (counts >= DENSE_BLAS_MIN_TOKENS) & (gate_up_scales is None)  # [K]: bf16 and float32 only
    if not np.any(tiled | many):
        return dense_experts_run(*stacked, ids, x, tokens, starts, ends)
    out = np.empty((tokens.shape[0], x.shape[1]), np.float32)  # [N, H]
    if np.any(tiled):
        dense_experts_tiled(*stacked, ids[tiled], x, tokens, starts[tiled], ends[tiled], out=out)
    for k in np.flatnonzero(many):
        e = ids[k]
        out[starts[k]:ends[k]] = dense_expert_reference(gate_up[e], None, down[e], None, x[tokens[starts[k]:ends[k]]])
    few = ~(tiled | many)
    return dense_experts_run(*stacked, ids[few], x, tokens, starts[few], ends[few], out=out)


def _half_scales_one_by_one(stacked: tuple, pairs: ExpertPairs, x: np.ndarray) -> np.ndarray:
    """`run_experts` on float activations for Q8_0 experts held with their half-precision block scales (a GGUF's,
    as stored): each routed expert on a stack of one, its scales widened to float32 (exactly) for the float
    kernels. The same bits as the whole stack widened: a pair's output never depends on the other experts."""
    gate_up, gate_up_scales, down, down_scales = stacked
    out = np.empty((pairs.tokens.shape[0], x.shape[1]), np.float32)  # [N, H]
    for k, e in enumerate(pairs.expert_ids):
        start, end = int(pairs.starts[k]), int(pairs.ends[k])
        one = (gate_up[e:e + 1], gate_up_scales[e:e + 1].astype(np.float32), down[e:e + 1],
               down_scales[e:e + 1].astype(np.float32))
        out[start:end] = run_experts("dense", one, ExpertPairs(_ZERO, _ZERO, np.full(1, end - start, np.int64),
                                                               pairs.tokens[start:end], np.arange(end - start)), x)
    return out


def run_one_expert(expert: Expert, x: np.ndarray) -> np.ndarray:
    """x [n, H] -> [n, H] through `run_experts` on a stack of one (views, no copy)."""
    kind, parts = expert.parts()
    n = x.shape[0]
    return run_experts(kind, tuple(None if a is None else np.ascontiguousarray(a)[None] for a in parts),
                       ExpertPairs(_ZERO, _ZERO, np.full(1, n, np.int64), np.arange(n), np.arange(n)), x)


def pack_expert(gate: StoredMatrix, up: StoredMatrix, down: StoredMatrix, precision: str) -> Expert:
    """Float32 gate, up [I, H] and down [H, I] -> an expert at `precision`. MXFP4 matrices (a GGUF's experts)
    stay packed at "native" and "mxfp4"; "int8" requantizes their values. Q8_0 matrices (Int8Matrix with block
    scales) stay as stored at "native"; "int8" and "mxfp4" requantize their values."""
    if isinstance(gate, MXFP4Matrix) and isinstance(up, MXFP4Matrix) and isinstance(down, MXFP4Matrix) \
            and precision in ("native", "mxfp4"):
        return QuantizedExpert(gate, up, down)
    if isinstance(gate, Int8Matrix) and isinstance(up, Int8Matrix) and isinstance(down, Int8Matrix) \
            and precision == "native":
        gate_up = Int8Matrix(np.concatenate([gate.values, up.values]), np.concatenate([gate.scales, up.scales]))
        return _fused_int8(gate_up, gate.values.shape[0], down)
    gate, up, down = widen(gate), widen(up), widen(down)
    if precision == "native":
        if all(is_bf16_exact(m) for m in (gate, up, down)):
            return BF16Expert(_bf16_bits(np.concatenate([gate, up])), _bf16_bits(down))
        return FloatExpert(np.ascontiguousarray(np.concatenate([gate, up])), np.ascontiguousarray(down))
    if precision == "mxfp4":
        if gate.shape[1] % GROUP_SIZE or down.shape[1] % GROUP_SIZE:
            raise ConfigError(f"MXFP4 experts need hidden size and expert intermediate size that are multiples of "
                              f"{GROUP_SIZE}, got {gate.shape[1]} and {down.shape[1]}; use 'native' or 'int8'")
        return QuantizedExpert(*(MXFP4Matrix.quantize(m) for m in (gate, up, down)))
    if precision == "int8":
        # row-wise, so the same as gate and up apart
        return _fused_int8(Int8Matrix.quantize(np.concatenate([gate, up])), gate.shape[0], Int8Matrix.quantize(down))
    raise ConfigError(f"unknown expert precision {precision!r}")


def _fused_int8(gate_up: Int8Matrix, width: int, down: Int8Matrix) -> QuantizedExpert:
    """An int8 expert over its fused gate_up [2I, H] (gate rows then up rows; gate and up are views of it)."""
    return QuantizedExpert(Int8Matrix(gate_up.values[:width], gate_up.scales[:width]),
                           Int8Matrix(gate_up.values[width:], gate_up.scales[width:]), down, gate_up=gate_up)


# (layer, expert) -> (gate, up, down) as stored: float32 arrays, or a GGUF's MXFP4 / Q8_0 matrices
ExpertReader = Callable[[int, int], tuple[StoredMatrix, StoredMatrix, StoredMatrix]]


def outputs_one_by_one(experts: Mapping[int, Expert], pairs: ExpertPairs, x: np.ndarray) -> np.ndarray:
    """`run_experts` one expert at a time (ascending id), each on a stack of one: for experts that are not stacked
    (a streaming store's slots). The same bits as the one-call path."""
    y = np.empty((pairs.tokens.shape[0], x.shape[1]), np.float32)  # [N, H]
    for expert, start, end in zip(pairs.expert_ids, pairs.starts, pairs.ends):
        y[start:end] = experts[int(expert)](x[pairs.tokens[start:end]])
    return y


class ExpertStore(ExpertSource):
    """Every routed expert of a model, read (and packed) on first use into its layer's stack, then kept: the
    resident `ExpertSource` of the families (the streaming one is stream/family_source.py)."""

    def __init__(self, read: ExpertReader, precision: str, num_experts: int) -> None:
        self._read = read
        self.precision = normalize_precision(precision)
        self.num_experts = num_experts  # NE per MoE layer
        self._experts: dict[tuple[int, int], Expert] = {}
        self._stacks: dict[int, ExpertParts] = {}  # layer -> its experts' parts, stacked [NE, ...]

    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, Expert]:
        """The experts `expert_ids` of `layer` (a streaming store, stream/family_source.py, hands out views that
        stay valid until its next `experts` and reads them in ascending id order)."""
        return {int(e): self.get(layer, int(e)) for e in expert_ids}

    def get(self, layer: int, expert: int) -> Expert:
        key = (layer, expert)
        found = self._experts.get(key)
        if found is None:
            if not 0 <= expert < self.num_experts:
                raise IndexError(f"expert {expert} of layer {layer}: the model has {self.num_experts} experts")
            found = self._experts[key] = self._into_stack(layer, expert,
                                                          pack_expert(*self._read(layer, expert), self.precision))
        return found

    def _into_stack(self, layer: int, expert: int, packed: Expert) -> Expert:
        """`packed` copied into slot `expert` of its layer's stack (allocated on the layer's first expert; np.empty,
        so the slots of experts never used take no memory), returned as views of that slot."""
        kind, parts = packed.parts()
        if layer not in self._stacks:
            self._stacks[layer] = kind, tuple(None if a is None else np.empty((self.num_experts, *a.shape), a.dtype)
                                              for a in parts)
        stack_kind, stacked = self._stacks[layer]
        shapes = [None if a is None else (a.shape, a.dtype) for a in parts]
        if kind != stack_kind or shapes != [None if a is None else (a.shape[1:], a.dtype) for a in stacked]:
            raise CheckpointError(f"layer {layer}: expert {expert} is stored as {kind} {shapes}, the layer's other "
                                  f"experts otherwise; one MoE layer's experts must share their format")
        for a, into in zip(parts, stacked):
            if a is not None:
                into[expert] = a
        return expert_from_parts(packed, tuple(None if a is None else a[expert] for a in stacked))

    def expert_outputs(self, layer: int, pairs: ExpertPairs, x: np.ndarray) -> np.ndarray:
        """y [N, H] of every (token, expert) pair of `pairs` (`run_experts`), the layer's experts in one call."""
        for expert in pairs.expert_ids:
            self.get(layer, int(expert))
        kind, stacked = self._stacks[layer]
        return run_experts(kind, stacked, pairs, x)

    def packed(self, layer: int, expert: int) -> Expert:
        """The expert read and packed at the store's precision as `get` packs it, but not kept (for `pack`, which
        visits every expert once)."""
        return pack_expert(*self._read(layer, expert), self.precision)

    def read(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The expert's float32 (gate, up, down) as stored in the checkpoint, bypassing the packed copy."""
        gate, up, down = self._read(layer, expert)
        return widen(gate), widen(up), widen(down)

    def loaded(self) -> dict[tuple[int, int], Expert]:
        """(layer, expert) -> packed expert, for every expert used so far."""
        return dict(self._experts)

    @property
    def num_loaded(self) -> int:
        return len(self._experts)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._experts.values())

    def describe(self) -> str:
        return f"resident experts ({self.precision})"
