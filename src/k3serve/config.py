"""The K3 model configuration, read from a checkpoint's config.json (K3_SPEC section 2).

The released file nests the text model: a key is looked up in `text_config`, then in
`text_config.linear_attn_config`, then at the root. Small test checkpoints use a flat variant with the KDA and
SiTU keys at the top level under other names. Both are accepted, nothing else. A missing key is an error that
names the key; the reader never falls back to a default.

Shape letters used across the model package (K3_SPEC section 1):
    H hidden, L layers, V vocab, NH/D KDA heads/head dim, P = NH*D, K conv kernel, NA MLA heads,
    QL/KL q/kv lora ranks, DN/DR/DV nope/rope/v head dims, NE/TOPK experts/active, SI shared width,
    LT routed latent, MI routed intermediate, DI dense intermediate, B attention-residual block size.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from k3serve.errors import ConfigError

MXFP4_GROUP_SIZE = 32
# prompt + generated tokens of one sequence when the caller names no other limit (engine, generate, logits, serve)
DEFAULT_MAX_MODEL_LEN = 4096

# (field name, key in the nested release form, key in the flat test form)
_KEYS: tuple[tuple[str, str, str], ...] = (
    ("hidden_size", "hidden_size", "hidden_size"),
    ("num_layers", "num_hidden_layers", "num_hidden_layers"),
    ("vocab_size", "vocab_size", "vocab_size"),
    ("rms_norm_eps", "rms_norm_eps", "rms_norm_eps"),
    ("num_mla_heads", "num_attention_heads", "num_attention_heads"),
    ("q_lora_rank", "q_lora_rank", "q_lora_rank"),
    ("kv_lora_rank", "kv_lora_rank", "kv_lora_rank"),
    ("qk_nope_head_dim", "qk_nope_head_dim", "qk_nope_head_dim"),
    ("qk_rope_head_dim", "qk_rope_head_dim", "qk_rope_head_dim"),
    ("v_head_dim", "v_head_dim", "v_head_dim"),
    ("mla_use_output_gate", "mla_use_output_gate", "mla_use_output_gate"),
    ("num_experts", "num_experts", "num_experts"),
    ("num_experts_per_token", "num_experts_per_token", "num_experts_per_token"),
    ("num_shared_experts", "num_shared_experts", "num_shared_experts"),
    ("latent_size", "routed_expert_hidden_size", "routed_expert_hidden_size"),
    ("moe_intermediate_size", "moe_intermediate_size", "moe_intermediate_size"),
    ("routed_scaling_factor", "routed_scaling_factor", "routed_scaling_factor"),
    ("moe_renormalize", "moe_renormalize", "moe_renormalize"),
    ("latent_moe_use_norm", "latent_moe_use_norm", "latent_moe_use_norm"),
    ("router_activation", "moe_router_activation_func", "moe_router_activation_func"),
    ("num_expert_group", "num_expert_group", "num_expert_group"),
    ("topk_group", "topk_group", "topk_group"),
    ("first_k_dense_replace", "first_k_dense_replace", "first_k_dense_replace"),
    ("intermediate_size", "intermediate_size", "intermediate_size"),
    ("attn_res_block_size", "attn_res_block_size", "attn_res_block_size"),
    ("situ_beta", "activation_situ_beta", "situ_beta"),
    ("situ_linear_beta", "activation_situ_linear_beta", "situ_linear_beta"),
    ("kda_num_heads", "num_heads", "kda_num_heads"),
    ("kda_head_dim", "head_dim", "kda_head_dim"),
    ("short_conv_kernel_size", "short_conv_kernel_size", "short_conv_kernel_size"),
    ("gate_lower_bound", "gate_lower_bound", "gate_lower_bound"),
    ("full_attn_layers", "full_attn_layers", "full_attn_layers"),
    ("kda_layers", "kda_layers", "kda_layers"),
)

_INT_FIELDS = {
    "hidden_size", "num_layers", "vocab_size", "num_mla_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
    "num_shared_experts", "latent_size", "moe_intermediate_size", "num_expert_group", "topk_group",
    "first_k_dense_replace", "intermediate_size", "attn_res_block_size", "kda_num_heads", "kda_head_dim",
    "short_conv_kernel_size",
}
_FLOAT_FIELDS = {"rms_norm_eps", "routed_scaling_factor", "situ_beta", "situ_linear_beta", "gate_lower_bound"}
_BOOL_FIELDS = {"mla_use_output_gate", "moe_renormalize", "latent_moe_use_norm"}


@dataclass(frozen=True)
class K3Config:
    hidden_size: int  # H
    num_layers: int  # L
    vocab_size: int  # V
    rms_norm_eps: float
    num_mla_heads: int  # NA
    q_lora_rank: int  # QL
    kv_lora_rank: int  # KL
    qk_nope_head_dim: int  # DN
    qk_rope_head_dim: int  # DR
    v_head_dim: int  # DV
    mla_use_output_gate: bool
    num_experts: int  # NE
    num_experts_per_token: int  # TOPK
    num_shared_experts: int  # NS
    latent_size: int  # LT
    moe_intermediate_size: int  # MI
    routed_scaling_factor: float
    moe_renormalize: bool
    latent_moe_use_norm: bool
    router_activation: str
    num_expert_group: int
    topk_group: int
    first_k_dense_replace: int
    intermediate_size: int  # DI
    attn_res_block_size: int  # B
    situ_beta: float
    situ_linear_beta: float
    kda_num_heads: int  # NH
    kda_head_dim: int  # D
    short_conv_kernel_size: int  # K
    gate_lower_bound: float
    full_attn_layers: tuple[int, ...]  # one-based, as in config.json
    kda_layers: tuple[int, ...]  # one-based, as in config.json
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    model_type: str = "kimi_k3"
    # K3 has no positional encoding: this bounds nothing here, but other engines size their context from it
    max_position_embeddings: int = DEFAULT_MAX_MODEL_LEN

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"config key for '{name}' must be an integer, got {value!r}")
            if value < 0 or (value == 0 and name not in {"first_k_dense_replace", "num_shared_experts"}):
                raise ConfigError(f"config key for '{name}' must be positive, got {value}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"config key for '{name}' must be a finite number, got {value!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config key for '{name}' must be true or false, got {getattr(self, name)!r}")
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.situ_beta <= 0 or self.situ_linear_beta <= 0:
            raise ConfigError("activation_situ_beta and activation_situ_linear_beta must be > 0")
        self._validate_layer_map()
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError(
                f"num_experts_per_token ({self.num_experts_per_token}) exceeds num_experts ({self.num_experts})"
            )
        for name, width in (("routed_expert_hidden_size", self.latent_size),
                            ("moe_intermediate_size", self.moe_intermediate_size)):
            if width % MXFP4_GROUP_SIZE:
                raise ConfigError(
                    f"{name} = {width} is not a multiple of the MXFP4 group size {MXFP4_GROUP_SIZE}: "
                    "expert rows of that width cannot be stored"
                )
        if self.router_activation != "sigmoid":
            raise ConfigError(f"moe_router_activation_func must be 'sigmoid', got {self.router_activation!r}")
        if self.num_expert_group != 1 or self.topk_group != 1:
            raise ConfigError(
                f"grouped routing (num_expert_group={self.num_expert_group}, topk_group={self.topk_group}) "
                "is not part of K3; only 1 and 1 are supported"
            )
        if self.first_k_dense_replace > self.num_layers:
            raise ConfigError(
                f"first_k_dense_replace ({self.first_k_dense_replace}) exceeds num_hidden_layers ({self.num_layers})"
            )
        if isinstance(self.max_position_embeddings, bool) or not isinstance(self.max_position_embeddings, int) \
                or self.max_position_embeddings < 1:
            raise ConfigError(
                f"max_position_embeddings must be a positive integer, got {self.max_position_embeddings!r}")
        for token_id in ([self.bos_token_id] if self.bos_token_id is not None else []) + list(self.eos_token_ids):
            if not 0 <= token_id < self.vocab_size:
                raise ConfigError(f"special token id {token_id} is outside the vocabulary (size {self.vocab_size})")

    def _validate_layer_map(self) -> None:
        for key, layers in (("full_attn_layers", self.full_attn_layers), ("kda_layers", self.kda_layers)):
            for index in layers:
                if isinstance(index, bool) or not isinstance(index, int):
                    raise ConfigError(f"{key} must list integers, got {index!r}")
                if not 1 <= index <= self.num_layers:
                    raise ConfigError(
                        f"{key} entry {index} is out of range: layers are numbered 1..{self.num_layers} (one-based)"
                    )
            if len(set(layers)) != len(layers):
                raise ConfigError(f"{key} lists a layer twice: {sorted(layers)}")
        both = set(self.full_attn_layers) & set(self.kda_layers)
        if both:
            raise ConfigError(f"layers {sorted(both)} are listed in both full_attn_layers and kda_layers")
        missing = set(range(1, self.num_layers + 1)) - set(self.full_attn_layers) - set(self.kda_layers)
        if missing:
            raise ConfigError(f"layers {sorted(missing)} are in neither full_attn_layers nor kda_layers")

    # ---- derived shapes -------------------------------------------------------------------------------------
    @property
    def kda_proj_size(self) -> int:
        """P = NH * D, the width of the KDA q/k/v/g projections."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        """SI = NS * MI, the fused width of the shared experts."""
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def mla_cache_width(self) -> int:
        """Values cached per position and MLA layer: the normed latent plus k_rope (KL + DR)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_mla(self, layer: int) -> bool:
        """Whether zero-based `layer` is a gated MLA layer (else KDA)."""
        return (layer + 1) in self.full_attn_layers

    def is_dense(self, layer: int) -> bool:
        """Whether zero-based `layer` has the dense MLP (else latent MoE)."""
        return layer < self.first_k_dense_replace

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_layers) if self.is_mla(l))

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_layers) if not self.is_mla(l))

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_layers) if not self.is_dense(l))

    @property
    def layer_map(self) -> str:
        """One letter per layer, K for KDA and M for MLA, e.g. 'KKKMKKKMKKKMM'."""
        return "".join("M" if self.is_mla(l) else "K" for l in range(self.num_layers))

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert in MXFP4: w1, w3 [MI, LT] and w2 [LT, MI], packed nibbles plus scales."""
        elements = 3 * self.moe_intermediate_size * self.latent_size
        return elements // 2 + elements // MXFP4_GROUP_SIZE

    def num_parameters(self) -> dict[str, int]:
        """Parameter counts: trunk (everything but routed experts), experts, and active per token."""
        H, V, P, D, NH = self.hidden_size, self.vocab_size, self.kda_proj_size, self.kda_head_dim, self.kda_num_heads
        K = self.short_conv_kernel_size
        kda = 4 * P * H + H * P + 3 * P * K + D * H + P * D + NH * H + D + P + D
        NA, QL, KL = self.num_mla_heads, self.q_lora_rank, self.kv_lora_rank
        DN, DR, DV = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        mla = QL * H + QL + NA * (DN + DR) * QL + (KL + DR) * H + KL + NA * (DN + DV) * KL + NA * DV * H * 2
        norms = 4 * H + 2 * H
        dense = 3 * self.intermediate_size * H
        LT, SI, NE = self.latent_size, self.shared_intermediate_size, self.num_experts
        moe_trunk = NE * H + NE + 2 * LT * H + LT + 3 * SI * H
        expert = 3 * self.moe_intermediate_size * LT
        trunk = 2 * V * H + 3 * H
        for layer in range(self.num_layers):
            trunk += norms + (mla if self.is_mla(layer) else kda) + (dense if self.is_dense(layer) else moe_trunk)
        num_moe = len(self.moe_layer_ids)
        experts = num_moe * NE * expert
        active = trunk + num_moe * self.num_experts_per_token * expert
        return {"trunk": trunk, "experts": experts, "total": trunk + experts, "active": active}

    # ---- reading and writing ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> K3Config:
        if not isinstance(raw, dict):
            raise ConfigError("config.json must hold a JSON object")
        nested = "text_config" in raw
        text = raw.get("text_config", {}) if nested else {}
        linear = text.get("linear_attn_config", {}) if isinstance(text, dict) else {}
        if nested and not isinstance(text, dict):
            raise ConfigError("config.json: 'text_config' must be an object")
        if not isinstance(linear, dict):
            raise ConfigError("config.json: 'linear_attn_config' must be an object")
        layers_node = linear if nested else raw

        def lookup(key: str) -> Any:
            for scope in (text, linear, raw):
                if key in scope:
                    return scope[key]
            where = "text_config, text_config.linear_attn_config or the root" if nested else "the root"
            raise ConfigError(f"config.json is missing required key '{key}' (looked in {where})")

        values: dict[str, Any] = {}
        for name, nested_key, flat_key in _KEYS:
            key = nested_key if nested else flat_key
            if name in ("full_attn_layers", "kda_layers"):
                if key not in layers_node and key not in raw and key not in text:
                    where = "text_config.linear_attn_config" if nested else "the root"
                    raise ConfigError(f"config.json is missing required key '{key}' (looked in {where})")
                value = lookup(key)
                if not isinstance(value, list):
                    raise ConfigError(f"config key '{key}' must be a list of one-based layer indices")
                values[name] = tuple(value)
            else:
                values[name] = lookup(key)
            if name in _FLOAT_FIELDS and isinstance(values[name], int) and not isinstance(values[name], bool):
                values[name] = float(values[name])

        scopes = (text, raw)
        bos = next((s["bos_token_id"] for s in scopes if "bos_token_id" in s), None)
        eos = next((s["eos_token_id"] for s in scopes if "eos_token_id" in s), None)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        extra_stop = next((s["extra_stop_token_ids"] for s in scopes if "extra_stop_token_ids" in s), [])
        eos_ids = tuple(dict.fromkeys(list(eos_ids) + list(extra_stop)))
        model_type = text.get("model_type", raw.get("model_type", "kimi_k3")) if nested else raw.get("model_type", "kimi_k3")
        _check_quantization(raw.get("quantization_config", text.get("quantization_config") if nested else None))
        extra = _check_interop_keys(raw, text if nested else raw, values["num_mla_heads"])
        return cls(**values, bos_token_id=bos, eos_token_ids=eos_ids, model_type=model_type, **extra)

    def to_dict(self, nested: bool = True, interop: bool = True) -> dict[str, Any]:
        """The config.json form: the released nested layout, or the flat test layout. With `interop` (what every
        writer uses) it carries the released keys other engines rely on (INTEROP_KEYS; llama.cpp's converter reads
        them); without, the form packed stores were fingerprinted with."""
        fields = asdict(self)
        body: dict[str, Any] = {}
        linear: dict[str, Any] = {}
        for name, nested_key, flat_key in _KEYS:
            value = list(fields[name]) if name in ("full_attn_layers", "kda_layers") else fields[name]
            if nested and name in ("kda_num_heads", "kda_head_dim", "short_conv_kernel_size", "gate_lower_bound",
                                   "full_attn_layers", "kda_layers"):
                linear[nested_key] = value
            else:
                body[nested_key if nested else flat_key] = value
        if self.bos_token_id is not None:
            body["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            body["eos_token_id"] = self.eos_token_ids[0]
            if len(self.eos_token_ids) > 1:
                body["extra_stop_token_ids"] = list(self.eos_token_ids[1:])
        body["model_type"] = self.model_type
        if interop:
            body.update(hidden_act="situ", mla_use_nope=True, num_key_value_heads=self.num_mla_heads,
                        max_position_embeddings=self.max_position_embeddings)
        quant = {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "group_size": MXFP4_GROUP_SIZE,
            "scale_dtype": "uint8",
            "ignore": ["self_attn", "shared_experts", "mlp", "lm_head"],
        }
        if not nested:
            return {**body, "quantization_config": quant}
        body["linear_attn_config"] = linear
        architecture = RELEASED_ARCHITECTURE if interop else "KimiK3ForCausalLM"
        return {"architectures": [architecture], "model_type": self.model_type, "text_config": body,
                "quantization_config": quant}


RELEASED_ARCHITECTURE = "KimiK3ForConditionalGeneration"
INTEROP_KEYS = ("architectures", "hidden_act", "mla_use_nope", "num_key_value_heads", "max_position_embeddings")


def _check_interop_keys(root: dict[str, Any], text: dict[str, Any], num_heads: int) -> dict[str, Any]:
    """The released keys other engines need (K3_SPEC section 2) are optional here, but when present they must
    describe K3: SiTU, nope-only MLA, one KV head per attention head. Returns the K3Config fields they set."""
    def find(key: str) -> Any:
        return text[key] if key in text else root.get(key)

    architectures = root.get("architectures")
    if architectures is not None and (not isinstance(architectures, list)
                                      or not all(isinstance(a, str) for a in architectures)):
        raise ConfigError(f"config key 'architectures' must be a list of names, got {architectures!r}")
    act = find("hidden_act")
    if act is not None and act != "situ":
        raise ConfigError(f"config key 'hidden_act' is {act!r}; K3's experts and MLPs use 'situ'")
    nope = find("mla_use_nope")
    if nope is not None and nope is not True:
        raise ConfigError(f"config key 'mla_use_nope' is {nope!r}; K3's MLA has no rotary part (true)")
    kv_heads = find("num_key_value_heads")
    if kv_heads is not None and kv_heads != num_heads:
        raise ConfigError(f"config key 'num_key_value_heads' is {kv_heads!r}; K3's MLA has one per attention head "
                          f"({num_heads})")
    context = find("max_position_embeddings")
    return {} if context is None else {"max_position_embeddings": context}


def _check_quantization(quant: Any) -> None:
    if quant is None:
        return
    if not isinstance(quant, dict):
        raise ConfigError("quantization_config must be an object")
    fmt = quant.get("format")
    if fmt is not None and fmt != "mxfp4-pack-quantized":
        raise ConfigError(f"quantization format {fmt!r} is not supported; K3 experts are 'mxfp4-pack-quantized'")
    group = quant.get("group_size")
    if group is not None and group != MXFP4_GROUP_SIZE:
        raise ConfigError(f"MXFP4 group_size must be {MXFP4_GROUP_SIZE}, got {group}")


def load_config(path: str | Path) -> K3Config:
    """Read config.json from a checkpoint folder or a file path."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"no config.json at {file}")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file} is not valid JSON: {exc}") from exc
    return K3Config.from_dict(raw)


def tiny_config() -> K3Config:
    """The tiny oracle of K3_SPEC section 1: 13 layers (KKKM KKKM KKKM M), 8 experts, top 2."""
    return K3Config(
        hidden_size=128, num_layers=13, vocab_size=256, rms_norm_eps=1e-5,
        num_mla_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16,
        mla_use_output_gate=True, num_experts=8, num_experts_per_token=2, num_shared_experts=2,
        latent_size=64, moe_intermediate_size=64, routed_scaling_factor=1.0, moe_renormalize=True,
        latent_moe_use_norm=True, router_activation="sigmoid", num_expert_group=1, topk_group=1,
        first_k_dense_replace=1, intermediate_size=96, attn_res_block_size=3, situ_beta=4.0, situ_linear_beta=25.0,
        kda_num_heads=4, kda_head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
        full_attn_layers=(4, 8, 12, 13), kda_layers=(1, 2, 3, 5, 6, 7, 9, 10, 11),
        bos_token_id=1, eos_token_ids=(2,),
    )


def full_k3_config() -> K3Config:
    """The full Kimi K3 shapes (for sizing and simulation; the weights are not shipped)."""
    full_attn = tuple(range(4, 93, 4)) + (93,)
    return K3Config(
        hidden_size=7168, num_layers=93, vocab_size=163840, rms_norm_eps=1e-5,
        num_mla_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_output_gate=True, num_experts=896, num_experts_per_token=16, num_shared_experts=2,
        latent_size=3584, moe_intermediate_size=3072, routed_scaling_factor=1.0, moe_renormalize=True,
        latent_moe_use_norm=True, router_activation="sigmoid", num_expert_group=1, topk_group=1,
        first_k_dense_replace=1, intermediate_size=33792, attn_res_block_size=12, situ_beta=4.0,
        situ_linear_beta=25.0, kda_num_heads=96, kda_head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0,
        full_attn_layers=full_attn, kda_layers=tuple(l for l in range(1, 94) if l not in full_attn),
        bos_token_id=163584, eos_token_ids=(163586, 163585),
    )
