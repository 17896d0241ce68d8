"""Kimi Linear (`model_type: kimi_linear`): KDA layers with a low-rank output gate, MLA layers without any
positional embedding (NoPE), and DeepSeek-V3's grouped sigmoid MoE with shared experts.

Its KDA and MLA are the blocks K3 builds on; K3 changes the KDA decay (a bounded sigmoid form), makes the KDA
output gate full-rank, and adds an output gate to MLA. The math of each block is in `delta.py` and
`latent_attention.py`. Settings are read from transformers' keys (`layer_types`, `mlp_layer_types`,
`linear_num_heads`, ...) or from the released ones (`linear_attn_config` with one-based `full_attn_layers` and
`kda_layers`, `first_k_dense_replace`).
Tensor names (prefix `model.layers.{l}.`):
    KDA: self_attn.{q,k,v}_proj.weight [P, H], self_attn.{q,k,v}_conv1d.weight [P, 1, K] (or one stacked
         self_attn.conv1d.weight [3P, 1, K]), self_attn.f_a_proj [D, H], f_b_proj [P, D], dt_bias [P],
         A_log [NH] (any shape), b_proj [NH, H], g_a_proj [D, H], g_b_proj [P, D], o_norm [D], o_proj [H, P];
    MLA: as DeepSeek-V3 (q_proj when q_lora_rank is null);
    MoE: block_sparse_moe.gate.weight, .gate.e_score_correction_bias, .experts.{e}.{w1,w3,w2}.weight (gate, up,
         down), .shared_experts.{gate,up,down}_proj.weight; dense: mlp.{gate,up,down}_proj.weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3serve.model.families.build import check_supported_basics, common_keys, embeddings, expert_reader, glu
from k3serve.model.cache import CacheLayout
from k3serve.model.families.decoder import DecoderConfig, FamilyModel, assemble_model, pre_norm_layer
from k3serve.model.families.deepseek_v3 import MLAConfig, build_grouped_moe, build_mla, read_mla_config
from k3serve.model.families.delta import KimiDeltaAttention, KimiDeltaWeights
from k3serve.model.families.experts import ExpertStore
from k3serve.model.families.hf_config import HFConfig
from k3serve.model.families.latent_attention import LatentAttention
from k3serve.model.families.moe import DenseMLP, MoEBlock
from k3serve.model.families.tensors import TensorReader
from k3serve.model.weights import fuse_rows
from k3serve.weights.quantized import QuantizedMatrix

_LAYER_TYPES = {"full_attention": "mla", "linear_attention": "kda"}
_MLP_TYPES = {"dense": "dense", "sparse": "moe"}


@dataclass(frozen=True)
class KimiLinearConfig(DecoderConfig, MLAConfig):
    linear_num_heads: int  # NH
    linear_head_dim: int  # D
    linear_conv_kernel_dim: int  # K

    @classmethod
    def from_hf(cls, config: HFConfig) -> KimiLinearConfig:
        check_supported_basics(config)
        config.require_value("mla_use_nope", (True,), value_when_absent=True)
        common = common_keys(config)
        L = common["num_layers"]
        nested = config.optional("linear_attn_config", {}) or {}
        linear = HFConfig(nested, config.family, f"{config.source} linear_attn_config")

        def pick(flat: str, released: str) -> int:
            return config.integer(flat) if config.has(flat) else linear.integer(released)

        if config.has("layer_types"):
            types = config.get("layer_types")
            if not isinstance(types, list) or len(types) != L or any(t not in _LAYER_TYPES for t in types):
                raise config.error(f"layer_types must list {L} entries among {sorted(_LAYER_TYPES)}")
            kinds = tuple(_LAYER_TYPES[t] for t in types)
        else:
            full, kda = set(linear.get("full_attn_layers")), set(linear.get("kda_layers"))  # one-based
            if full & kda or full | kda != set(range(1, L + 1)):
                raise linear.error(f"full_attn_layers and kda_layers must split layers 1..{L} between them")
            kinds = tuple("mla" if l + 1 in full else "kda" for l in range(L))
        if config.has("mlp_layer_types"):
            mlp_types = config.get("mlp_layer_types")
            if not isinstance(mlp_types, list) or len(mlp_types) != L or any(t not in _MLP_TYPES for t in mlp_types):
                raise config.error(f"mlp_layer_types must list {L} entries among {sorted(_MLP_TYPES)}")
            mlp_kinds = tuple(_MLP_TYPES[t] for t in mlp_types)
        else:
            first_dense = config.integer("first_k_dense_replace", minimum=0)
            mlp_kinds = tuple("dense" if l < first_dense else "moe" for l in range(L))
        return cls(model_type=config.get("model_type"), **common,
                   **read_mla_config(config, single_group_when_absent=True), layer_kinds=kinds,
                   mlp_kinds=mlp_kinds, linear_num_heads=pick("linear_num_heads", "num_heads"),
                   linear_head_dim=pick("linear_head_dim", "head_dim"),
                   linear_conv_kernel_dim=pick("linear_conv_kernel_dim", "short_conv_kernel_size"))


def _up_projection(reader: TensorReader, shape: tuple[int, int], *names: str) -> np.ndarray | QuantizedMatrix:
    """f_b / g_b [P, D]: the file's Q8_0 blocks where it stores them so (a Q8_0 GGUF: 128-wide rows, the short-row
    Q8_0 kernel), else float32 as the checkpoint gives them."""
    blocks = reader.q8_0(reader.name_of(*names), shape)
    return blocks if blocks is not None else reader.f32(*names, shape=shape)


def build_kda(reader: TensorReader, config: KimiLinearConfig, layer: int,
              chunk_size: int | None) -> KimiDeltaAttention:
    NH, D, K, H = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim, config.hidden_size
    P = NH * D
    a = f"model.layers.{layer}.self_attn."
    if f"{a}conv1d.weight" in reader:
        conv = reader.f32(f"{a}conv1d.weight", shape=(3 * P, 1, K))[:, 0, :]
    else:
        conv = np.concatenate([reader.f32(f"{a}{n}_conv1d.weight", shape=(P, 1, K))[:, 0, :] for n in "qkv"])
    gate = f"{a}forget_gate."  # transformers' in-module names, accepted after the released ones
    in_proj = fuse_rows([reader.matrix(f"{a}{n}_proj.weight", shape=(P, H)) for n in "qkv"]
                        + [reader.matrix(f"{a}f_a_proj.weight", f"{gate}f_a_proj.weight", shape=(D, H)),
                           reader.matrix(f"{a}g_a_proj.weight", shape=(D, H)),
                           reader.matrix(f"{a}b_proj.weight", shape=(NH, H))])
    a_log = reader.f32(f"{a}A_log", f"{gate}A_log", size=NH).reshape(NH)
    weights = KimiDeltaWeights(
        in_proj=in_proj, conv=np.ascontiguousarray(conv),
        f_b=_up_projection(reader, (P, D), f"{a}f_b_proj.weight", f"{gate}f_b_proj.weight"),
        g_b=_up_projection(reader, (P, D), f"{a}g_b_proj.weight"),
        a_exp=np.exp(a_log).astype(np.float32),
        dt_bias=reader.f32(f"{a}dt_bias", f"{gate}dt_bias", size=P).reshape(P),
        o_norm=reader.f32(f"{a}o_norm.weight", shape=(D,)),
        o_proj=reader.matrix(f"{a}o_proj.weight", shape=(H, P)),
    )
    return KimiDeltaAttention(layer=layer, weights=weights, num_heads=NH, head_dim=D, eps=config.rms_norm_eps,
                              chunk_size=chunk_size)


def _moe_prefix(reader: TensorReader, layer: int) -> str:
    p = f"model.layers.{layer}."
    return f"{p}block_sparse_moe." if f"{p}block_sparse_moe.gate.weight" in reader else f"{p}mlp."


def build(config: KimiLinearConfig, reader: TensorReader, precision: str, chunk_size: int | None) -> FamilyModel:
    H = config.hidden_size
    store = ExpertStore(expert_reader(reader, lambda l: _moe_prefix(reader, l), ("w1", "w3", "w2"), H,
                                      config.moe_intermediate_size), precision, config.num_experts)
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    layers, row_widths, recurrent_shapes = [], {}, {}
    for l in range(config.num_layers):
        p = f"model.layers.{l}."
        if config.layer_kinds[l] == "mla":
            mixer: KimiDeltaAttention | LatentAttention = build_mla(reader, config, config, l, rotary=None, scale=scale)
            row_widths[l] = mixer.row_width
        else:
            mixer = build_kda(reader, config, l, chunk_size)
            recurrent_shapes[l] = mixer.state_shapes()
        if config.mlp_kinds[l] == "moe":
            mlp: MoEBlock | DenseMLP = build_grouped_moe(reader, config, config, l, _moe_prefix(reader, l), store)
        else:
            # transformers' save_pretrained writes the dense MLP under block_sparse_moe. too
            mlp = DenseMLP(glu(reader, (f"{p}mlp.", f"{p}block_sparse_moe."), H, config.intermediate_size))
        layers.append(pre_norm_layer(reader, p, H, mixer, mlp))
    embed, lm_head = embeddings(reader, config.vocab_size, H, config.tie_word_embeddings)
    return assemble_model(reader, config, layers, CacheLayout(row_widths, recurrent_shapes), store, embed, lm_head)
