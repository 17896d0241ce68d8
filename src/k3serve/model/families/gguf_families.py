"""GGUF files of the families, as llama.cpp's converter writes them, read back into our config and tensor names.

A GGUF file names its architecture (`general.architecture`) and carries llama.cpp's hyperparameter keys and
tensor names. This module maps both back, so the family builders read a GGUF file exactly as a Hugging Face
checkpoint folder:
- `hf_config(file)`: the config.json the family parser expects, rebuilt from the GGUF metadata;
- `GGUFTensorIndex`: our tensor names -> a read of the GGUF tensor, undoing the converter's changes.

Architectures (llama.cpp name -> our family):
    qwen3moe -> qwen3_moe, deepseek2 -> deepseek_v3, kimi-linear -> kimi_linear, qwen3next -> qwen3_next.
What the converter changes, and what is undone here (per tensor, on read):
- routed experts are stacked per layer into `blk.{l}.ffn_{gate,up,down}_exps` [E, R, C]: one expert is one
  slice of the memory map; MXFP4 and Q8_0 experts are handed over as stored (`GGUFTensorIndex.kept`);
- MLA's `kv_b_proj` [NA*(DN+DV), KL] is split into `attn_k_b` [NA, KL, DN] (transposed) and `attn_v_b`
  [NA, DV, KL]: joined back; stored as Q8_0, they are also given as they are, `kv_b_proj.k_b` [NA*KL, DN] and
  `kv_b_proj.v_b` [NA*DV, KL] (2-D, heads stacked), which the MLA builder keeps as Q8_0 blocks (`build_mla`);
- KDA and gated DeltaNet store `ssm_a = -exp(A_log)`: A_log = log(-ssm_a) (the builders take exp again, so
  exp(log(a)) differs from a by rounding only); `dt_bias` is `ssm_dt.bias`;
- Qwen3-Next: its (1 + w) RMSNorm weights are stored with the 1 added (we subtract it, exactly, since the
  stored values lie in [0.5, 2]), and `in_proj_qkvz`, laid out per key head in the checkpoint, is stored as
  `attn_qkv` (all q, all k, all v) plus `attn_gate` (z): interleaved back per key head.
What a GGUF cannot say and is taken as llama.cpp takes it: Qwen3-MoE has no dense layers (llama.cpp's qwen3moe
has none) and renormalises its top-k; Kimi Linear routes over one group and renormalises; DeepSeek-V3's YaRN
`mscale` equals `mscale_all_dim` (only the latter is stored, as yarn_log_multiplier = 0.1 * mscale_all_dim).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from k3serve.errors import CheckpointError
from k3serve.weights.gguf_file import GGUFFile
from k3serve.weights.quantized import QuantizedMatrix

# llama.cpp architecture -> our model_type
GGUF_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v3", "kimi-linear": "kimi_linear",
                      "qwen3next": "qwen3_next"}
_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
_SOFTMAX_GATING = 1


class _Info(NamedTuple):
    dtype: str
    shape: tuple[int, ...] | None


Loader = Callable[[], np.ndarray]


class GGUFTensorIndex:
    """Our tensor names -> loaders over a `GGUFFile`: the part of `SafetensorsIndex`'s interface that
    `TensorReader` and `pack` use (`in`, `len`, `iter`, `info`, `read`, `close`), plus `kept(name)` for experts
    kept as stored (MXFP4, Q8_0)."""

    def __init__(self, file: GGUFFile, loaders: dict[str, Loader], packed: dict[str, Callable],
                 blocks: dict[str, Callable[[], QuantizedMatrix]] | None = None) -> None:
        self.file = file
        self._loaders = loaders
        self._packed = packed  # name -> () -> (kind, a, b) for MXFP4 and Q8_0 expert matrices (`kept`)
        self._blocks = blocks or {}  # name -> () -> its Q8_0 blocks, for 2-D trunk tensors stored as Q8_0

    def __contains__(self, name: object) -> bool:
        return name in self._loaders

    def __len__(self) -> int:
        return len(self._loaders)

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def info(self, name: str) -> _Info:
        return _Info("F32", None)

    def read(self, name: str) -> np.ndarray:
        loader = self._loaders.get(name)
        if loader is None:
            raise CheckpointError(f"{self.file.path}: no tensor maps to {name!r}")
        return loader()

    def q8_0_blocks(self, name: str) -> QuantizedMatrix | None:
        """A trunk matrix the file stores as Q8_0, as its blocks (views of the mapped file), else None."""
        read = self._blocks.get(name)
        return None if read is None else read()

    def kept(self, name: str) -> tuple[str, np.ndarray, np.ndarray] | None:
        """An expert matrix kept as stored, or None if `name` is not one: ("mxfp4", packed u8 [R, C/2], scales
        u8 [R, C/32]) in our layout, or ("q8_0", values i8 [R, C], scales f32 [R, C/32])."""
        read = self._packed.get(name)
        return None if read is None else read()

    def close(self) -> None:
        self.file.close()


# ---- config ---------------------------------------------------------------------------------------------------

def _vocab_size(file: GGUFFile) -> int:
    return file.tensor("token_embd.weight").shape[0]


def _common(file: GGUFFile, model_type: str) -> dict[str, Any]:
    bos = file.get("tokenizer.ggml.bos_token_id", None)
    eos = file.get("tokenizer.ggml.eos_token_id", None)
    eot = file.get("tokenizer.ggml.eot_token_id", None)
    eos_ids = [int(i) for i in (eos, eot) if i is not None]
    return {
        "model_type": model_type,
        "vocab_size": _vocab_size(file),
        "hidden_size": int(file.get("{arch}.embedding_length")),
        "num_hidden_layers": int(file.get("{arch}.block_count")),
        "rms_norm_eps": float(file.get("{arch}.attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in file,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": list(dict.fromkeys(eos_ids)) or None,
        "hidden_act": "silu",
        "max_position_embeddings": file.get("{arch}.context_length", None),
    }


def _rope(file: GGUFFile, where: str) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(file.get("{arch}.rope.freq_base", 10000.0))}
    scaling = file.get("{arch}.rope.scaling.type", "none")
    if scaling == "yarn":
        multiplier = float(file.get("{arch}.rope.scaling.yarn_log_multiplier", 0.0))
        mscale_all_dim = round(multiplier / 0.1, 6)
        rope.update(rope_type="yarn", factor=float(file.get("{arch}.rope.scaling.factor")),
                    original_max_position_embeddings=int(file.get("{arch}.rope.scaling.original_context_length")),
                    beta_fast=float(file.get("{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(file.get("{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                    mscale=mscale_all_dim, mscale_all_dim=mscale_all_dim)
    elif scaling not in ("none", None):
        raise CheckpointError(f"{file.path} ({where}): rope scaling {scaling!r} is not supported (none, yarn)")
    return rope


def _check_gating(file: GGUFFile, expected: int, default: int) -> None:
    gating = int(file.get("{arch}.expert_gating_func", default))
    if gating != expected:
        names = {_SOFTMAX_GATING: "softmax", _SIGMOID_GATING: "sigmoid"}
        raise CheckpointError(f"{file.path} ({file.architecture}): expert gating function "
                              f"{names.get(gating, gating)} is not supported for this architecture")


def _per_layer(value: Any, num_layers: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * num_layers


def _mla(file: GGUFFile) -> dict[str, Any]:
    heads = int(file.get("{arch}.attention.head_count"))
    rope_dim = int(file.get("{arch}.rope.dimension_count"))
    key_mla = int(file.get("{arch}.attention.key_length_mla"))
    q_lora = file.get("{arch}.attention.q_lora_rank", None)
    return {
        "num_attention_heads": heads,
        # llama.cpp writes 0 (or nothing) for a model without a query LoRA (Moonlight, DeepSeek-V2-Lite) and
        # builds the layer without one when the rank is 0
        "q_lora_rank": int(q_lora or 0) or None,
        "kv_lora_rank": int(file.get("{arch}.attention.kv_lora_rank")),
        "qk_nope_head_dim": key_mla - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": int(file.get("{arch}.attention.value_length_mla")),
        "n_routed_experts": int(file.get("{arch}.expert_count")),
        "num_experts_per_tok": int(file.get("{arch}.expert_used_count")),
        "n_shared_experts": int(file.get("{arch}.expert_shared_count", 0)),
        "moe_intermediate_size": int(file.get("{arch}.expert_feed_forward_length")),
        "intermediate_size": int(file.get("{arch}.feed_forward_length")),
        "routed_scaling_factor": float(file.get("{arch}.expert_weights_scale", 1.0)),
        "first_k_dense_replace": int(file.get("{arch}.leading_dense_block_count", 0)),
    }


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The family config.json (as a dict) that the GGUF metadata describes."""
    arch = file.architecture
    model_type = GGUF_ARCHITECTURES.get(arch)
    if model_type is None:
        raise CheckpointError(f"{file.path}: GGUF architecture {arch!r} is not supported (supported: "
                              f"{', '.join(sorted(GGUF_ARCHITECTURES))}, and kimi-k3)")
    config = _common(file, model_type)
    L = config["num_hidden_layers"]
    if arch in ("qwen3moe", "qwen3next"):
        heads = int(file.get("{arch}.attention.head_count"))
        head_dim = int(file.get("{arch}.attention.key_length"))
        rope = _rope(file, arch)
        config.update(num_attention_heads=heads, num_key_value_heads=int(file.get("{arch}.attention.head_count_kv")),
                      head_dim=head_dim, num_experts=int(file.get("{arch}.expert_count")),
                      num_experts_per_tok=int(file.get("{arch}.expert_used_count")),
                      moe_intermediate_size=int(file.get("{arch}.expert_feed_forward_length")),
                      intermediate_size=int(file.get("{arch}.feed_forward_length", 0)) or 1,
                      norm_topk_prob=bool(file.get("{arch}.expert_weights_norm", True)),
                      mlp_only_layers=[], decoder_sparse_step=1, rope_parameters=rope)
        _check_gating(file, _SOFTMAX_GATING, _SOFTMAX_GATING)
        if arch == "qwen3next":
            rope["partial_rotary_factor"] = int(file.get("{arch}.rope.dimension_count")) / head_dim
            value_heads = int(file.get("{arch}.ssm.time_step_rank"))
            recurrent = file.get("{arch}.attention.recurrent_layers", None)
            if recurrent is None:
                interval = int(file.get("{arch}.full_attention_interval", 4))
                recurrent = [(l + 1) % interval != 0 for l in range(L)]
            config.update(layer_types=["linear_attention" if r else "full_attention" for r in list(recurrent)[:L]],
                          linear_conv_kernel_dim=int(file.get("{arch}.ssm.conv_kernel")),
                          linear_key_head_dim=int(file.get("{arch}.ssm.state_size")),
                          linear_value_head_dim=int(file.get("{arch}.ssm.inner_size")) // value_heads,
                          linear_num_key_heads=int(file.get("{arch}.ssm.group_count")),
                          linear_num_value_heads=value_heads,
                          shared_expert_intermediate_size=int(file.get("{arch}.expert_shared_feed_forward_length")))
        return config
    config.update(_mla(file))
    _check_gating(file, _SIGMOID_GATING, _SIGMOID_GATING)
    if arch == "deepseek2":
        config.update(n_group=int(file.get("{arch}.expert_group_count", 1)),
                      topk_group=int(file.get("{arch}.expert_group_used_count", 1)),
                      norm_topk_prob=bool(file.get("{arch}.expert_weights_norm", False)),
                      rope_parameters=_rope(file, arch), rope_interleave=True)
        return config
    # kimi-linear: n_head_kv 0 marks a KDA layer
    kv_heads = _per_layer(file.get("{arch}.attention.head_count_kv"), L)
    config.update(layer_types=["linear_attention" if int(n) == 0 else "full_attention" for n in kv_heads],
                  # llama.cpp's kimi-linear routes over one group and always renormalises the top-k
                  n_group=1, topk_group=1, norm_topk_prob=True,
                  linear_num_heads=int(file.get("{arch}.attention.head_count")),
                  linear_head_dim=int(file.get("{arch}.kda.head_dim")),
                  linear_conv_kernel_dim=int(file.get("{arch}.ssm.conv_kernel")))
    return config


# ---- tensors --------------------------------------------------------------------------------------------------

class _Builder:
    """Collects our-name -> loader entries for the tensors a GGUF file holds."""

    def __init__(self, file: GGUFFile) -> None:
        self.file = file
        self.loaders: dict[str, Loader] = {}
        self.packed: dict[str, Callable] = {}
        self.blocks: dict[str, Callable[[], QuantizedMatrix]] = {}

    def plain(self, ours: str, theirs: str, transform: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        if theirs not in self.file:
            return
        file = self.file
        self.loaders[ours] = ((lambda: file.f32(theirs)) if transform is None
                              else (lambda: transform(file.f32(theirs))))
        tensor = file.tensor(theirs)
        if transform is None and tensor.type_name == "Q8_0" and len(tensor.shape) == 2:
            rows, cols = tensor.shape
            self.blocks[ours] = lambda: QuantizedMatrix("q8_0", np.asarray(file.tensor(theirs).data).reshape(rows, -1),
                                                        None, cols)

    def experts(self, ours: Callable[[int, str], str], layer: int, names: tuple[str, str, str]) -> None:
        """Per-expert names for the stacked gate, up, down tensors of `layer`."""
        file = self.file
        for matrix, kind in zip(names, ("gate", "up", "down")):
            theirs = f"blk.{layer}.ffn_{kind}_exps.weight"
            if theirs not in file:
                continue
            tensor = file.tensor(theirs)
            for e in range(tensor.shape[0]):
                name = ours(e, matrix)
                self.loaders[name] = (lambda t=theirs, e=e: file.f32(t, e))
                if tensor.type_name == "MXFP4":
                    self.packed[name] = (lambda t=theirs, e=e: ("mxfp4", *file.mxfp4(t, e)))
                elif tensor.type_name == "Q8_0":
                    self.packed[name] = (lambda t=theirs, e=e: ("q8_0", *file.q8_0(t, e)))

    def kv_b(self, ours: str, layer: int) -> None:
        """kv_b_proj [NA*(DN+DV), KL] from attn_k_b [NA, KL, DN] and attn_v_b [NA, DV, KL] (or attn_kv_b)."""
        file = self.file
        if f"blk.{layer}.attn_kv_b.weight" in file:
            self.plain(ours, f"blk.{layer}.attn_kv_b.weight")
            return
        k_name, v_name = f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"
        if k_name not in file or v_name not in file:
            return

        def load() -> np.ndarray:
            k_b = file.f32(k_name)  # [NA, KL, DN]
            v_b = file.f32(v_name)  # [NA, DV, KL]
            if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
                raise CheckpointError(f"{file.path}: {k_name} {list(k_b.shape)} and {v_name} {list(v_b.shape)} "
                                      "do not form one kv_b projection")
            joined = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [NA, DN+DV, KL]
            return np.ascontiguousarray(joined.reshape(-1, joined.shape[2]))

        self.loaders[ours] = load
        k_tensor, v_tensor = file.tensor(k_name), file.tensor(v_name)
        if k_tensor.type_name == "Q8_0" and v_tensor.type_name == "Q8_0" and len(k_tensor.shape) == 3 \
                and len(v_tensor.shape) == 3:  # also given as the file holds them: per-head Q8_0 (`build_mla`)
            prefix = ours[:-len("weight")]
            for suffix, name, (heads, rows, cols) in (("k_b", k_name, k_tensor.shape),
                                                      ("v_b", v_name, v_tensor.shape)):
                self.loaders[prefix + suffix] = (lambda n=name, r=heads * rows: file.f32(n).reshape(r, -1))
                self.blocks[prefix + suffix] = (
                    lambda n=name, r=heads * rows, c=cols: QuantizedMatrix(
                        "q8_0", np.asarray(file.tensor(n).data).reshape(r, -1), None, c))


def _a_log(ssm_a: np.ndarray) -> np.ndarray:
    return np.log(-ssm_a.reshape(-1)).astype(np.float32)


def _one_row(w: np.ndarray) -> np.ndarray:
    return w.reshape(1, -1)


def _minus_one(w: np.ndarray) -> np.ndarray:
    return (w - np.float32(1.0)).astype(np.float32)


def _common_tensors(b: _Builder, num_layers: int, norm: Callable | None = None) -> None:
    b.plain("model.embed_tokens.weight", "token_embd.weight")
    b.plain("lm_head.weight", "output.weight")
    b.plain("model.norm.weight", "output_norm.weight", norm)
    for l in range(num_layers):
        p = f"model.layers.{l}."
        b.plain(f"{p}input_layernorm.weight", f"blk.{l}.attn_norm.weight", norm)
        b.plain(f"{p}post_attention_layernorm.weight", f"blk.{l}.ffn_norm.weight", norm)
        b.plain(f"{p}post_attention_layernorm.weight", f"blk.{l}.post_attention_norm.weight", norm)


def _dense_mlp(b: _Builder, prefix: str, l: int) -> None:
    for kind in ("gate", "up", "down"):
        b.plain(f"{prefix}{kind}_proj.weight", f"blk.{l}.ffn_{kind}.weight")


def _shared_experts(b: _Builder, prefix: str, l: int) -> None:
    for kind in ("gate", "up", "down"):
        b.plain(f"{prefix}{kind}_proj.weight", f"blk.{l}.ffn_{kind}_shexp.weight")


def _gqa(b: _Builder, l: int, norm: Callable | None = None) -> None:
    a = f"model.layers.{l}.self_attn."
    for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
        b.plain(f"{a}{ours}.weight", f"blk.{l}.{theirs}.weight")
    b.plain(f"{a}q_norm.weight", f"blk.{l}.attn_q_norm.weight", norm)
    b.plain(f"{a}k_norm.weight", f"blk.{l}.attn_k_norm.weight", norm)


def _mla_tensors(b: _Builder, l: int) -> None:
    a = f"model.layers.{l}.self_attn."
    for ours, theirs in (("q_proj", "attn_q"), ("q_a_proj", "attn_q_a"), ("q_a_layernorm", "attn_q_a_norm"),
                         ("q_b_proj", "attn_q_b"), ("kv_a_proj_with_mqa", "attn_kv_a_mqa"),
                         ("kv_a_layernorm", "attn_kv_a_norm"), ("o_proj", "attn_output")):
        b.plain(f"{a}{ours}.weight", f"blk.{l}.{theirs}.weight")
    b.kv_b(f"{a}kv_b_proj.weight", l)


def _grouped_router(b: _Builder, prefix: str, l: int) -> None:
    b.plain(f"{prefix}gate.weight", f"blk.{l}.ffn_gate_inp.weight")
    b.plain(f"{prefix}gate.e_score_correction_bias", f"blk.{l}.exp_probs_b.bias")


def _qkvz(file: GGUFFile, l: int, key_heads: int, key_dim: int, value_dim_per_key_head: int) -> Loader:
    """in_proj_qkvz [NKH*(2Dk + 2gDv), H] from attn_qkv [2*NKH*Dk + NKH*gDv, H] and attn_gate [NKH*gDv, H]."""
    def load() -> np.ndarray:
        rows = np.concatenate([file.f32(f"blk.{l}.attn_qkv.weight"), file.f32(f"blk.{l}.attn_gate.weight")])
        return np.ascontiguousarray(rows[_qkvz_rows(key_heads, key_dim, value_dim_per_key_head)])

    return load


def _qkvz_rows(key_heads: int, key_dim: int, value_dim_per_key_head: int) -> np.ndarray:
    """The rows of [attn_qkv; attn_gate] that make in_proj_qkvz, head by head: q, k, v, z of key head 0, then 1..."""
    q_rows, v_rows = key_heads * key_dim, key_heads * value_dim_per_key_head
    heads = np.arange(key_heads)[:, None]
    q = heads * key_dim + np.arange(key_dim)
    v = heads * value_dim_per_key_head + np.arange(value_dim_per_key_head)
    return np.concatenate([q, q_rows + q, 2 * q_rows + v, 2 * q_rows + v_rows + v], axis=1).reshape(-1)


def _qkvz_blocks(file: GGUFFile, l: int, key_heads: int, key_dim: int,
                 value_dim_per_key_head: int) -> Callable[[], QuantizedMatrix]:
    """in_proj_qkvz as Q8_0 blocks, for a file whose attn_qkv and attn_gate are both Q8_0: the same rows as `_qkvz`
    picks, taken from the blocks (a row's blocks are its own), so the matrix stays as the file holds it."""
    def load() -> QuantizedMatrix:
        parts = [file.tensor(f"blk.{l}.{name}.weight") for name in ("attn_qkv", "attn_gate")]
        data = np.concatenate([np.asarray(part.data).reshape(part.shape[0], -1) for part in parts])
        held = QuantizedMatrix("q8_0", data[_qkvz_rows(key_heads, key_dim, value_dim_per_key_head)], None,
                               parts[0].shape[1])
        for part in parts:
            file.release(part.data)
        return held

    return load


def tensor_index(file: GGUFFile, config: dict[str, Any]) -> GGUFTensorIndex:
    """Our names for every tensor of `file`, for the family `config` (from `hf_config(file)`) describes."""
    b = _Builder(file)
    arch, L = file.architecture, config["num_hidden_layers"]
    if arch == "qwen3moe":
        _common_tensors(b, L)
        for l in range(L):
            p = f"model.layers.{l}."
            _gqa(b, l)
            b.plain(f"{p}mlp.gate.weight", f"blk.{l}.ffn_gate_inp.weight")
            b.experts(lambda e, m, p=p: f"{p}mlp.experts.{e}.{m}.weight", l, ("gate_proj", "up_proj", "down_proj"))
            _dense_mlp(b, f"{p}mlp.", l)
    elif arch == "qwen3next":
        _common_tensors(b, L, norm=_minus_one)
        NKH, NVH = config["linear_num_key_heads"], config["linear_num_value_heads"]
        Dk, Dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
        for l in range(L):
            p = f"model.layers.{l}."
            if config["layer_types"][l] == "full_attention":
                _gqa(b, l, norm=_minus_one)
            else:
                a = f"{p}linear_attn."
                if f"blk.{l}.attn_qkv.weight" in file and f"blk.{l}.attn_gate.weight" in file:
                    b.loaders[f"{a}in_proj_qkvz.weight"] = _qkvz(file, l, NKH, Dk, NVH // NKH * Dv)
                    if all(file.tensor(f"blk.{l}.{n}.weight").type_name == "Q8_0" for n in ("attn_qkv", "attn_gate")):
                        b.blocks[f"{a}in_proj_qkvz.weight"] = _qkvz_blocks(file, l, NKH, Dk, NVH // NKH * Dv)
                b.plain(f"{a}in_proj_ba.weight", f"blk.{l}.ssm_ba.weight")
                b.plain(f"{a}conv1d.weight", f"blk.{l}.ssm_conv1d.weight", lambda w: w.reshape(w.shape[0], 1, -1))
                b.plain(f"{a}A_log", f"blk.{l}.ssm_a", _a_log)
                b.plain(f"{a}dt_bias", f"blk.{l}.ssm_dt.bias")
                b.plain(f"{a}norm.weight", f"blk.{l}.ssm_norm.weight")
                b.plain(f"{a}out_proj.weight", f"blk.{l}.ssm_out.weight")
            b.plain(f"{p}mlp.gate.weight", f"blk.{l}.ffn_gate_inp.weight")
            b.experts(lambda e, m, p=p: f"{p}mlp.experts.{e}.{m}.weight", l, ("gate_proj", "up_proj", "down_proj"))
            _shared_experts(b, f"{p}mlp.shared_expert.", l)
            # llama.cpp's converter writes the [1, H] gate as a vector [H] (its loader asks for { n_embd })
            b.plain(f"{p}mlp.shared_expert_gate.weight", f"blk.{l}.ffn_gate_inp_shexp.weight", _one_row)
            _dense_mlp(b, f"{p}mlp.", l)
    elif arch == "deepseek2":
        _common_tensors(b, L)
        for l in range(L):
            p = f"model.layers.{l}."
            _mla_tensors(b, l)
            _grouped_router(b, f"{p}mlp.", l)
            b.experts(lambda e, m, p=p: f"{p}mlp.experts.{e}.{m}.weight", l, ("gate_proj", "up_proj", "down_proj"))
            _shared_experts(b, f"{p}mlp.shared_experts.", l)
            _dense_mlp(b, f"{p}mlp.", l)
    elif arch == "kimi-linear":
        _common_tensors(b, L)
        for l in range(L):
            p = f"model.layers.{l}."
            a = f"{p}self_attn."
            if config["layer_types"][l] == "full_attention":
                _mla_tensors(b, l)
            else:
                for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                                     ("o_proj", "attn_output"), ("f_a_proj", "ssm_f_a"), ("f_b_proj", "ssm_f_b"),
                                     ("g_a_proj", "ssm_g_a"), ("g_b_proj", "ssm_g_b"), ("b_proj", "ssm_beta"),
                                     ("o_norm", "ssm_norm")):
                    b.plain(f"{a}{ours}.weight", f"blk.{l}.{theirs}.weight")
                for n in "qkv":  # ggml [K, 1, P, 1] = numpy (1, P, 1, K) -> ours [P, 1, K]
                    b.plain(f"{a}{n}_conv1d.weight", f"blk.{l}.ssm_conv1d_{n}.weight",
                            lambda w: w.reshape(-1, 1, w.shape[-1]))
                b.plain(f"{a}A_log", f"blk.{l}.ssm_a", _a_log)
                b.plain(f"{a}dt_bias", f"blk.{l}.ssm_dt.bias")
            moe = f"{p}block_sparse_moe."
            _grouped_router(b, moe, l)
            b.experts(lambda e, m, moe=moe: f"{moe}experts.{e}.{m}.weight", l, ("w1", "w3", "w2"))
            _shared_experts(b, f"{moe}shared_experts.", l)
            _dense_mlp(b, f"{p}mlp.", l)
    else:  # hf_config refused it already
        raise CheckpointError(f"{file.path}: GGUF architecture {arch!r} is not supported")
    return GGUFTensorIndex(file, b.loaders, b.packed, b.blocks)


def describe(file: GGUFFile) -> str:
    """One line for logs: architecture and tensor types."""
    counts = ", ".join(f"{n} {k}" for k, n in sorted(file.type_counts().items()))
    return f"{file.architecture} ({counts})"
