"""Tiny random checkpoints of each family, built with transformers at test time.

Each is a float32 model from a fixed seed, written with `save_pretrained` (safetensors) so k3serve reads exactly
what a released checkpoint looks like after transformers' own name conversion. Random initialisation alone hides
bugs (transformers initialises norms to 1 or 0 and the router bias to 0), so every norm weight, the selection-only
router bias and the router itself are perturbed: a norm applied the wrong way (x_hat * w vs x_hat * (1 + w)), a
missing bias, or a swapped pair of projections changes the logits. Sizes keep the hidden size and the expert
width multiples of 32 so that the MXFP4 option applies.

torch and transformers are imported at module level on purpose: the families tests must fail, not skip, without
them (they are pinned in the `test` extra).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (AutoModelForCausalLM, DeepseekV3Config, KimiLinearConfig, Qwen3MoeConfig,
                          Qwen3NextConfig)

FAMILIES = ("kimi_linear", "deepseek_v3", "qwen3_moe", "qwen3_next")
VOCAB = 160
SEED = 1234

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               initializer_range=0.08, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_config(family: str):
    if family == "kimi_linear":
        # KDA, KDA, MLA, KDA, MLA: KDA state is carried across an MLA layer; layer 0 dense, the rest MoE
        return KimiLinearConfig(
            **_COMMON, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_local_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.446,
            linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, rms_norm_eps=1e-5,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention",
                         "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"])
    if family == "deepseek_v3":
        # YaRN rope (as Kimi K2 / DeepSeek-V3 ship), interleaved; grouped routing with 4 groups of 4
        return DeepseekV3Config(
            **_COMMON, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, num_experts_per_tok=3,
            n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
            rms_norm_eps=1e-6, num_mtp_layers=0, max_position_embeddings=256, rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 64})
    if family == "qwen3_moe":
        # GQA 4 query heads over 2 kv heads; layer 1 dense through mlp_only_layers
        return Qwen3MoeConfig(
            **_COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen3_next":
        # DeltaNet, DeltaNet, attention, DeltaNet: 2 key heads shared by 4 value heads, Dk != Dv
        return Qwen3NextConfig(
            **_COMMON, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, shared_expert_intermediate_size=32,
            linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    raise ValueError(family)


@torch.no_grad()
def _perturb(model: torch.nn.Module, generator: torch.Generator) -> None:
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("norm.weight") or "layernorm" in name:
            tensor.add_(0.2 * torch.randn(tensor.shape, generator=generator))
        elif name.endswith("e_score_correction_bias"):
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
        elif name.endswith("gate.weight") and tensor.dim() == 2 and tensor.shape[0] > 1:  # routers
            tensor.mul_(3.0)


def build_tiny(family: str, folder: Path, bf16: bool = False, **overrides):
    """A tiny random transformers model of `family`, saved to `folder`. Returns the float32 model in eval mode.

    bf16: save the weights as bf16 and return the float32 model whose weights are those bf16 values (its rotary
    frequencies, which are not weights, stay float32). overrides: config attributes to change."""
    torch.manual_seed(SEED)
    config = tiny_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _perturb(model, torch.Generator().manual_seed(SEED + 1))
    if not bf16:
        model.save_pretrained(folder, safe_serialization=True)
        return model
    with torch.no_grad():
        for tensor in model.state_dict().values():  # persistent weights and buffers only
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(torch.bfloat16).float())
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    return model


def prompt(length: int, seed: int = 7) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, size=length)]


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> np.ndarray:
    """Full-forward logits [T, V] from transformers."""
    return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


@torch.no_grad()
def hf_stepwise_logits(model, ids: list[int], prefill: int) -> np.ndarray:
    """Logits [T, V]: one forward over ids[:prefill] with a cache, then one cached forward per remaining token."""
    out = model(torch.tensor([ids[:prefill]]), use_cache=True)
    rows, cache = [out.logits[0]], out.past_key_values
    for token in ids[prefill:]:
        out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        rows.append(out.logits[0])
        cache = out.past_key_values
    return torch.cat(rows).float().numpy()


@torch.no_grad()
def hf_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """transformers' `generate`, greedy, with its cache, exactly `num_tokens` tokens: end-of-sequence is switched
    off (rather than suppressed with min_new_tokens, which would change the argmax)."""
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(torch.tensor([ids]), max_new_tokens=num_tokens, do_sample=False, num_beams=1,
                             use_cache=True, pad_token_id=0)
    finally:
        model.generation_config = saved
    tokens = [int(t) for t in out[0, len(ids):]]
    assert len(tokens) == num_tokens
    return tokens


TRANSFORMERS_VERSION = transformers.__version__
TORCH_VERSION = torch.__version__
