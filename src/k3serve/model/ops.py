"""Small elementwise and normalisation ops shared by the model layers (numpy, float32).

    RMSNorm(x, w) = x / sqrt(mean(x^2) + eps) * w
    SiTU-GLU(g, u) = b1 tanh(g / b1) * sigmoid(g) * b2 tanh(u / b2)      (K3: b1 = 4, b2 = 25)
"""

from __future__ import annotations

import numpy as np

from k3serve.model.fused_ops import l2_normalize_into, rms_norm_into


def sigmoid(x: np.ndarray) -> np.ndarray:
    # one ufunc, no overflow for large |x|; absolute error ~1e-7, which is all the gates and decays need
    return np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * x)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis; `weight` None means no weight. float32 rows with a float32 [H] weight run the
    compiled stage (fused_ops.rms_norm_into: one call, the bits of the numpy lines below)."""
    width = x.shape[-1] if x.ndim else 0
    if (weight is not None and x.dtype == np.float32 and weight.dtype == np.float32 and x.size
            and weight.shape == (width,)):
        out = np.empty(x.shape, np.float32)
        rms_norm_into(np.ascontiguousarray(x).reshape(-1, width), weight, np.float32(eps), out.reshape(-1, width))
        return out
    variance = np.add.reduce(np.square(x), axis=-1, keepdims=True)
    np.true_divide(variance, x.shape[-1], out=variance)  # np.mean's bits without its Python overhead
    out = x / np.sqrt(variance + np.float32(eps))
    return out * weight if weight is not None else out


def situ_glu(gate: np.ndarray, up: np.ndarray, beta: float, linear_beta: float,
             out: np.ndarray | None = None) -> np.ndarray:
    """beta tanh(gate / beta) sigmoid(gate) * linear_beta tanh(up / linear_beta), multiplied in that order; `out`
    (which may be `gate`) receives it instead of a new array."""
    b1, b2 = np.float32(beta), np.float32(linear_beta)
    sig = sigmoid(gate)  # before `out` (maybe gate) is written
    up_term = np.divide(up, b2)
    np.tanh(up_term, out=up_term)
    up_term *= b2
    out = np.divide(gate, b1, out=out)
    np.tanh(out, out=out)
    out *= b1
    out *= sig
    out *= up_term
    return out


def l2_normalize(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Divide by sqrt(sum of squares + eps) over the last axis (float32 rows: one compiled call with the bits of
    the numpy line, fused_ops.l2_normalize_into)."""
    if x.dtype == np.float32 and x.size:
        out = np.empty(x.shape, np.float32)
        width = x.shape[-1]
        l2_normalize_into(np.ascontiguousarray(x).reshape(-1, width), np.float32(eps), out.reshape(-1, width))
        return out
    return x / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True) + np.float32(eps))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)
