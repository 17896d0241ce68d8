"""Routed experts of the families, kept at a chosen precision, read from the checkpoint on first use.

An expert is a SiLU-GLU MLP: y = W_down (SiLU(W_gate x) * (W_up x)), W_gate and W_up [I, H], W_down [H, I].
The checkpoints ship experts in bf16 (or f32 in tests). The precision is a load option:
- "native" (alias "bf16"): the stored values, exactly. bf16 checkpoints stay bf16 in RAM (uint16 bits) and are
  multiplied by a kernel that widens each lane on the fly (`k3serve.model.kernels.dense_expert_forward`); other
  stored values (float32 test checkpoints) are held as float32.
- "mxfp4": each matrix quantized row-wise to MXFP4 (K3_SPEC section 4, `k3serve.weights.mxfp4`) and multiplied by
  the fused kernel (`k3serve.model.kernels.mxfp4_matmul`), as K3's experts are. Needs H and I multiples of 32.
- "int8": symmetric per-row 8-bit, w[r, c] ~ q[r, c] * s[r], s[r] = max_c |w[r, c]| / 127, q rounded to nearest;
  y = (x @ q^T) * s, in one compiled call per expert (the same kernel as bf16).
Prefill batches of DENSE_KERNEL_MAX_TOKENS tokens or more widen one expert at a time to float32 (a transient
copy, never kept) and use BLAS, which reuses each weight across tokens better than the row-dot kernel.
Quantization happens once, when an expert is first read (the packing step); parity with transformers is checked
at "native". Shapes: n tokens routed to an expert, H hidden, I expert intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from k3serve.errors import ConfigError
from k3serve.model.kernels import dense_expert_forward, mxfp4_experts_run, mxfp4_matmul, stack_expert
from k3serve.model.ops import silu
from k3serve.weights.mxfp4 import GROUP_SIZE, dequantize_mxfp4, quantize_mxfp4

EXPERT_PRECISIONS = ("native", "mxfp4", "int8")
_ZERO = np.zeros(1, np.int64)
DENSE_KERNEL_MAX_TOKENS = 32
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


@dataclass(frozen=True)
class FloatExpert:
    gate_up: np.ndarray  # [2I, H]
    down: np.ndarray  # [H, I]

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def __call__(self, x: np.ndarray) -> np.ndarray:
        h = x @ self.gate_up.T  # [n, 2I]
        width = self.down.shape[1]
        return (silu(h[:, :width]) * h[:, width:]) @ self.down.T


def is_bf16_exact(w: np.ndarray) -> bool:
    """True when every float32 value has zero low 16 bits (it came from bf16)."""
    return w.dtype == np.float32 and not np.any(w.view(np.uint32) & np.uint32(0xFFFF))


def _bf16_bits(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray((np.ascontiguousarray(w, np.float32).view(np.uint32) >> 16).astype(np.uint16))


def _widen_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class BF16Expert:
    """A bf16 expert kept as its bf16 bits; no float32 copy is held."""

    gate_up: np.ndarray  # u16 [2I, H]
    down: np.ndarray  # u16 [H, I]

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape[0] >= DENSE_KERNEL_MAX_TOKENS:
            return FloatExpert(_widen_bf16(self.gate_up), _widen_bf16(self.down))(x)
        return dense_expert_forward(self.gate_up, _ones(self.gate_up.shape[0]), self.down,
                                    _ones(self.down.shape[0]), x)


def _ones(n: int) -> np.ndarray:
    return np.ones(n, np.float32)


@dataclass(frozen=True)
class MXFP4Matrix:
    packed: np.ndarray  # u8 [R, C/2]
    scales: np.ndarray  # u8 [R, C/32]

    @classmethod
    def quantize(cls, w: np.ndarray) -> MXFP4Matrix:
        packed, scales = quantize_mxfp4(w)
        return cls(packed, scales)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        return mxfp4_matmul(self.packed, self.scales, x)

    def dequantize(self) -> np.ndarray:
        return dequantize_mxfp4(self.packed, self.scales)


@dataclass(frozen=True)
class Int8Matrix:
    values: np.ndarray  # i8 [R, C]
    scales: np.ndarray  # f32 [R]

    @classmethod
    def quantize(cls, w: np.ndarray) -> Int8Matrix:
        scales = np.max(np.abs(w), axis=1) / np.float32(127.0)  # [R]
        scales = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32)
        values = np.clip(np.rint(w / scales[:, None]), -127, 127).astype(np.int8)
        return cls(values, scales)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        # NOTE: widens the int8 matrix on every call; a fused int8 kernel is a TODO if int8 experts matter
        return (x @ self.values.T.astype(np.float32)) * self.scales

    def dequantize(self) -> np.ndarray:
        return self.values.astype(np.float32) * self.scales[:, None]


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
        x = np.ascontiguousarray(x, dtype=np.float32)
        if isinstance(self.gate, MXFP4Matrix):  # one fused call: w1 and w3 rows together, SiLU-GLU, then w2
            stacked = stack_expert(*((m.packed, m.scales) for m in (self.gate, self.up, self.down)))
            n = x.shape[0]
            return mxfp4_experts_run(stacked, _ZERO, x, np.arange(n), _ZERO, np.full(1, n, np.int64), 0.0, 0.0,
                                     activation="silu")
        if self.gate_up is not None and isinstance(self.down, Int8Matrix) and x.shape[0] < DENSE_KERNEL_MAX_TOKENS:
            return dense_expert_forward(self.gate_up.values, self.gate_up.scales, self.down.values,
                                        self.down.scales, x)
        hidden = silu(self.gate.matmul(x)) * self.up.matmul(x)  # [n, I]
        return self.down.matmul(np.ascontiguousarray(hidden))


def pack_expert(gate: np.ndarray, up: np.ndarray, down: np.ndarray, precision: str) -> Expert:
    """Float32 gate, up [I, H] and down [H, I] -> an expert at `precision`. MXFP4 matrices (a GGUF's experts)
    stay packed at "native" and "mxfp4"; "int8" requantizes their values."""
    if all(isinstance(m, MXFP4Matrix) for m in (gate, up, down)):
        if precision in ("native", "mxfp4"):
            return QuantizedExpert(gate, up, down)  # type: ignore[arg-type]
        gate, up, down = (m.dequantize() for m in (gate, up, down))  # type: ignore[union-attr]
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
        gate_up = Int8Matrix.quantize(np.concatenate([gate, up]))  # row-wise, so the same as gate and up apart
        width = gate.shape[0]
        return QuantizedExpert(Int8Matrix(gate_up.values[:width], gate_up.scales[:width]),
                               Int8Matrix(gate_up.values[width:], gate_up.scales[width:]),
                               Int8Matrix.quantize(down), gate_up=gate_up)
    raise ConfigError(f"unknown expert precision {precision!r}")


ExpertReader = Callable[[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]


class ExpertStore:
    """Every routed expert of a model, read (and packed) on first use, then kept."""

    def __init__(self, read: ExpertReader, precision: str) -> None:
        self._read = read
        self.precision = normalize_precision(precision)
        self._experts: dict[tuple[int, int], Expert] = {}

    prefetching = False  # a resident store has nothing to read ahead
    plan = None  # a streaming store's RAM budget plan (stream/budget.py)

    def fetch(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, Expert]:
        """The experts `expert_ids` of `layer` (a streaming store, stream/family_source.py, hands out views that
        stay valid until its next `fetch` and reads them in ascending id order)."""
        return {int(e): self.get(layer, int(e)) for e in expert_ids}

    def get(self, layer: int, expert: int) -> Expert:
        key = (layer, expert)
        found = self._experts.get(key)
        if found is None:
            found = self._experts[key] = pack_expert(*self._read(layer, expert), self.precision)
        return found

    def read(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The expert's float32 (gate, up, down) as stored in the checkpoint, bypassing the packed copy."""
        matrices = self._read(layer, expert)
        return tuple(m.dequantize() if isinstance(m, MXFP4Matrix) else m for m in matrices)  # type: ignore

    def loaded(self) -> dict[tuple[int, int], Expert]:
        """(layer, expert) -> packed expert, for every expert used so far."""
        return dict(self._experts)

    @property
    def num_loaded(self) -> int:
        return len(self._experts)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._experts.values())

    # ---- the capabilities a streaming store offers, with a resident store's defaults (as WeightSource's) -------
    def begin_step(self, num_tokens: int) -> None:
        """A forward over `num_tokens` positions starts."""

    def prefetch(self, layer: int, guesses: Sequence[int]) -> None:
        """Guessed experts of `layer`, best first, may be read ahead."""

    def resident_experts(self, layer: int) -> set[int] | None:
        return None

    def stream_stats(self) -> None:
        return None

    def describe(self) -> str:
        return f"resident experts ({self.precision})"

    def check_integrity(self) -> None:
        """Nothing to check: a dict."""

    def close(self) -> None:
        """Nothing to release."""
