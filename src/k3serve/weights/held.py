"""Which trunk tensors stay bf16 in RAM, and the bytes a built trunk blob holds: a fact about the released tensor
names, shared by the model (which builds the layers, model/weights.py) and the budget splitter (stream/budget.py)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from k3serve.weights.quantized import STORE_DTYPES, quantized_nbytes

TRUNK_DTYPES = ("float32", "bf16")
# Trunk matrices held as bf16 bits whatever the trunk dtype (the big MLP matrices) ...
BF16_ALWAYS = ("mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.", "shared_experts.", "routed_expert_down_proj.",
               "routed_expert_up_proj.")
# ... and, with a bf16 trunk, the attention projections, the embedding and the lm_head too. Everything else (norms,
# conv taps, decay, routers, the per-head kv_b halves) is widened to float32 in both.
BF16_IN_BF16_TRUNK = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "self_attn.g_proj.",
                      "self_attn.o_proj.", "self_attn.f_a_proj.", "self_attn.b_proj.", "self_attn.q_a_proj.",
                      "self_attn.kv_a_proj_with_mqa.", "self_attn.q_b_proj.", "embed_tokens.", "lm_head.")
# projections fused into one matrix at build time: bf16 only when every part is
FUSED_GROUPS = (("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "self_attn.g_proj.",
                 "self_attn.f_a_proj.", "self_attn.b_proj."),
                ("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa.", "self_attn.g_proj."))


def quantized_in_trunk(name: str, shape: Sequence[int]) -> bool:
    """Whether `pack --trunk-precision q8_0|mxfp4` quantizes this tensor: every matrix a bf16 trunk keeps as bf16
    (the embedding and the lm_head included, as llama.cpp's Q8_0 files do) whose rows are whole 32-blocks. The
    parts of a fused group share their width, so they are quantized alike."""
    keys = BF16_ALWAYS + BF16_IN_BF16_TRUNK
    return len(shape) == 2 and shape[1] % 32 == 0 and any(k in name for k in keys)


_PRECISIONS = {dtype: precision for precision, dtype in STORE_DTYPES.items()}  # "Q8_0" -> "q8_0", ...


def _quantized_bytes(dtype: str, shape: Sequence[int]) -> int:
    return quantized_nbytes(_PRECISIONS[dtype], *shape)


def bf16_rule(name: str, trunk_dtype: str) -> bool:
    keys = BF16_ALWAYS + (BF16_IN_BF16_TRUNK if trunk_dtype == "bf16" else ())
    return any(k in name for k in keys)


def kept_as_bf16(tensors: Sequence[tuple[str, str, tuple[int, ...]]], trunk_dtype: str = "float32") -> list[bool]:
    """For tensors (name, stored dtype, shape) of one trunk blob: whether the built weights hold each as its bf16
    bits (a bf16-stored matrix the trunk dtype keeps as bf16; a fused group only when all its parts are
    bf16-stored); the rest are widened to float32."""
    if trunk_dtype not in TRUNK_DTYPES:
        raise ValueError(f"trunk dtype must be one of {', '.join(TRUNK_DTYPES)}, got {trunk_dtype!r}")
    stored = {name: dtype for name, dtype, _ in tensors}
    kept = []
    for name, dtype, _shape in tensors:
        bf16 = dtype == "BF16" and bf16_rule(name, trunk_dtype)
        for group in FUSED_GROUPS:
            if bf16 and any(k in name for k in group):
                prefix = name[:name.index("self_attn.")]
                parts = [n for n in stored if n.startswith(prefix) and any(k in n for k in group)]
                bf16 = all(stored[n] == "BF16" for n in parts)
        kept.append(bf16)
    return kept


def held_bytes(tensors: Sequence[tuple[str, str, tuple[int, ...]]], trunk_dtype: str = "float32") -> int:
    """Bytes the built weights of one trunk blob hold, for tensors (name, stored dtype, shape): the stored bytes for
    a Q8_0 / MXFP4 matrix of a quantized trunk (34 / 17 per 32 parameters, whatever the trunk dtype; a quantized
    pack quantizes every part of a fused group alike), 2 per parameter for a tensor kept as bf16 (`kept_as_bf16`),
    4 for everything else. The budget splitter charges this (stream/budget.py)."""
    kept = kept_as_bf16(tensors, trunk_dtype)
    return sum(_quantized_bytes(dtype, shape) if dtype in _PRECISIONS else int(np.prod(shape)) * (2 if bf16 else 4)
               for (_, dtype, shape), bf16 in zip(tensors, kept))


def widened_bytes(tensors: Sequence[tuple[str, str, tuple[int, ...]]], trunk_dtype: str = "bf16") -> int:
    """Bytes of the float32 copies a blob built as views of its read buffer holds beside that buffer: every tensor
    not kept as bf16, at 4 bytes a parameter (an upper bound: a residual query is one [H] product of two). A Q8_0 /
    MXFP4 matrix is a view of the buffer too (its bytes are what the kernel multiplies), so it adds nothing."""
    kept = kept_as_bf16(tensors, trunk_dtype)
    return sum(int(np.prod(shape)) * 4 for (_, dtype, shape), bf16 in zip(tensors, kept)
               if not bf16 and dtype not in _PRECISIONS)
