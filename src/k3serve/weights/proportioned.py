"""A fixture with the full K3's proportions at a small scale: every width of the full K3 times `scale` (so every
matrix's bytes, the embedding's, the lm_head's and an expert's, times about scale^2), three layers (the dense
layer 0, a KDA MoE layer and an MLA MoE layer) and 32 experts, top 16. Its memory floor (stream/budget.py) stands
to its globals and its layers as the full K3's 2 GiB floor stands to the full K3's, so a run in a small memory
cgroup checks the engine's floor (tests/stream/test_memory_floor.py, benchmarks/bench_memory_floor.py)."""

from __future__ import annotations

from k3serve.config import K3Config, full_k3_config


def _scaled(value: int, scale: float, multiple: int) -> int:
    return max(multiple, round(value * scale / multiple) * multiple)


def proportioned_config(hidden_size: int = 1024) -> K3Config:
    """The full K3's widths scaled to `hidden_size` (a multiple of 64), three layers (dense, KDA MoE, MLA MoE)."""
    full = full_k3_config()
    s = hidden_size / full.hidden_size
    head_dim = 32  # MLA's; KDA's is twice it, so its heads stay no more than its head dim (A_log is [D]), as in K3
    return K3Config(
        hidden_size=hidden_size, num_layers=3, vocab_size=_scaled(full.vocab_size, s, 64), rms_norm_eps=1e-5,
        num_mla_heads=_scaled(full.num_mla_heads, s, 1), q_lora_rank=_scaled(full.q_lora_rank, s, 32),
        kv_lora_rank=_scaled(full.kv_lora_rank, s, 32), qk_nope_head_dim=head_dim, qk_rope_head_dim=16,
        v_head_dim=head_dim, mla_use_output_gate=True, num_experts=32, num_experts_per_token=16,
        num_shared_experts=2, latent_size=_scaled(full.latent_size, s, 32),
        moe_intermediate_size=_scaled(full.moe_intermediate_size, s, 32), routed_scaling_factor=1.0,
        moe_renormalize=True, latent_moe_use_norm=True, router_activation="sigmoid", num_expert_group=1,
        topk_group=1, first_k_dense_replace=1, intermediate_size=_scaled(full.intermediate_size, s, 32),
        attn_res_block_size=2, situ_beta=4.0, situ_linear_beta=25.0,
        kda_num_heads=_scaled(full.kda_num_heads * full.kda_head_dim, s, 2 * head_dim) // (2 * head_dim),
        kda_head_dim=2 * head_dim, short_conv_kernel_size=4, gate_lower_bound=-5.0, full_attn_layers=(3,),
        kda_layers=(1, 2), bos_token_id=1, eos_token_ids=(2,),
    )
