"""The released K3 tensor names, shapes and storage dtypes (K3_SPEC section 3), in one place.

Every other module asks here for a name instead of spelling it: the packer, the loaders, the synthetic
checkpoint writer and the reference all agree because of this file.
"""

from __future__ import annotations

from typing import NamedTuple

from k3serve.config import MXFP4_GROUP_SIZE, K3Config

MODEL = "language_model.model"
EMBED = f"{MODEL}.embed_tokens.weight"
LM_HEAD = "language_model.lm_head.weight"
FINAL_NORM = f"{MODEL}.norm.weight"
OUTPUT_RES_NORM = f"{MODEL}.output_attn_res_norm.weight"
OUTPUT_RES_PROJ = f"{MODEL}.output_attn_res_proj.weight"

EXPERT_MATRICES = ("w1", "w3", "w2")  # gate, up, down


class TensorSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string: BF16 for trunk matrices, F32 for small vectors, U8 for MXFP4


def layer_prefix(layer: int) -> str:
    return f"{MODEL}.layers.{layer}."


def moe_prefix(layer: int) -> str:
    return f"{layer_prefix(layer)}block_sparse_moe."


def expert_name(layer: int, expert: int, matrix: str, part: str) -> str:
    """`part` is 'weight_packed' or 'weight_scale'; `matrix` one of w1, w3, w2."""
    return f"{moe_prefix(layer)}experts.{expert}.{matrix}.{part}"


def expert_matrix_shape(config: K3Config, matrix: str) -> tuple[int, int]:
    """The dense [out, in] shape of one expert matrix."""
    LT, MI = config.latent_size, config.moe_intermediate_size
    return (MI, LT) if matrix in ("w1", "w3") else (LT, MI)


def expert_specs(config: K3Config, layer: int, expert: int) -> list[TensorSpec]:
    specs = []
    for matrix in EXPERT_MATRICES:
        rows, cols = expert_matrix_shape(config, matrix)
        specs.append(TensorSpec(expert_name(layer, expert, matrix, "weight_packed"), (rows, cols // 2), "U8"))
        specs.append(TensorSpec(expert_name(layer, expert, matrix, "weight_scale"),
                                (rows, cols // MXFP4_GROUP_SIZE), "U8"))
    return specs


def layer_trunk_specs(config: K3Config, layer: int) -> list[TensorSpec]:
    """Every always-active tensor of one layer (attention, norms, dense MLP or MoE trunk), not the experts."""
    c, p = config, layer_prefix(layer)
    H, P, D, NH, K = c.hidden_size, c.kda_proj_size, c.kda_head_dim, c.kda_num_heads, c.short_conv_kernel_size
    specs = [
        TensorSpec(f"{p}input_layernorm.weight", (H,), "BF16"),
        TensorSpec(f"{p}post_attention_layernorm.weight", (H,), "BF16"),
        TensorSpec(f"{p}self_attention_res_norm.weight", (H,), "BF16"),
        TensorSpec(f"{p}mlp_res_norm.weight", (H,), "BF16"),
        TensorSpec(f"{p}self_attention_res_proj.weight", (1, H), "BF16"),
        TensorSpec(f"{p}mlp_res_proj.weight", (1, H), "BF16"),
    ]
    a = f"{p}self_attn."
    if c.is_mla(layer):
        NA, QL, KL = c.num_mla_heads, c.q_lora_rank, c.kv_lora_rank
        DN, DR, DV = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        specs += [
            TensorSpec(f"{a}q_a_proj.weight", (QL, H), "BF16"),
            TensorSpec(f"{a}q_a_layernorm.weight", (QL,), "BF16"),
            TensorSpec(f"{a}q_b_proj.weight", (NA * (DN + DR), QL), "BF16"),
            TensorSpec(f"{a}kv_a_proj_with_mqa.weight", (KL + DR, H), "BF16"),
            TensorSpec(f"{a}kv_a_layernorm.weight", (KL,), "BF16"),
            TensorSpec(f"{a}kv_b_proj.weight", (NA * (DN + DV), KL), "BF16"),
            TensorSpec(f"{a}o_proj.weight", (H, NA * DV), "BF16"),
        ]
        if c.mla_use_output_gate:
            specs.append(TensorSpec(f"{a}g_proj.weight", (NA * DV, H), "BF16"))
    else:
        specs += [TensorSpec(f"{a}{n}_proj.weight", (P, H), "BF16") for n in ("q", "k", "v", "g")]
        specs += [
            TensorSpec(f"{a}o_proj.weight", (H, P), "BF16"),
            TensorSpec(f"{a}q_conv1d.weight", (P, 1, K), "F32"),
            TensorSpec(f"{a}k_conv1d.weight", (P, 1, K), "F32"),
            TensorSpec(f"{a}v_conv1d.weight", (P, 1, K), "F32"),
            TensorSpec(f"{a}f_a_proj.weight", (D, H), "BF16"),
            TensorSpec(f"{a}f_b_proj.weight", (P, D), "BF16"),
            TensorSpec(f"{a}b_proj.weight", (NH, H), "BF16"),
            TensorSpec(f"{a}A_log", (D,), "F32"),
            TensorSpec(f"{a}dt_bias", (P,), "F32"),
            TensorSpec(f"{a}o_norm.weight", (D,), "BF16"),
        ]
    if c.is_dense(layer):
        m, DI = f"{p}mlp.", c.intermediate_size
        specs += [
            TensorSpec(f"{m}gate_proj.weight", (DI, H), "BF16"),
            TensorSpec(f"{m}up_proj.weight", (DI, H), "BF16"),
            TensorSpec(f"{m}down_proj.weight", (H, DI), "BF16"),
        ]
    else:
        m, NE, LT, SI = moe_prefix(layer), c.num_experts, c.latent_size, c.shared_intermediate_size
        specs += [
            TensorSpec(f"{m}gate.weight", (NE, H), "BF16"),
            TensorSpec(f"{m}gate.e_score_correction_bias", (NE,), "F32"),
            TensorSpec(f"{m}routed_expert_down_proj.weight", (LT, H), "BF16"),
            TensorSpec(f"{m}routed_expert_up_proj.weight", (H, LT), "BF16"),
            TensorSpec(f"{m}routed_expert_norm.weight", (LT,), "BF16"),
        ]
        if SI:
            specs += [
                TensorSpec(f"{m}shared_experts.gate_proj.weight", (SI, H), "BF16"),
                TensorSpec(f"{m}shared_experts.up_proj.weight", (SI, H), "BF16"),
                TensorSpec(f"{m}shared_experts.down_proj.weight", (H, SI), "BF16"),
            ]
    return specs


def global_specs(config: K3Config) -> list[TensorSpec]:
    V, H = config.vocab_size, config.hidden_size
    return [
        TensorSpec(EMBED, (V, H), "BF16"),
        TensorSpec(FINAL_NORM, (H,), "BF16"),
        TensorSpec(OUTPUT_RES_NORM, (H,), "BF16"),
        TensorSpec(OUTPUT_RES_PROJ, (1, H), "BF16"),
        TensorSpec(LM_HEAD, (V, H), "BF16"),
    ]


def all_specs(config: K3Config) -> list[TensorSpec]:
    """Every tensor of a K3 checkpoint, in file order: globals, then per layer trunk then experts."""
    specs = global_specs(config)
    for layer in range(config.num_layers):
        specs += layer_trunk_specs(config, layer)
        if not config.is_dense(layer):
            for expert in range(config.num_experts):
                specs += expert_specs(config, layer, expert)
    return specs
