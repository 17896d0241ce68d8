"""1. Anatomy: parameters and bytes of the full K3 against the embedded model; resident vs active per token."""

from __future__ import annotations

from k3serve.config import K3Config, full_k3_config
from k3serve.lab.registry import Figure, LabModule, LabResult, Param, Verdict
from k3serve.lab.verdict import judge

TRUNK_BYTES = {"bf16": 2.0, "fp8": 1.0, "fp32": 4.0}


def breakdown(config: K3Config, trunk_bytes_per_value: float, top_k: int) -> dict[str, float]:
    """Bytes by part: embeddings (input table + lm_head), the rest of the trunk, routed experts (MXFP4, 4.25 bits a
    value), and what one token touches: the whole trunk but one embedding row, plus top_k experts per MoE layer."""
    counts = config.num_parameters()
    embeddings = 2 * config.vocab_size * config.hidden_size
    num_moe = len(config.moe_layer_ids)
    expert_store = config.expert_bytes * config.num_experts * num_moe
    trunk_rest = (counts["trunk"] - embeddings) * trunk_bytes_per_value
    active = (counts["trunk"] - (config.vocab_size - 1) * config.hidden_size) * trunk_bytes_per_value \
        + config.expert_bytes * top_k * num_moe
    return {"embeddings_bytes": embeddings * trunk_bytes_per_value, "trunk_bytes": trunk_rest,
            "experts_bytes": float(expert_store),
            "total_bytes": embeddings * trunk_bytes_per_value + trunk_rest + expert_store,
            "active_bytes_per_token": float(active), "total_params": float(counts["total"]),
            "active_params": float(counts["trunk"] + num_moe * top_k * 3 * config.moe_intermediate_size
                                   * config.latent_size),
            "active_fraction": active / (embeddings * trunk_bytes_per_value + trunk_rest + expert_store)}


def measured_file_bytes(model_dir) -> dict[str, float]:
    """Bytes by part as stored in the checkpoint's safetensors files (read from their headers)."""
    from k3serve.weights.checkpoint import Checkpoint

    parts = {"embeddings_bytes": 0.0, "trunk_bytes": 0.0, "experts_bytes": 0.0}
    checkpoint = Checkpoint(model_dir)
    for name in checkpoint.index.names():
        nbytes = checkpoint.index.info(name).nbytes
        if ".experts." in name:
            parts["experts_bytes"] += nbytes
        elif "embed_tokens" in name or name.endswith("lm_head.weight"):
            parts["embeddings_bytes"] += nbytes
        else:
            parts["trunk_bytes"] += nbytes
    checkpoint.close()
    parts["total_bytes"] = sum(parts.values())
    return parts


def verdict(big: dict[str, float], config: K3Config, top_k: int) -> Verdict:
    """Streaming (a token reads only what it touches) against holding every weight; it stops paying once the RAM
    holds the whole model, or once a token touches every expert."""
    return judge("Streaming the experts", "holding every weight resident", "active_bytes_per_token",
                 "bytes per token", big["active_bytes_per_token"], big["total_bytes"], higher_is_better=False,
                 words=("fewer", "more"),
                 flips_when=f"it stops paying once the RAM holds all {big['total_bytes'] / 1e12:.2f} TB (nothing left "
                            f"to stream), or at top-{config.num_experts} (every expert every token; now top-{top_k})")


def run(params, progress, cancel, lab) -> LabResult:
    progress(0.2, "computing the full K3 from its shapes")
    full = full_k3_config()
    top_k = params["top_k"] or full.num_experts_per_token
    big = breakdown(full, TRUNK_BYTES[params["trunk_precision"]], min(top_k, full.num_experts))
    cancel.check()
    progress(0.6, "reading the embedded model's file headers")
    small_config = lab.config
    small = breakdown(small_config, 2.0, small_config.num_experts_per_token)
    files = measured_file_bytes(lab.model_dir)
    parts = ["embeddings_bytes", "trunk_bytes", "experts_bytes"]
    names = ["embeddings", "trunk (attention, norms, router, shared experts)", "routed experts (MXFP4)"]
    figures = [
        Figure("Where the full K3's bytes go", "bar", False, f"computed from full_k3_config() shapes, trunk in "
               f"{params['trunk_precision']}, top-{top_k}",
               [{"name": "resident (all weights)", "x": names, "y": [big[p] / 1e9 for p in parts]}],
               y_label="bytes (GB)"),
        Figure("Resident vs active per token (full K3)", "bar", False, "computed from full_k3_config() shapes",
               [{"name": "bytes", "x": ["resident (whole model)", "active per token"],
                 "y": [big["total_bytes"] / 1e9, big["active_bytes_per_token"] / 1e9]}], y_label="bytes (GB)"),
        Figure(f"Where {lab.model_name}'s bytes go: its files vs the formula", "bar", True,
               f"{lab.model_dir.name}: tensor sizes read from the safetensors headers on this machine",
               [{"name": "in the files", "x": names, "y": [files[p] / 1e6 for p in parts]},
                {"name": "computed from config", "x": names, "y": [small[p] / 1e6 for p in parts]}],
               y_label="bytes (MB)"),
    ]
    labels = {"total_bytes": "resident bytes (all weights)", "active_bytes_per_token": "bytes touched per token",
              "experts_bytes": "routed experts (bytes)", "embeddings_bytes": "embeddings (bytes)",
              "trunk_bytes": "trunk without embeddings (bytes)", "total_params": "parameters",
              "active_params": "active parameters per token", "active_fraction": "active / resident bytes"}
    progress(1.0, "done")
    return LabResult(metrics=big, baseline=small, figures=figures, labels=labels, metrics_name="full K3 (computed)",
                     baseline_name=f"{lab.model_name} (computed; its files: {files['total_bytes'] / 1e6:.2f} MB)",
                     notes=[f"The full K3 holds {big['total_bytes'] / 1e12:.2f} TB: "
                            f"{big['experts_bytes'] / big['total_bytes']:.0%} of it routed experts; one token touches "
                            f"{big['active_bytes_per_token'] / 1e9:.1f} GB ({big['active_fraction']:.1%})."],
                     related_commands=["k3serve info --full-k3", "k3serve info"],
                     verdict=verdict(big, full, min(top_k, full.num_experts)))


MODULE = LabModule(
    id="anatomy", number=1, title="Anatomy: where the bytes go",
    summary="Parameters and bytes of the full Kimi K3 against the embedded model: resident vs active per token.",
    explanation=(
        "A sparse MoE model is big on disk and small per token. Each MoE layer holds NE experts but a token uses "
        "only top-k of them, so bytes touched per token = trunk + L_moe x k x expert_bytes, while resident bytes "
        "= trunk + L_moe x NE x expert_bytes. Routed experts are MXFP4: 4 bits per value plus one 8-bit scale per "
        "32 values, expert_bytes = 3 x MI x LT x (1/2 + 1/32). That gap (resident/active) is why streaming experts "
        "from disk under a RAM budget works at all."),
    params=(Param("trunk_precision", "choice", "bf16", "storage of the non-expert weights",
                  choices=tuple(TRUNK_BYTES)),
            Param("top_k", "int", 0, "experts per token for the full K3 (0 = its own, 16)", min=0, max=896)),
    kind="both", run=run)
