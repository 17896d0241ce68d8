"""A K3 checkpoint as a GGUF file (llama.cpp's `kimi-k3`), read back: same config, same MXFP4 expert bytes, same
logits and greedy tokens as the safetensors folder.

`write_k3_gguf` follows what llama.cpp's converter (conversion/kimi_k3.py, read for this, not copied) writes:
the attention-residual norm * proj product as `*_res_score` (f32), ssm_a = -exp(A_log[:NH]), kv_b split into
k_b (transposed) and v_b, experts stacked per layer in ggml's MXFP4 blocks (an E8M0 byte, then 16 bytes holding
values j and j + 16), BF16 matrices and f32 vectors. It was checked once against the converter's own output on
the tiny oracle (same names, shapes and bytes), and k3serve's logits from the converter's file equalled the
folder's exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from k3serve.config import load_config
from k3serve.errors import CheckpointError
from k3serve.loading import load_model
from k3serve.weights import names
from k3serve.weights.checkpoint import Checkpoint
from k3serve.weights.gguf_file import GGUFFile


def ggml_mxfp4_blocks(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Our MXFP4 (packed [R, C/2], byte j = values 2j | 2j+1 << 4; scales [R, C/32]) as ggml blocks [R, C/32*17]."""
    rows, groups = scales.shape
    codes = np.empty((rows, groups * 32), np.uint8)  # value order
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    codes = codes.reshape(rows, groups, 32)
    qs = codes[:, :, :16] | (codes[:, :, 16:] << 4)  # [R, G, 16]
    return np.concatenate([scales[:, :, None], qs], axis=2).reshape(rows, groups * 17)


def write_k3_gguf(folder: Path, out: Path, expert_type: str = "MXFP4", skip: tuple[str, ...] = (),
                  metadata: Callable[[gguf.GGUFWriter], None] | None = None, trunk_type: str = "BF16") -> Path:
    """`metadata` adds more keys (a tokenizer, as llama.cpp's converter writes one); `trunk_type` "Q8_0" writes
    the trunk matrices whose rows are whole 32-blocks as Q8_0 (as a llama.cpp Q8_0 file does)."""
    c = load_config(folder)
    checkpoint = Checkpoint(folder)
    read = checkpoint.read
    writer = gguf.GGUFWriter(str(out), "kimi-k3")
    arch = "kimi-k3"

    def add(name: str, array: np.ndarray) -> None:
        if name in skip:
            return
        array = np.ascontiguousarray(array, dtype=np.float32)
        if array.ndim <= 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight", "_score.weight", "conv1d_q.weight",
                                             "conv1d_k.weight", "conv1d_v.weight")) or not name.endswith(".weight"):
            writer.add_tensor(name, array)
        elif trunk_type == "Q8_0" and array.ndim == 2 and array.shape[1] % 32 == 0:
            writer.add_tensor(name, quants.quantize(array, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(name, quants.quantize(array, Q.BF16), raw_dtype=Q.BF16)

    H = c.hidden_size
    add("token_embd.weight", read(names.EMBED))
    add("output.weight", read(names.LM_HEAD))
    add("output_norm.weight", read(names.FINAL_NORM))
    add("output_res_score.weight", read(names.OUTPUT_RES_NORM) * read(names.OUTPUT_RES_PROJ).reshape(-1))
    for l in range(c.num_layers):
        p, b = names.layer_prefix(l), f"blk.{l}."
        a = f"{p}self_attn."
        add(f"{b}attn_norm.weight", read(f"{p}input_layernorm.weight"))
        add(f"{b}ffn_norm.weight", read(f"{p}post_attention_layernorm.weight"))
        add(f"{b}attn_res_score.weight",
            read(f"{p}self_attention_res_norm.weight") * read(f"{p}self_attention_res_proj.weight").reshape(-1))
        add(f"{b}ffn_res_score.weight", read(f"{p}mlp_res_norm.weight") * read(f"{p}mlp_res_proj.weight").reshape(-1))
        if c.is_mla(l):
            for ours, theirs in (("q_a_proj", "attn_q_a"), ("q_a_layernorm", "attn_q_a_norm"), ("q_b_proj", "attn_q_b"),
                                 ("kv_a_proj_with_mqa", "attn_kv_a_mqa"), ("kv_a_layernorm", "attn_kv_a_norm"),
                                 ("o_proj", "attn_output"), ("g_proj", "attn_gate")):
                add(f"{b}{theirs}.weight", read(f"{a}{ours}.weight"))
            NA, DN = c.num_mla_heads, c.qk_nope_head_dim
            kv_b = read(f"{a}kv_b_proj.weight").reshape(NA, DN + c.v_head_dim, c.kv_lora_rank)
            add(f"{b}attn_k_b.weight", kv_b[:, :DN].transpose(0, 2, 1))
            add(f"{b}attn_v_b.weight", kv_b[:, DN:])
        else:
            for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("g_proj", "ssm_g"),
                                 ("o_proj", "attn_output"), ("f_a_proj", "ssm_f_a"), ("f_b_proj", "ssm_f_b"),
                                 ("b_proj", "ssm_beta"), ("o_norm", "ssm_norm")):
                add(f"{b}{theirs}.weight", read(f"{a}{ours}.weight"))
            for n in "qkv":
                conv = read(f"{a}{n}_conv1d.weight")
                add(f"{b}ssm_conv1d_{n}.weight", conv.reshape(1, conv.shape[0], 1, conv.shape[-1]))
            add(f"{b}ssm_a", -np.exp(read(f"{a}A_log")[:c.kda_num_heads]))
            add(f"{b}ssm_dt.bias", read(f"{a}dt_bias"))
        if c.is_dense(l):
            for kind in ("gate", "up", "down"):
                add(f"{b}ffn_{kind}.weight", read(f"{p}mlp.{kind}_proj.weight"))
            continue
        m = names.moe_prefix(l)
        add(f"{b}ffn_gate_inp.weight", read(f"{m}gate.weight"))
        add(f"{b}exp_probs_b.bias", read(f"{m}gate.e_score_correction_bias"))
        add(f"{b}ffn_routed_down.weight", read(f"{m}routed_expert_down_proj.weight"))
        add(f"{b}ffn_routed_up.weight", read(f"{m}routed_expert_up_proj.weight"))
        add(f"{b}ffn_routed_norm.weight", read(f"{m}routed_expert_norm.weight"))
        for kind in ("gate", "up", "down"):
            add(f"{b}ffn_{kind}_shexp.weight", read(f"{m}shared_experts.{kind}_proj.weight"))
        for matrix, kind in zip(names.EXPERT_MATRICES, ("gate", "up", "down")):
            name = f"{b}ffn_{kind}_exps.weight"
            if name in skip:
                continue
            parts = [(read(names.expert_name(l, e, matrix, "weight_packed")),
                      read(names.expert_name(l, e, matrix, "weight_scale"))) for e in range(c.num_experts)]
            if expert_type == "MXFP4":
                writer.add_tensor(name, np.stack([ggml_mxfp4_blocks(*part) for part in parts]), raw_dtype=Q.MXFP4)
            else:
                from k3serve.weights.mxfp4 import dequantize_mxfp4
                writer.add_tensor(name, np.stack([dequantize_mxfp4(*part) for part in parts]))
    u32, f32 = writer.add_uint32, writer.add_float32
    u32(f"{arch}.block_count", c.num_layers)
    u32(f"{arch}.context_length", c.max_position_embeddings)
    u32(f"{arch}.embedding_length", H)
    u32(f"{arch}.feed_forward_length", c.intermediate_size)
    u32(f"{arch}.attention.head_count", c.num_mla_heads)
    writer.add_array(f"{arch}.attention.head_count_kv", [1 if c.is_mla(l) else 0 for l in range(c.num_layers)])
    f32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    u32(f"{arch}.expert_count", c.num_experts)
    u32(f"{arch}.expert_used_count", c.num_experts_per_token)
    u32(f"{arch}.expert_group_used_count", c.topk_group)
    u32(f"{arch}.expert_gating_func", 2)
    u32(f"{arch}.vocab_size", c.vocab_size)
    u32(f"{arch}.ssm.conv_kernel", c.short_conv_kernel_size)
    u32(f"{arch}.kda.head_dim", c.kda_head_dim)
    f32(f"{arch}.kda.gate_lower_bound", c.gate_lower_bound)
    u32(f"{arch}.attention.q_lora_rank", c.q_lora_rank)
    u32(f"{arch}.attention.kv_lora_rank", c.kv_lora_rank)
    u32(f"{arch}.rope.dimension_count", c.qk_rope_head_dim)
    u32(f"{arch}.attention.key_length", c.kv_lora_rank + c.qk_rope_head_dim)
    u32(f"{arch}.attention.value_length", c.kv_lora_rank)
    u32(f"{arch}.attention.key_length_mla", c.qk_nope_head_dim + c.qk_rope_head_dim)
    u32(f"{arch}.attention.value_length_mla", c.v_head_dim)
    u32(f"{arch}.expert_feed_forward_length", c.moe_intermediate_size)
    u32(f"{arch}.expert_shared_count", c.num_shared_experts)
    u32(f"{arch}.leading_dense_block_count", c.first_k_dense_replace)
    f32(f"{arch}.expert_weights_scale", c.routed_scaling_factor)
    writer.add_bool(f"{arch}.expert_weights_norm", c.moe_renormalize)
    u32(f"{arch}.expert_latent_length", c.latent_size)
    f32(f"{arch}.activation.situ_beta", c.situ_beta)
    f32(f"{arch}.activation.situ_linear_beta", c.situ_linear_beta)
    u32(f"{arch}.attn_res.block_size", c.attn_res_block_size)
    if c.bos_token_id is not None:
        u32("tokenizer.ggml.bos_token_id", c.bos_token_id)
    if c.eos_token_ids:
        u32("tokenizer.ggml.eos_token_id", c.eos_token_ids[0])
    if metadata is not None:
        metadata(writer)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    checkpoint.close()
    return out


@pytest.fixture(scope="module")
def k3_gguf(tiny_dir, tmp_path_factory) -> Path:
    return write_k3_gguf(tiny_dir, tmp_path_factory.mktemp("k3gguf") / "tiny.gguf")


def test_config_round_trips(tiny_dir, k3_gguf):
    ours = Checkpoint.from_gguf(GGUFFile(k3_gguf)).config
    expected = load_config(tiny_dir)
    assert ours.layer_map == expected.layer_map
    assert ours.to_dict() == expected.to_dict()


def test_experts_convert_to_the_same_mxfp4_bytes(tiny_dir, k3_gguf):
    folder, gguf_checkpoint = Checkpoint(tiny_dir), Checkpoint.from_gguf(GGUFFile(k3_gguf))
    layer = folder.config.moe_layer_ids[0]
    for expert in (0, folder.config.num_experts - 1):
        for matrix in names.EXPERT_MATRICES:
            for part in ("weight_packed", "weight_scale"):
                name = names.expert_name(layer, expert, matrix, part)
                assert np.array_equal(gguf_checkpoint.read(name), folder.read(name)), name


def test_gguf_logits_and_greedy_equal_the_folder(tiny_dir, tiny_model, k3_gguf):
    loaded = load_model(k3_gguf)
    ids = [1, 17, 33, 90, 12, 7, 150, 41, 3, 99]
    ours, expected = loaded.model.logits(ids), tiny_model.logits(ids)
    # A_log comes back as log(-(-exp(A_log))): equal to rounding. That last-bit change of the KDA decay moves the
    # logits by 1.6e-5 of their largest through the compiled delta rule (4.1e-6 through numpy's chunked form, whose
    # rounding differs); the bound is test_k3's SAME_FUNCTION_RTOL
    assert float(np.max(np.abs(ours - expected))) <= 5e-5 * float(np.max(np.abs(expected)))
    assert loaded.model.greedy(ids, 8) == tiny_model.greedy(ids, 8)


def test_float_experts_are_refused_naming_the_type(tiny_dir, tmp_path):
    path = write_k3_gguf(tiny_dir, tmp_path / "f32.gguf", expert_type="F32")
    with pytest.raises(CheckpointError, match="must be MXFP4.*type F32"):
        load_model(path)


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    path = write_k3_gguf(tiny_dir, tmp_path / "m.gguf", skip=("blk.3.attn_q_b.weight",))
    with pytest.raises(CheckpointError, match="layers.3.self_attn.q_b_proj"):
        load_model(path)


def test_k3_gguf_refuses_int8_precision(k3_gguf):
    from k3serve.errors import ConfigError

    with pytest.raises(ConfigError, match="MXFP4"):
        load_model(k3_gguf, expert_precision="int8")
