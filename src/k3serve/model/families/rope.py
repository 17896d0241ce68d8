"""Rotary position embedding (RoPE), with the YaRN frequency scaling used by DeepSeek-V3 / Kimi K2.

RoFormer (Su et al. 2021), eq. 34: a pair (x1, x2) of a head's rotated dims at position p and frequency f becomes
    (x1 cos(p f) - x2 sin(p f),  x2 cos(p f) + x1 sin(p f)),      f_i = theta^(-2i / d),  i = 0 .. d/2 - 1.
Pairs are laid out two ways:
    half:        (x[i], x[i + d/2])          (Llama / Qwen "rotate_half")
    interleaved: (x[2i], x[2i + 1])          (DeepSeek's released layout, `rope_interleave: true`)
The interleaved output is written as [rotated x[0::2] | rotated x[1::2]]. That permutes the dims, the same way for
queries and keys, so every q.k product is unchanged.
Only the first `rotary_dim` dims of a head rotate (Qwen3-Next: partial_rotary_factor 0.25); the rest pass through.

YaRN (Peng et al. 2023, "YaRN", section 3.2 and eq. 17-21), with factor s and the pretraining length L:
    f_i' = f_i / s * (1 - gamma_i) + f_i * gamma_i,   gamma_i = 1 - clamp((i - low) / (high - low), 0, 1)
    low, high = floor / ceil of d * ln(L / (2 pi beta)) / (2 ln theta) for beta = beta_fast, beta_slow
and cos, sin are multiplied by the attention factor mscale(s, mscale) / mscale(s, mscale_all_dim), where
mscale(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1).

Shapes: T tokens, NH heads, d rotary dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from k3serve.errors import ConfigError
from k3serve.model.fused_ops import rotate_into

SUPPORTED_ROPE_TYPES = ("default", "yarn")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class Rotary:
    inv_freq: np.ndarray  # [d/2] float32
    attention_factor: float  # multiplies cos and sin (YaRN); 1.0 otherwise
    interleaved: bool

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """positions [T] -> (cos, sin), each [T, d/2] float32."""
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]  # [T, d/2]
        factor = np.float32(self.attention_factor)
        return np.cos(freqs) * factor, np.sin(freqs) * factor

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x [T, NH, D] (D >= d) -> rotated copy; cos, sin [T, d/2]."""
        if x.dtype == np.float32 and cos.dtype == np.float32 and sin.dtype == np.float32:
            out = np.empty(x.shape, np.float32)  # one compiled call, the bits of the numpy lines below
            rotate_into(x, cos, sin, self.interleaved, out)
            return out
        d = self.rotary_dim
        rot, rest = x[..., :d], x[..., d:]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot[..., : d // 2], rot[..., d // 2:]
        c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, d/2]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)


def rotary_from_config(parameters: Mapping[str, Any], rotary_dim: int, max_position_embeddings: int | None,
                       interleaved: bool, where: str) -> Rotary:
    """Build the embedding from a `rope_parameters` dict (rope_type, rope_theta and the YaRN keys)."""
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type {rope_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if "rope_theta" not in parameters:
        raise ConfigError(f"{where}: missing key 'rope_theta'")
    if rotary_dim % 2 or rotary_dim <= 0:
        raise ConfigError(f"{where}: the rotary dimension must be even and positive, got {rotary_dim}")
    base = float(parameters["rope_theta"])
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim  # [d/2]
    inv_freq = 1.0 / base ** exponents
    attention_factor = 1.0
    if rope_type == "yarn":
        original = parameters.get("original_max_position_embeddings", max_position_embeddings)
        if original is None:
            raise ConfigError(f"{where}: YaRN needs 'original_max_position_embeddings'")
        factor = parameters.get("factor")
        if factor is None:
            if max_position_embeddings is None:
                raise ConfigError(f"{where}: YaRN needs 'factor' or 'max_position_embeddings'")
            factor = max_position_embeddings / original
        factor = float(factor)
        # the defaults below are YaRN's own (paper section 3.2), also transformers' when a key is absent
        beta_fast = float(parameters.get("beta_fast") or 32)
        beta_slow = float(parameters.get("beta_slow") or 1)
        mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
        if parameters.get("attention_factor") is not None:
            attention_factor = float(parameters["attention_factor"])
        elif mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)

        def correction_dim(num_rotations: float) -> float:
            return rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if parameters.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001  # a one-point ramp would divide by zero
        ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        keep = 1.0 - ramp  # gamma_i: 1 keeps the original (extrapolated) frequency
        inv_freq = inv_freq / factor * (1.0 - keep) + inv_freq * keep
    return Rotary(inv_freq=inv_freq.astype(np.float32), attention_factor=attention_factor, interleaved=interleaved)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of an `HFConfig`: `rope_parameters` (transformers 5), else `rope_scaling` plus the root
    `rope_theta` (released checkpoints)."""
    params = config.get("rope_parameters", default=None)
    if params is None:
        params = config.get("rope_scaling", default=None) or {}
    if not isinstance(params, dict):
        raise config.error("rope_parameters / rope_scaling must be an object")
    params = dict(params)
    if "rope_theta" not in params:
        params["rope_theta"] = config.number("rope_theta")
    return params
