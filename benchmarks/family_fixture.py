"""Fixtures for the benchmarks that run any model family: `--model DIR`, `--family NAME`, and the sizes the peers
benchmark (bench_peers.py) compares at.

`--family NAME` (kimi_linear, deepseek_v3, qwen3_moe, qwen3_next) writes a random tiny checkpoint of that family
(`k3serve.model.families.synthetic`, no torch needed) once into $K3BENCH_DIR/families/NAME (default
/tmp/k3bench-families/NAME) and benchmarks that. The tiny models have hidden size 64 and random weights: their
figures show that a path runs and how its parts compare, not the speed of a released model of the family; pass
`--model DIR` for a real checkpoint.

Sizes (`fixture_config(family, size)`, written by `fixture_dir`; random bf16 weights, released config spellings, so
llama.cpp's own converter takes them as it takes the released models):
- "real": the released model of RELEASED: its hidden size, expert width, top-k, attention and recurrent shapes,
  vocabulary, layer layout and router, with its first `layers_kept` layers (4) and, where the released count does
  not fit this machine (24 GB RAM, files under ~6 GB), `experts_kept` routed experts (the cut says so). A decoded
  token reads the same bytes as in the released model (top-k experts of the same width, the same trunk and
  lm_head); prefill and batch 8 touch a larger share of fewer experts.
- "tiny": hidden 512, 8 layers, 64 experts top-8 of width 256, vocabulary 4096, the released layer layout
  (bench_families_peers.py's proportions).
- "smoke": hidden 128, 4 layers, 8 experts top-2 of width 64, vocabulary 512: seconds to build, for tests.
Real-width files go under $K3BENCH_REALWIDTH_DIR (default /tmp/realwidth), the others under $K3BENCH_DIR.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

from k3serve.model.families.synthetic import SYNTHETIC_FAMILIES, write_random_family

_ROOT = Path(os.environ.get("K3BENCH_DIR", "/tmp/k3bench-families")) / "families"
REAL_ROOT = Path(os.environ.get("K3BENCH_REALWIDTH_DIR", "/tmp/realwidth"))
FAMILIES = ("qwen3_moe", "kimi_linear", "deepseek_v3", "qwen3_next")
SIZES = ("smoke", "tiny", "real")


class ReleasedModel(NamedTuple):
    name: str  # the Hugging Face repository whose config.json this copies
    source: str  # where the values were read
    config: dict  # the released config.json's architecture keys (values as released)
    layers_kept: int
    experts_kept: int | None  # None: the released count
    cut: str  # what differs from the released model, and why


# Released config.json values (public facts; only the keys that shape the model). The DeepSeek-V3 family is copied
# from Moonlight-16B-A3B, a released DeepseekV3ForCausalLM: DeepSeek-V3 / Kimi K2 themselves hold 22-34 GB of
# experts in a single bf16 layer, which no 4-layer file on this machine can.
RELEASED: dict[str, ReleasedModel] = {
    "qwen3_moe": ReleasedModel(
        "Qwen/Qwen3-30B-A3B", "huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json",
        {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
         "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
         "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
         "max_position_embeddings": 40960, "attention_bias": False, "hidden_act": "silu",
         "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
         "bos_token_id": 151643, "eos_token_id": 151645},
        4, None, "4 of 48 layers (6.2 GB in bf16)"),
    "kimi_linear": ReleasedModel(
        "moonshotai/Kimi-Linear-48B-A3B-Instruct",
        "huggingface.co/moonshotai/Kimi-Linear-48B-A3B-Instruct/blob/main/config.json",
        {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "hidden_size": 2304,
         "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
         "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72, "q_lora_rank": None,
         "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
         "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
         "num_expert_group": 1, "topk_group": 1, "routed_scaling_factor": 2.446, "moe_renormalize": True,
         "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1, "first_k_dense_replace": 1,
         "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                                "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23,
                                               25, 26],
                                "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
         "vocab_size": 163840, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
         "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839, "model_max_length": 1048576},
        4, 64, "4 of 27 layers (KDA, KDA, KDA, MLA; layer 0 dense as released), 64 of 256 experts per layer "
               "(4.6 GB; all 256 would be 12.8 GB)"),
    "deepseek_v3": ReleasedModel(
        "moonshotai/Moonlight-16B-A3B", "huggingface.co/moonshotai/Moonlight-16B-A3B/blob/main/config.json",
        {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 2048,
         "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
         "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
         "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
         "num_experts_per_tok": 6, "n_shared_experts": 2, "n_group": 1, "topk_group": 1,
         "routed_scaling_factor": 2.446, "norm_topk_prob": True, "scoring_func": "sigmoid",
         "topk_method": "noaux_tc", "first_k_dense_replace": 1, "moe_layer_freq": 1, "vocab_size": 163840,
         "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "rope_scaling": None, "max_position_embeddings": 8192,
         "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False,
         "bos_token_id": 163584, "eos_token_id": 163585},
        4, None, "4 of 27 layers (layer 0 dense as released; 4.9 GB)"),
    "qwen3_next": ReleasedModel(
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
        "huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json",
        {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
         "intermediate_size": 5120, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
         "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
         "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
         "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
         "partial_rotary_factor": 0.25, "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "rms_norm_eps": 1e-6,
         "rope_theta": 10000000.0, "rope_scaling": None, "max_position_embeddings": 262144,
         "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False,
         "bos_token_id": 151643, "eos_token_id": 151645},
        4, 128, "4 of 48 layers (DeltaNet x3, gated attention), 128 of 512 experts per layer (4.7 GB; all 512 "
                "would be 14.4 GB)"),
}


def _kept_layers(family: str, raw: dict, layers: int, experts: int | None) -> dict:
    """`raw` cut to its first `layers` layers and `experts` routed experts per layer (None: as is)."""
    out = {**raw, "num_hidden_layers": layers}
    if family == "kimi_linear":
        linear = dict(raw["linear_attn_config"])
        for key in ("full_attn_layers", "kda_layers"):
            linear[key] = [i for i in linear[key] if i <= layers]
        out["linear_attn_config"] = linear
    if experts is not None:
        out["n_routed_experts" if family == "deepseek_v3" else "num_experts"] = experts
    return out


def _scaled(family: str, hidden: int, layers: int, experts: int, top_k: int, width: int, vocab: int,
            head: int) -> dict:
    """The released config at another width: every shape from these numbers, the layout and router as released."""
    raw = _kept_layers(family, RELEASED[family].config, layers, experts)
    heads = hidden // head
    common = {"hidden_size": hidden, "moe_intermediate_size": width, "intermediate_size": 4 * width,
              "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2}
    if family == "qwen3_moe":
        return {**raw, **common, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
                "head_dim": head, "num_experts_per_tok": top_k}
    if family == "qwen3_next":
        return {**raw, **common, "num_attention_heads": heads // 2, "num_key_value_heads": max(1, heads // 4),
                "head_dim": 2 * head, "linear_num_key_heads": heads // 2, "linear_num_value_heads": heads,
                "linear_key_head_dim": head, "linear_value_head_dim": head, "num_experts_per_tok": top_k,
                "shared_expert_intermediate_size": width}
    mla = {"num_attention_heads": heads, "num_key_value_heads": heads, "kv_lora_rank": 2 * head,
           "qk_nope_head_dim": head, "qk_rope_head_dim": head // 2, "v_head_dim": head}
    if family == "kimi_linear":
        linear = {**raw["linear_attn_config"], "num_heads": heads, "head_dim": head}
        return {**raw, **common, **mla, "head_dim": head, "num_experts_per_token": top_k,
                "linear_attn_config": linear, "pad_token_id": 0}
    return {**raw, **common, **mla, "num_experts_per_tok": top_k}


def fixture_config(family: str, size: str) -> dict:
    """config.json of `family`'s fixture at `size` (SIZES)."""
    if family not in RELEASED:
        raise ValueError(f"no fixture for family {family!r} (choose from {', '.join(FAMILIES)})")
    if size == "real":
        model = RELEASED[family]
        return _kept_layers(family, model.config, model.layers_kept, model.experts_kept)
    if size == "tiny":
        return _scaled(family, hidden=512, layers=8, experts=64, top_k=8, width=256, vocab=4096, head=64)
    if size == "smoke":
        return _scaled(family, hidden=128, layers=4, experts=8, top_k=2, width=64, vocab=512, head=32)
    raise ValueError(f"no fixture size {size!r} (choose from {', '.join(SIZES)})")


def fixture_bytes(family: str, size: str) -> int:
    """The bf16 checkpoint's size in bytes, from the tensor list alone (nothing written)."""
    from k3serve.model.families.synthetic import family_tensor_shapes

    return 2 * sum(math.prod(shape) for shape in family_tensor_shapes(fixture_config(family, size)).values())


def fixture_dir(family: str, size: str) -> Path:
    """The fixture's checkpoint folder, written once (random bf16, `write_random_checkpoint_streaming`)."""
    from k3serve.model.families.synthetic import write_random_checkpoint_streaming

    root = REAL_ROOT if size == "real" else _ROOT.parent / "peers"
    folder = root / f"{family}-{size}" / "checkpoint"
    if not (folder / "model.safetensors").exists():
        print(f"writing the {size} {family} fixture into {folder} (once)...", file=sys.stderr, flush=True)

        def progress(done: int, total: int) -> None:
            print(f"\r  {done / 2**30:.2f} / {total / 2**30:.2f} GiB", end="", file=sys.stderr, flush=True)

        write_random_checkpoint_streaming(fixture_config(family, size), folder, progress=progress)
        print(file=sys.stderr)
    return folder


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--model", default=None, help="checkpoint folder, K3 or a family (default: the embedded model)")
    group.add_argument("--family", choices=SYNTHETIC_FAMILIES, default=None,
                       help="a random tiny checkpoint of this family (k3serve.model.families.synthetic)")


def family_model_dir(family: str) -> Path:
    folder = _ROOT / family
    if not (folder / "config.json").exists():
        write_random_family(family, folder)
    return folder


def model_path(args: argparse.Namespace) -> tuple[str | None, str]:
    """(what load_model takes, the label the record carries)."""
    if getattr(args, "family", None):
        return str(family_model_dir(args.family)), f"random tiny {args.family} (k3serve.model.families.synthetic)"
    return args.model, args.model or "embedded default"


if __name__ == "__main__":  # python benchmarks/family_fixture.py [--build SIZE]: the table (and the files)
    parser = argparse.ArgumentParser(description="the peers fixtures: sizes, released models, files")
    parser.add_argument("--build", choices=SIZES, default=None, help="write this size's fixtures (once)")
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    for family in args.families.split(","):
        sizes = {size: fixture_bytes(family, size) / 1e9 for size in SIZES}
        print(f"{family}: copies {RELEASED[family].name} ({RELEASED[family].source}); real: "
              f"{RELEASED[family].cut}; bf16 GB " + ", ".join(f"{k} {v:.3f}" for k, v in sizes.items()))
        if args.build:
            print(f"  {fixture_dir(family, args.build)}")
    print(json.dumps({family: fixture_config(family, "real") for family in args.families.split(",")}))
