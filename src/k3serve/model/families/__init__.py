"""Other model families built from the same blocks as K3, read from Hugging Face checkpoints.

kimi_linear (KDA + MLA + MoE), deepseek_v3 / kimi_k2 (MLA with RoPE, grouped sigmoid routing, shared experts),
qwen3_moe (GQA with RoPE, softmax routing) and qwen3_next (gated DeltaNet, gated attention, MoE with a gated shared
expert). Each is checked against the transformers implementation on tiny random checkpoints
(tests/model/families); see docs/FAMILIES.md. numpy only: torch and transformers are needed by the tests alone.
"""

from __future__ import annotations

from k3serve.model.families.decoder import DecoderConfig, FamilyModel
from k3serve.model.families.experts import EXPERT_PRECISIONS
from k3serve.model.families.loading import (SUPPORTED_MODEL_TYPES, is_family_checkpoint, load_family,
                                            read_family_config)

__all__ = ["DecoderConfig", "EXPERT_PRECISIONS", "FamilyModel",
           "SUPPORTED_MODEL_TYPES", "is_family_checkpoint", "load_family", "read_family_config"]
