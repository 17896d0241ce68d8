"""3. Recurrent state vs attention cache: bytes per sequence as the context grows."""

from __future__ import annotations

import numpy as np

from k3serve.config import K3Config, full_k3_config
from k3serve.lab.registry import Figure, LabModule, LabResult, Param, Verdict
from k3serve.lab.verdict import judge

PRECISION_BYTES = {"bf16": 2, "fp32": 4}


def per_sequence_bytes(config: K3Config, context: int, width: int) -> dict[str, float]:
    """KDA: per layer S [NH, D, D] and the conv tail [K-1, 3P], constant in the context. MLA: per layer and position
    the latent plus k_rope, KL + DR values. The baselines: every layer MLA, and every layer plain multi-head
    attention caching K and V, NA x (DN + DR + DV) values per position."""
    NH, D, K, P = config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size, config.kda_proj_size
    kda_layers, mla_layers = len(config.kda_layer_ids), len(config.mla_layer_ids)
    kda = kda_layers * (NH * D * D + max(K - 1, 0) * 3 * P) * width
    mla = mla_layers * config.mla_cache_width * context * width
    all_mla = config.num_layers * config.mla_cache_width * context * width
    mha = config.num_layers * config.num_mla_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim
                                                      + config.v_head_dim) * context * width
    return {"kda_state_bytes": float(kda), "mla_latent_bytes": float(mla), "hybrid_bytes": float(kda + mla),
            "all_mla_bytes": float(all_mla), "all_mha_bytes": float(mha)}


def measured_cache_bytes(lab, context: int) -> dict[str, float]:
    """The embedded model's own DenseSequenceCache after a prefill of `context` tokens: its arrays' bytes."""
    loaded = lab.loaded()
    model = loaded.model
    window = lab.windows(1, context)[0]
    cache = model.new_cache()
    from k3serve.model.interface import ForwardItem

    model.forward([ForwardItem(np.asarray(window, np.int64), cache)])
    kda = sum(sum(a.nbytes for a in cache.recurrent_state(l)) for l in cache.layout.recurrent_layers)
    mla = sum(cache.attention_rows(l).nbytes for l in cache.layout.attention_layers)
    return {"kda_state_bytes": float(kda), "mla_latent_bytes": float(mla), "tokens": float(len(window))}


def break_even_context(config: K3Config, width: int) -> float | None:
    """The context below which the hybrid holds more bytes than every layer plain MHA: both are linear in the
    context, hybrid = KDA + h T and MHA = m T, so T* = KDA / (m - h); None when MHA never grows faster."""
    at0, at1 = per_sequence_bytes(config, 0, width), per_sequence_bytes(config, 1, width)
    hybrid_slope = at1["hybrid_bytes"] - at0["hybrid_bytes"]
    mha_slope = at1["all_mha_bytes"] - at0["all_mha_bytes"]
    if mha_slope <= hybrid_slope:
        return None
    return at0["hybrid_bytes"] / (mha_slope - hybrid_slope)


def verdict(config: K3Config, width: int, at: dict[str, float], context: int) -> Verdict:
    flip = break_even_context(config, width)
    if flip is None:
        flips_when = "plain MHA never grows faster than the hybrid with these shapes"
    else:
        flips_when = (f"it would lose below {flip:,.0f} tokens of context, where the constant KDA state "
                      f"({at['kda_state_bytes'] / 1e6:,.1f} MB) outweighs plain MHA's K and V")
    return judge(f"The K3 hybrid at {context:,} tokens", "every layer plain MHA", "hybrid_bytes",
                 "bytes per sequence", at["hybrid_bytes"], at["all_mha_bytes"], higher_is_better=False,
                 words=("fewer", "more"), flips_when=flips_when)


def run(params, progress, cancel, lab) -> LabResult:
    config = full_k3_config() if params["model"] == "full_k3" else lab.config
    width = PRECISION_BYTES[params["precision"]]
    context = params["context"]
    contexts = sorted(set(int(c) for c in np.unique(np.geomspace(16, context, 24).astype(int))) | {context})
    progress(0.2, "computing per-sequence memory")
    rows = [per_sequence_bytes(config, c, width) for c in contexts]
    at = per_sequence_bytes(config, context, width)
    crossover = next((c for c, r in zip(contexts, rows) if r["mla_latent_bytes"] >= r["kda_state_bytes"]), None)
    name = "full K3" if params["model"] == "full_k3" else lab.model_name
    figures = [Figure(f"Memory per sequence vs context ({name}, {params['precision']})", "line", False,
                      f"computed from the {name} shapes",
                      [{"name": "K3 hybrid: KDA state + MLA latent", "x": contexts,
                        "y": [r["hybrid_bytes"] / 2**20 for r in rows]},
                       {"name": "KDA state alone (constant)", "x": contexts,
                        "y": [r["kda_state_bytes"] / 2**20 for r in rows]},
                       {"name": "if every layer were MLA", "x": contexts,
                        "y": [r["all_mla_bytes"] / 2**20 for r in rows]},
                       {"name": "if every layer were plain MHA (K and V)", "x": contexts,
                        "y": [r["all_mha_bytes"] / 2**20 for r in rows]}],
                      x_label="context (tokens)", y_label="memory per sequence (MiB)", log_y=True)]
    cancel.check()
    notes = []
    if params["measure_tokens"] > 0:
        progress(0.5, "prefilling the embedded model to measure its cache")
        measured = measured_cache_bytes(lab, params["measure_tokens"])
        predicted = per_sequence_bytes(lab.config, int(measured["tokens"]), 4)
        figures.append(Figure(f"{lab.model_name}: its cache after {int(measured['tokens'])} tokens vs the formula",
                              "bar", True, "DenseSequenceCache arrays (float32) after a prefill on this machine",
                              [{"name": "measured", "x": ["KDA state", "MLA latent"],
                                "y": [measured["kda_state_bytes"] / 1024, measured["mla_latent_bytes"] / 1024]},
                               {"name": "formula", "x": ["KDA state", "MLA latent"],
                                "y": [predicted["kda_state_bytes"] / 1024, predicted["mla_latent_bytes"] / 1024]}],
                              y_label="bytes (KiB)"))
        notes.append(f"measured on {lab.model_name}: KDA {measured['kda_state_bytes'] / 1024:.1f} KiB, MLA "
                     f"{measured['mla_latent_bytes'] / 1024:.1f} KiB after {int(measured['tokens'])} tokens")
    notes.append(f"the MLA latent overtakes the constant KDA state at about {crossover} tokens" if crossover
                 else "the KDA state stays larger than the MLA latent over this whole range")
    progress(1.0, "done")
    labels = {"hybrid_bytes": "K3 hybrid bytes per sequence", "kda_state_bytes": "KDA state bytes (constant)",
              "mla_latent_bytes": "MLA latent bytes", "all_mla_bytes": "all-MLA bytes", "all_mha_bytes":
              "all-MHA bytes"}
    metrics = {k: at[k] for k in ("hybrid_bytes", "kda_state_bytes", "mla_latent_bytes")}
    baseline = {"hybrid_bytes": at["all_mha_bytes"], "kda_state_bytes": 0.0, "mla_latent_bytes": at["all_mha_bytes"]}
    return LabResult(metrics, baseline, figures, labels, metrics_name=f"K3 hybrid at {context} tokens",
                     baseline_name="every layer plain MHA (K and V cached)", notes=notes,
                     related_commands=["k3serve info --full-k3"], verdict=verdict(config, width, at, context))


MODULE = LabModule(
    id="recurrent_state", number=3, title="Recurrent state vs attention cache",
    summary="KDA state and MLA latent memory per sequence as the context grows, against plain attention.",
    explanation=(
        "K3 mixes two kinds of layers. A KDA (linear attention) layer keeps a fixed state S of NH x D x D values per "
        "sequence, updated by the delta rule S <- diag(exp(g)) S + k (beta (v - S^T k))^T, whatever the context "
        "length. A gated MLA layer caches KL + DR values per position (the compressed latent plus the rotary key), "
        "far fewer than plain attention's NA x (DN + DR + DV). So memory per sequence = L_kda x (NH D^2 + (K-1) 3P) "
        "+ L_mla x (KL + DR) x T: flat for short contexts, then growing with only the few MLA layers."),
    params=(Param("model", "choice", "full_k3", "which shapes", choices=("full_k3", "embedded")),
            Param("context", "int", 131072, "longest context on the chart", min=16, max=1048576, unit="tokens"),
            Param("precision", "choice", "bf16", "bytes per cached value", choices=tuple(PRECISION_BYTES)),
            Param("measure_tokens", "int", 64, "also prefill the embedded model with this many tokens and read "
                  "its cache (0 = skip)", min=0, max=1024, unit="tokens")),
    kind="both", run=run)
