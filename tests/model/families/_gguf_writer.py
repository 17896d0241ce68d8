"""Write a tiny family checkpoint as a GGUF file the way llama.cpp's converter does, with `gguf.GGUFWriter`.

The names, shapes and metadata keys follow llama.cpp's converter (convert_hf_to_gguf.py with its conversion/
package, read for this, not copied), checked once against the converter's own output on these tiny checkpoints:
experts stacked per layer, MLA's kv_b split into k_b (transposed) and v_b, ssm_a = -exp(A_log), dt_bias as
ssm_dt.bias, KDA conv weights as [1, P, 1, K], Qwen3-Next's (1 + w) norms stored with the 1 added and its
in_proj_qkvz split into attn_qkv and attn_gate. `tensor_type` chooses the storage: F32, F16 or BF16 for every
tensor, or Q8_0 (every matrix whose rows are multiples of 32; vectors stay F32, as llama.cpp keeps them) or
MXFP4 (the routed experts only, the rest F32, as llama.cpp's MXFP4_MOE files). `values(name, array)` gives the
numbers each tensor holds after that storage (the dequantized values), to build the safetensors twin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

from k3serve.model.families import read_family_config
from k3serve.model.families.build import expert_reader
from k3serve.model.families.tensors import TensorReader

ARCH = {"qwen3_moe": "qwen3moe", "deepseek_v3": "deepseek2", "kimi_linear": "kimi-linear",
        "qwen3_next": "qwen3next"}
TYPES = ("F32", "F16", "BF16", "Q8_0", "MXFP4")


_F32_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight", "ssm_conv1d_q.weight",
               "ssm_conv1d_k.weight", "ssm_conv1d_v.weight")


def keeps_f32(name: str, ndim: int) -> bool:
    """llama.cpp's converter keeps these GGUF tensors F32 whatever the output type: vectors, norms, routers,
    conv weights, and anything not named *.weight (ssm_a, biases)."""
    return ndim <= 1 or name.endswith("_norm.weight") or name.endswith(_F32_ALWAYS) or not name.endswith(".weight")


def hf_keeps_f32(name: str, ndim: int) -> bool:
    """The same set, by our (Hugging Face) names, for the safetensors twin."""
    return (ndim <= 1 or "norm" in name or name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight",
                                                          "shared_expert_gate.weight", "conv1d.weight"))
            or not name.endswith(".weight"))


def stored(array: np.ndarray, tensor_type: str, is_expert: bool, f32: bool = False) -> tuple[np.ndarray, Q | None]:
    """(data, raw type) as GGUFWriter takes it for `array` stored at `tensor_type` (`f32`: kept F32)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if f32 or tensor_type == "F32" or (tensor_type == "MXFP4" and not is_expert):
        return array, None
    if tensor_type == "F16":
        return array.astype(np.float16), None
    if tensor_type == "BF16":
        return quants.quantize(array, Q.BF16), Q.BF16
    if tensor_type == "Q8_0":
        if array.ndim < 2 or array.shape[-1] % 32:
            return array, None
        return quants.quantize(array, Q.Q8_0), Q.Q8_0
    if tensor_type == "MXFP4":
        return quants.quantize(array, Q.MXFP4), Q.MXFP4
    raise ValueError(tensor_type)


def dequantized(array: np.ndarray, tensor_type: str, is_expert: bool, f32: bool = False) -> np.ndarray:
    """The float32 values `array` holds once stored at `tensor_type`."""
    data, raw = stored(array, tensor_type, is_expert, f32)
    if raw is None:
        return data.astype(np.float32)
    return quants.dequantize(data, raw).reshape(array.shape).astype(np.float32)


class _Out:
    def __init__(self, writer: gguf.GGUFWriter, tensor_type: str) -> None:
        self.writer = writer
        self.tensor_type = tensor_type
        self.skip: set[str] = set()

    def add(self, name: str, array: np.ndarray, expert: bool = False) -> None:
        if name in self.skip:
            return
        data, raw = stored(array, self.tensor_type, expert, keeps_f32(name, np.ndim(array)))
        self.writer.add_tensor(name, data, raw_dtype=raw)


def write_gguf(folder: Path, out: Path, tensor_type: str = "F32", skip: tuple[str, ...] = (),
               metadata: Callable[[gguf.GGUFWriter, str], None] | None = None) -> Path:
    """Convert the family checkpoint in `folder` to `out`. `skip` leaves out GGUF tensors (for error tests);
    `metadata(writer, arch)` adds keys (a tokenizer)."""
    config = read_family_config(folder)
    family = config.model_type if config.model_type != "kimi_k2" else "deepseek_v3"
    arch = ARCH[family]
    reader = TensorReader.open(folder, family)
    writer = gguf.GGUFWriter(str(out), arch)
    o = _Out(writer, tensor_type)
    o.skip = set(skip)
    c = config
    L, H = c.num_layers, c.hidden_size
    k = lambda key: f"{arch}.{key}"  # noqa: E731
    writer.add_uint32(k("block_count"), L)
    writer.add_uint32(k("embedding_length"), H)
    writer.add_uint32(k("feed_forward_length"), c.intermediate_size)
    writer.add_uint32(k("attention.head_count"), c.num_attention_heads if family != "kimi_linear"
                      else c.num_attention_heads)
    writer.add_float32(k("attention.layer_norm_rms_epsilon"), c.rms_norm_eps)
    writer.add_uint32(k("expert_count"), c.num_experts)
    writer.add_uint32(k("expert_used_count"), c.num_experts_per_token)
    writer.add_uint32(k("expert_feed_forward_length"), c.moe_intermediate_size)
    if getattr(c, "max_position_embeddings", None):
        writer.add_uint32(k("context_length"), c.max_position_embeddings)
    if metadata is not None:
        metadata(writer, arch)

    def experts(l: int, moe: str, names: tuple[str, str, str]) -> None:
        read = expert_reader(reader, lambda _: moe, names, H, c.moe_intermediate_size)
        triples = [read(l, e) for e in range(c.num_experts)]
        for i, kind in enumerate(("gate", "up", "down")):
            o.add(f"blk.{l}.ffn_{kind}_exps.weight", np.stack([t[i] for t in triples]), expert=True)

    def glu(prefix: str, suffix: str, l: int, width: int) -> None:
        for kind in ("gate", "up", "down"):
            shape = (H, width) if kind == "down" else (width, H)
            o.add(f"blk.{l}.ffn_{kind}{suffix}.weight", reader.f32(f"{prefix}{kind}_proj.weight", shape=shape))

    def mla(l: int, a: str) -> None:
        NA, DN, DV, KL = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
        if c.q_lora_rank is None:
            o.add(f"blk.{l}.attn_q.weight", reader.f32(f"{a}q_proj.weight"))
        else:
            o.add(f"blk.{l}.attn_q_a.weight", reader.f32(f"{a}q_a_proj.weight"))
            o.add(f"blk.{l}.attn_q_a_norm.weight", reader.f32(f"{a}q_a_layernorm.weight"))
            o.add(f"blk.{l}.attn_q_b.weight", reader.f32(f"{a}q_b_proj.weight"))
        o.add(f"blk.{l}.attn_kv_a_mqa.weight", reader.f32(f"{a}kv_a_proj_with_mqa.weight"))
        o.add(f"blk.{l}.attn_kv_a_norm.weight", reader.f32(f"{a}kv_a_layernorm.weight"))
        kv_b = reader.f32(f"{a}kv_b_proj.weight").reshape(NA, DN + DV, KL)
        o.add(f"blk.{l}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :DN].transpose(0, 2, 1)))  # [NA, KL, DN]
        o.add(f"blk.{l}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, DN:]))  # [NA, DV, KL]
        o.add(f"blk.{l}.attn_output.weight", reader.f32(f"{a}o_proj.weight"))

    def grouped_moe(l: int, moe: str, names: tuple[str, str, str]) -> None:
        o.add(f"blk.{l}.ffn_gate_inp.weight", reader.f32(f"{moe}gate.weight"))
        o.add(f"blk.{l}.exp_probs_b.bias", reader.f32(f"{moe}gate.e_score_correction_bias"))
        experts(l, moe, names)
        if c.num_shared_experts:
            glu(f"{moe}shared_experts.", "_shexp", l, c.num_shared_experts * c.moe_intermediate_size)

    plus_one = family == "qwen3_next"
    norm = (lambda w: w + np.float32(1.0)) if plus_one else (lambda w: w)
    o.add("token_embd.weight", reader.f32("model.embed_tokens.weight"))
    if not c.tie_word_embeddings:
        o.add("output.weight", reader.f32("lm_head.weight"))
    o.add("output_norm.weight", norm(reader.f32("model.norm.weight")))
    for l in range(L):
        p = f"model.layers.{l}."
        a = f"{p}self_attn."
        o.add(f"blk.{l}.attn_norm.weight", norm(reader.f32(f"{p}input_layernorm.weight")))
        post = "post_attention_norm" if plus_one else "ffn_norm"
        o.add(f"blk.{l}.{post}.weight", norm(reader.f32(f"{p}post_attention_layernorm.weight")))
        if family in ("qwen3_moe", "qwen3_next") and c.layer_kinds[l] == "attention":
            for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                                 ("o_proj", "attn_output")):
                o.add(f"blk.{l}.{theirs}.weight", reader.f32(f"{a}{ours}.weight"))
            o.add(f"blk.{l}.attn_q_norm.weight", norm(reader.f32(f"{a}q_norm.weight")))
            o.add(f"blk.{l}.attn_k_norm.weight", norm(reader.f32(f"{a}k_norm.weight")))
        if family == "qwen3_next" and c.layer_kinds[l] == "gated_deltanet":
            la = f"{p}linear_attn."
            NKH, NVH, Dk, Dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                                c.linear_value_head_dim)
            gDv = NVH // NKH * Dv
            qkvz = reader.f32(f"{la}in_proj_qkvz.weight").reshape(NKH, 2 * Dk + 2 * gDv, H)
            q, kk, v, z = np.split(qkvz, np.cumsum([Dk, Dk, gDv]), axis=1)
            o.add(f"blk.{l}.attn_qkv.weight", np.concatenate([x.reshape(-1, H) for x in (q, kk, v)]))
            o.add(f"blk.{l}.attn_gate.weight", z.reshape(-1, H))
            o.add(f"blk.{l}.ssm_ba.weight", reader.f32(f"{la}in_proj_ba.weight"))
            conv = reader.f32(f"{la}conv1d.weight")
            o.add(f"blk.{l}.ssm_conv1d.weight", conv.reshape(conv.shape[0], conv.shape[-1]))
            o.add(f"blk.{l}.ssm_a", -np.exp(reader.f32(f"{la}A_log")))
            o.add(f"blk.{l}.ssm_dt.bias", reader.f32(f"{la}dt_bias"))
            o.add(f"blk.{l}.ssm_norm.weight", reader.f32(f"{la}norm.weight"))
            o.add(f"blk.{l}.ssm_out.weight", reader.f32(f"{la}out_proj.weight"))
        if family in ("qwen3_moe", "qwen3_next"):
            if c.mlp_kinds[l] == "moe":
                o.add(f"blk.{l}.ffn_gate_inp.weight", reader.f32(f"{p}mlp.gate.weight"))
                experts(l, f"{p}mlp.", ("gate_proj", "up_proj", "down_proj"))
                if family == "qwen3_next":
                    glu(f"{p}mlp.shared_expert.", "_shexp", l, c.shared_expert_intermediate_size)
                    # a vector [H], as llama.cpp's converter writes the [1, H] gate
                    o.add(f"blk.{l}.ffn_gate_inp_shexp.weight",
                          reader.f32(f"{p}mlp.shared_expert_gate.weight").reshape(-1))
            else:
                glu(f"{p}mlp.", "", l, c.intermediate_size)
        if family in ("deepseek_v3", "kimi_linear"):
            if c.layer_kinds[l] == "mla":
                mla(l, a)
            elif c.layer_kinds[l] == "kda":
                for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                                     ("o_proj", "attn_output"), ("f_a_proj", "ssm_f_a"), ("f_b_proj", "ssm_f_b"),
                                     ("g_a_proj", "ssm_g_a"), ("g_b_proj", "ssm_g_b"), ("b_proj", "ssm_beta"),
                                     ("o_norm", "ssm_norm")):
                    o.add(f"blk.{l}.{theirs}.weight", reader.f32(f"{a}{ours}.weight", f"{a}forget_gate.{ours}.weight"))
                for n in "qkv":
                    conv = reader.f32(f"{a}{n}_conv1d.weight")
                    o.add(f"blk.{l}.ssm_conv1d_{n}.weight", conv.reshape(1, conv.shape[0], 1, conv.shape[-1]))
                o.add(f"blk.{l}.ssm_a", -np.exp(reader.f32(f"{a}A_log", f"{a}forget_gate.A_log")).reshape(1, 1, -1, 1))
                o.add(f"blk.{l}.ssm_dt.bias", reader.f32(f"{a}dt_bias", f"{a}forget_gate.dt_bias").reshape(-1))
            moe = f"{p}block_sparse_moe." if family == "kimi_linear" else f"{p}mlp."
            if c.mlp_kinds[l] == "moe":
                grouped_moe(l, moe, ("w1", "w3", "w2") if family == "kimi_linear" else
                            ("gate_proj", "up_proj", "down_proj"))
            else:
                dense = f"{p}mlp." if f"{p}mlp.gate_proj.weight" in reader else moe
                glu(dense, "", l, c.intermediate_size)

    if family in ("qwen3_moe", "qwen3_next"):
        writer.add_uint32(k("attention.head_count_kv"), c.num_key_value_heads)
        writer.add_uint32(k("attention.key_length"), c.head_dim)
        writer.add_uint32(k("attention.value_length"), c.head_dim)
        writer.add_float32(k("rope.freq_base"), float(c.rope["rope_theta"]))
        if family == "qwen3_next":
            writer.add_uint32(k("expert_shared_feed_forward_length"), c.shared_expert_intermediate_size)
            writer.add_uint32(k("ssm.conv_kernel"), c.linear_conv_kernel_dim)
            writer.add_uint32(k("ssm.state_size"), c.linear_key_head_dim)
            writer.add_uint32(k("ssm.group_count"), c.linear_num_key_heads)
            writer.add_uint32(k("ssm.time_step_rank"), c.linear_num_value_heads)
            writer.add_uint32(k("ssm.inner_size"), c.linear_value_head_dim * c.linear_num_value_heads)
            writer.add_array(k("attention.recurrent_layers"), [kind == "gated_deltanet" for kind in c.layer_kinds])
            writer.add_uint32(k("full_attention_interval"), 4)
            writer.add_uint32(k("rope.dimension_count"), c.rotary_dim)
    else:
        writer.add_uint32(k("attention.kv_lora_rank"), c.kv_lora_rank)
        # 0 where there is no query LoRA, as the files llama.cpp loads state it (its deepseek2 loader needs the key)
        writer.add_uint32(k("attention.q_lora_rank"), c.q_lora_rank or 0)
        writer.add_uint32(k("attention.key_length"), c.kv_lora_rank + c.qk_rope_head_dim)
        writer.add_uint32(k("attention.value_length"), c.kv_lora_rank)
        writer.add_uint32(k("attention.key_length_mla"), c.qk_nope_head_dim + c.qk_rope_head_dim)
        writer.add_uint32(k("attention.value_length_mla"), c.v_head_dim)
        writer.add_uint32(k("rope.dimension_count"), c.qk_rope_head_dim)
        writer.add_uint32(k("expert_shared_count"), c.num_shared_experts)
        writer.add_uint32(k("leading_dense_block_count"), c.mlp_kinds.index("moe"))
        writer.add_float32(k("expert_weights_scale"), c.routed_scaling_factor)
        writer.add_uint32(k("vocab_size"), c.vocab_size)
        if family == "deepseek_v3":
            writer.add_uint32(k("attention.head_count_kv"), 1)
            writer.add_uint32(k("expert_group_count"), c.num_expert_group)
            writer.add_uint32(k("expert_group_used_count"), c.topk_group)
            writer.add_bool(k("expert_weights_norm"), c.norm_topk_prob)
            writer.add_float32(k("rope.freq_base"), float(c.rope["rope_theta"]))
            if c.rope.get("rope_type") == "yarn":
                writer.add_string(k("rope.scaling.type"), "yarn")
                writer.add_float32(k("rope.scaling.factor"), float(c.rope["factor"]))
                writer.add_uint32(k("rope.scaling.original_context_length"),
                                  int(c.rope["original_max_position_embeddings"]))
                writer.add_float32(k("rope.scaling.yarn_beta_fast"), float(c.rope["beta_fast"]))
                writer.add_float32(k("rope.scaling.yarn_beta_slow"), float(c.rope["beta_slow"]))
                writer.add_float32(k("rope.scaling.yarn_log_multiplier"), 0.1 * float(c.rope["mscale_all_dim"]))
        else:
            writer.add_array(k("attention.head_count_kv"), [1 if kind == "mla" else 0 for kind in c.layer_kinds])
            writer.add_uint32(k("ssm.conv_kernel"), c.linear_conv_kernel_dim)
            writer.add_uint32(k("kda.head_dim"), c.linear_head_dim)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader.close()
    return out
