"""A K3 GGUF file (llama.cpp architecture `kimi-k3`) read as a K3 checkpoint: config and released tensor names.

llama.cpp's K3 converter (conversion/kimi_k3.py) writes the released checkpoint with these changes, undone here:
- the attention-residual pairs `<x>_res_norm` [H] and `<x>_res_proj` [1, H] are only ever used as their product
  (K3_SPEC section 5: score = key . (norm_w * proj_w)); the file stores that product (f32) as `*_res_score`. We
  hand it back as the norm with a projection of ones: our query norm * 1 is the same float32 vector;
- `A_log` [D] becomes `ssm_a = -exp(A_log[:NH])`: only the NH values K3 uses are kept (K3_SPEC section 3), read
  back as log(-ssm_a) and padded with zeros to D (exp(log(a)) differs from a by rounding only);
- MLA's `kv_b_proj` is split into `attn_k_b` (transposed) and `attn_v_b`; routed experts are stacked per layer;
  KDA's `g_proj` is `ssm_g`, MLA's is `attn_gate`; `dt_bias` is `ssm_dt.bias`.
Routed experts must be MXFP4 (llama.cpp's block layout, converted to ours by `GGUFFile.mxfp4` without floats):
K3 computes its experts from MXFP4 only, so a file with other expert types is refused naming the type.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from k3serve.config import K3Config, MXFP4_GROUP_SIZE
from k3serve.errors import CheckpointError
from k3serve.weights import names
from k3serve.weights.gguf_file import GGUFFile
from k3serve.weights.held import quantized_in_trunk
from k3serve.weights.q8_0 import q8_0_nbytes
from k3serve.weights.quantized import QuantizedMatrix

ARCHITECTURE = "kimi-k3"
_SIGMOID_GATING = 2


class _Info(NamedTuple):
    shape: tuple[int, ...]
    dtype: str  # "F32" for every float tensor (read as float32), "U8" for MXFP4 bytes, "Q8_0" for a Q8_0 trunk matrix

    @property
    def nbytes(self) -> int:
        if self.dtype == "Q8_0":
            return q8_0_nbytes(*self.shape)
        return int(np.prod(self.shape)) * (1 if self.dtype == "U8" else 4)


class _Entry(NamedTuple):
    shape: tuple[int, ...]
    dtype: str
    load: Callable[[], np.ndarray]


def k3_config(file: GGUFFile) -> K3Config:
    """The K3Config the GGUF metadata describes (through the released nested config.json form)."""
    if file.architecture != ARCHITECTURE:
        raise CheckpointError(f"{file.path}: GGUF architecture {file.architecture!r} is not K3 ({ARCHITECTURE})")
    get = file.get
    L = int(get("{arch}.block_count"))
    kv_heads = get("{arch}.attention.head_count_kv")
    kv_heads = list(kv_heads) if isinstance(kv_heads, (list, tuple)) else [kv_heads] * L
    full = [l + 1 for l in range(L) if int(kv_heads[l]) > 0]
    gating = int(get("{arch}.expert_gating_func", _SIGMOID_GATING))
    if gating != _SIGMOID_GATING:
        raise CheckpointError(f"{file.path}: K3's router is sigmoid; the file says gating function {gating}")
    rope_dim = int(get("{arch}.rope.dimension_count"))
    heads = int(get("{arch}.attention.head_count"))
    eos = [int(get(k)) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if get(k, None) is not None]
    text = {
        "hidden_size": int(get("{arch}.embedding_length")),
        "num_hidden_layers": L,
        "vocab_size": int(get("{arch}.vocab_size", file.tensor("token_embd.weight").shape[0])),
        "rms_norm_eps": float(get("{arch}.attention.layer_norm_rms_epsilon")),
        "num_attention_heads": heads,
        "q_lora_rank": int(get("{arch}.attention.q_lora_rank")),
        "kv_lora_rank": int(get("{arch}.attention.kv_lora_rank")),
        "qk_nope_head_dim": int(get("{arch}.attention.key_length_mla")) - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": int(get("{arch}.attention.value_length_mla")),
        "mla_use_output_gate": any(f"blk.{l - 1}.attn_gate.weight" in file for l in full),
        "num_experts": int(get("{arch}.expert_count")),
        "num_experts_per_token": int(get("{arch}.expert_used_count")),
        "num_shared_experts": int(get("{arch}.expert_shared_count")),
        "routed_expert_hidden_size": int(get("{arch}.expert_latent_length")),
        "moe_intermediate_size": int(get("{arch}.expert_feed_forward_length")),
        "routed_scaling_factor": float(get("{arch}.expert_weights_scale", 1.0)),
        "moe_renormalize": bool(get("{arch}.expert_weights_norm", False)),
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "num_expert_group": int(get("{arch}.expert_group_count", 1)),
        "topk_group": int(get("{arch}.expert_group_used_count", 1)),
        "first_k_dense_replace": int(get("{arch}.leading_dense_block_count", 0)),
        "intermediate_size": int(get("{arch}.feed_forward_length")),
        "attn_res_block_size": int(get("{arch}.attn_res.block_size")),
        "activation_situ_beta": float(get("{arch}.activation.situ_beta")),
        "activation_situ_linear_beta": float(get("{arch}.activation.situ_linear_beta")),
        "hidden_act": "situ",
        "mla_use_nope": True,
        "linear_attn_config": {
            "num_heads": heads,
            "head_dim": int(get("{arch}.kda.head_dim")),
            "short_conv_kernel_size": int(get("{arch}.ssm.conv_kernel")),
            "gate_lower_bound": float(get("{arch}.kda.gate_lower_bound", -5.0)),
            "full_attn_layers": full,
            "kda_layers": [l + 1 for l in range(L) if l + 1 not in full],
        },
    }
    if get("{arch}.context_length", None) is not None:
        text["max_position_embeddings"] = int(get("{arch}.context_length"))
    if get("tokenizer.ggml.bos_token_id", None) is not None:
        text["bos_token_id"] = int(get("tokenizer.ggml.bos_token_id"))
    if eos:
        text["eos_token_id"] = eos[0]
        if len(eos) > 1 and eos[1] != eos[0]:
            text["extra_stop_token_ids"] = eos[1:]
    return K3Config.from_dict({"model_type": "kimi_k3", "text_config": text})


class GGUFK3Index:
    """Released K3 tensor names -> reads of a kimi-k3 GGUF file: the part of `SafetensorsIndex` that
    `Checkpoint` and `pack` use (`in`, `len`, `info`, `read`, `read_raw`, `close`)."""

    def __init__(self, file: GGUFFile, config: K3Config) -> None:
        self.file = file
        self.config = config
        self._entries: dict[str, _Entry] = {}
        self._last_mxfp4: tuple[tuple[str, int], tuple[np.ndarray, np.ndarray]] | None = None
        self._map()

    # ---- the SafetensorsIndex part Checkpoint uses ----------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def info(self, name: str) -> _Info:
        entry = self._entries[name]
        return _Info(entry.shape, entry.dtype)

    def read(self, name: str) -> np.ndarray:
        entry = self._entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.file.path}: no GGUF tensor maps to {name!r}")
        array = entry.load()
        if tuple(array.shape) != entry.shape:
            raise CheckpointError(f"{self.file.path}: {name!r} read as {list(array.shape)}, expected "
                                  f"{list(entry.shape)}")
        return array

    def read_raw(self, name: str) -> np.ndarray:
        """The tensor as `read` gives it (float32, MXFP4 bytes or Q8_0 blocks), as a uint8 array [nbytes]: what a
        packed store holds for it."""
        array = self.read(name)
        if isinstance(array, QuantizedMatrix):
            return np.frombuffer(array.to_bytes(), np.uint8)
        return np.ascontiguousarray(array).view(np.uint8).reshape(-1)

    def close(self) -> None:
        self.file.close()

    # ---- mapping --------------------------------------------------------------------------------------------

    def _float(self, ours: str, theirs: str, shape: tuple[int, ...] | None = None,
               transform: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        if theirs not in self.file:
            return
        file = self.file
        if shape is None:
            shape = file.tensor(theirs).shape
        if transform is None and file.tensor(theirs).type_name == "Q8_0" and quantized_in_trunk(ours, shape):
            # a trunk matrix llama.cpp stored as Q8_0 stays Q8_0: its blocks (views of the mapped file), multiplied
            # by the Q8_0 kernel, never widened
            def blocks() -> QuantizedMatrix:
                return QuantizedMatrix("q8_0", np.asarray(file.tensor(theirs).data).reshape(shape[0], -1), None,
                                       shape[1])

            self._entries[ours] = _Entry(tuple(shape), "Q8_0", blocks)
            return

        def load() -> np.ndarray:
            array = file.f32(theirs)
            return transform(array) if transform is not None else array

        self._entries[ours] = _Entry(tuple(shape), "F32", load)

    def _ones(self, ours: str, shape: tuple[int, ...]) -> None:
        self._entries[ours] = _Entry(shape, "F32", lambda: np.ones(shape, np.float32))

    def _mxfp4(self, theirs: str, expert: int) -> tuple[np.ndarray, np.ndarray]:
        key = (theirs, expert)
        if self._last_mxfp4 is None or self._last_mxfp4[0] != key:  # packed and scales are read back to back
            self._last_mxfp4 = (key, self.file.mxfp4(theirs, expert))
        return self._last_mxfp4[1]

    def _experts(self, layer: int) -> None:
        c = self.config
        for matrix, kind in zip(names.EXPERT_MATRICES, ("gate", "up", "down")):
            theirs = f"blk.{layer}.ffn_{kind}_exps.weight"
            if theirs not in self.file:
                continue
            tensor = self.file.tensor(theirs)
            if tensor.type_name != "MXFP4":
                raise CheckpointError(f"{self.file.path}: K3 routed experts must be MXFP4; {theirs} has GGUF type "
                                      f"{tensor.type_name}")
            rows, cols = names.expert_matrix_shape(c, matrix)
            for e in range(tensor.shape[0]):
                for part, index, shape in (("weight_packed", 0, (rows, cols // 2)),
                                           ("weight_scale", 1, (rows, cols // MXFP4_GROUP_SIZE))):
                    self._entries[names.expert_name(layer, e, matrix, part)] = _Entry(
                        shape, "U8", lambda t=theirs, e=e, i=index: self._mxfp4(t, e)[i])

    def _map(self) -> None:
        c, H = self.config, self.config.hidden_size
        self._float(names.EMBED, "token_embd.weight")
        self._float(names.LM_HEAD, "output.weight" if "output.weight" in self.file else "token_embd.weight")
        self._float(names.FINAL_NORM, "output_norm.weight")
        self._float(names.OUTPUT_RES_NORM, "output_res_score.weight", (H,))
        self._ones(names.OUTPUT_RES_PROJ, (1, H))
        for l in range(c.num_layers):
            p, b = names.layer_prefix(l), f"blk.{l}."
            a = f"{p}self_attn."
            self._float(f"{p}input_layernorm.weight", f"{b}attn_norm.weight")
            self._float(f"{p}post_attention_layernorm.weight", f"{b}ffn_norm.weight")
            self._float(f"{p}self_attention_res_norm.weight", f"{b}attn_res_score.weight", (H,))
            self._float(f"{p}mlp_res_norm.weight", f"{b}ffn_res_score.weight", (H,))
            self._ones(f"{p}self_attention_res_proj.weight", (1, H))
            self._ones(f"{p}mlp_res_proj.weight", (1, H))
            if c.is_mla(l):
                for ours, theirs in (("q_a_proj", "attn_q_a"), ("q_a_layernorm", "attn_q_a_norm"),
                                     ("q_b_proj", "attn_q_b"), ("kv_a_proj_with_mqa", "attn_kv_a_mqa"),
                                     ("kv_a_layernorm", "attn_kv_a_norm"), ("o_proj", "attn_output"),
                                     ("g_proj", "attn_gate")):
                    self._float(f"{a}{ours}.weight", f"{b}{theirs}.weight")
                self._kv_b(f"{a}kv_b_proj.weight", l)
            else:
                P, D, K = c.kda_proj_size, c.kda_head_dim, c.short_conv_kernel_size
                for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                                     ("g_proj", "ssm_g"), ("o_proj", "attn_output"), ("f_a_proj", "ssm_f_a"),
                                     ("f_b_proj", "ssm_f_b"), ("b_proj", "ssm_beta"), ("o_norm", "ssm_norm")):
                    self._float(f"{a}{ours}.weight", f"{b}{theirs}.weight")
                for n in "qkv":  # ggml [K, 1, P, 1] = numpy (1, P, 1, K)
                    self._float(f"{a}{n}_conv1d.weight", f"{b}ssm_conv1d_{n}.weight", (P, 1, K),
                                lambda w, P=P, K=K: w.reshape(P, 1, K))
                self._float(f"{a}A_log", f"{b}ssm_a", (D,), lambda a, D=D: _a_log(a, D))
                self._float(f"{a}dt_bias", f"{b}ssm_dt.bias", (P,), lambda w: w.reshape(-1))
            if c.is_dense(l):
                for kind in ("gate", "up", "down"):
                    self._float(f"{p}mlp.{kind}_proj.weight", f"{b}ffn_{kind}.weight")
            else:
                m = names.moe_prefix(l)
                self._float(f"{m}gate.weight", f"{b}ffn_gate_inp.weight")
                self._float(f"{m}gate.e_score_correction_bias", f"{b}exp_probs_b.bias", (c.num_experts,),
                            lambda w: w.reshape(-1))
                self._float(f"{m}routed_expert_down_proj.weight", f"{b}ffn_routed_down.weight")
                self._float(f"{m}routed_expert_up_proj.weight", f"{b}ffn_routed_up.weight")
                self._float(f"{m}routed_expert_norm.weight", f"{b}ffn_routed_norm.weight")
                for kind in ("gate", "up", "down"):
                    self._float(f"{m}shared_experts.{kind}_proj.weight", f"{b}ffn_{kind}_shexp.weight")
                self._experts(l)

    def _kv_b(self, ours: str, layer: int) -> None:
        c, file = self.config, self.file
        k_name, v_name = f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"
        if k_name not in file or v_name not in file:
            return
        NA, DN, DV, KL = c.num_mla_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank

        def load() -> np.ndarray:
            k_b = file.f32(k_name)  # [NA, KL, DN]
            v_b = file.f32(v_name)  # [NA, DV, KL]
            if k_b.shape != (NA, KL, DN) or v_b.shape != (NA, DV, KL):
                raise CheckpointError(f"{file.path}: {k_name} {list(k_b.shape)} / {v_name} {list(v_b.shape)} do "
                                      f"not match the config ([{NA}, {KL}, {DN}] / [{NA}, {DV}, {KL}])")
            return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(NA * (DN + DV), KL)

        self._entries[ours] = _Entry((NA * (DN + DV), KL), "F32", load)


def _a_log(ssm_a: np.ndarray, width: int) -> np.ndarray:
    """A_log [D] from ssm_a = -exp(A_log[:NH]): the NH used values, then zeros (never read, K3_SPEC section 3)."""
    used = np.log(-ssm_a.reshape(-1)).astype(np.float32)
    out = np.zeros(width, np.float32)
    out[:used.size] = used
    return out

