"""7. Co-activation map and clustered layout: which experts fire together, and reads per token when they sit
side by side on disk."""

from __future__ import annotations

import numpy as np

from k3serve.lab.registry import Figure, LabModule, LabParamError, LabResult, Param
from k3serve.lab.streaming import WIDENINGS, streamed_run, warm_up
from k3serve.lab.timing import WARM_UP_MESSAGE
from k3serve.lab.verdict import judge
from k3serve.stream.budget import minimum_budget_bytes
from k3serve.stream.options import StreamOptions
from k3serve.weights.layout import adjacency_score, coactivation_matrix, coactivation_order
from k3serve.weights.store import PackedStore


def limits(lab) -> dict[str, tuple[int, int]]:
    layers = lab.config.moe_layer_ids
    return {"layer": (min(layers), max(layers))}


def run(params, progress, cancel, lab) -> LabResult:
    config = lab.config
    layer = params["layer"]
    if layer not in config.moe_layer_ids:  # NOTE: validate() with the lab refuses these already (`limits`)
        raise LabParamError("layer", f"layer {layer} has no experts; the MoE layers are "
                                     f"{', '.join(map(str, config.moe_layer_ids))}")
    progress(0.05, "co-activation of the recorded trace")
    sets = lab.trace().token_sets()
    matrix = coactivation_matrix(sets[layer], config.num_experts)  # [NE, NE]
    order = coactivation_order(matrix)
    natural_score = adjacency_score(range(config.num_experts), matrix)
    chain_score = adjacency_score(order, matrix)
    shown = matrix.astype(float)
    np.fill_diagonal(shown, 0.0)  # the diagonal (popularity) would drown the pairs
    cancel.check()
    progress(0.2, "packing both layouts (first use only)")
    widen = WIDENINGS[params["experts"]]
    stores = {"natural": lab.packed("natural", *widen), "co-activation": lab.packed("coactivation", *widen)}
    store = PackedStore(stores["natural"])
    budget = minimum_budget_bytes(store) + int(params["expert_fraction"] * store.expert_store_bytes)
    prompts = lab.windows(params["prompts"], 24, skip=40)  # not the trace's windows
    progress(0.25, WARM_UP_MESSAGE)
    warm_up(stores["natural"], StreamOptions(ram_budget=budget, cache=params["cache"], io="pread"), prompts, cancel)
    runs = {}
    for i, (name, path) in enumerate(stores.items()):
        progress(0.3 + 0.3 * i, f"decoding from the {name} layout")
        options = StreamOptions(ram_budget=budget, cache=params["cache"], io="pread")
        runs[name] = streamed_run(path, options, prompts, params["tokens"], cancel)

    def summary(r, score) -> dict[str, float]:
        m = r.measurement
        steps = max(m.decode_steps, 1)
        return {"expert_reads_per_token": (m.decode.num_reads - 0) / steps, "ms_per_token": 1e3 * m.seconds_per_token,
                "bytes_per_token": m.bytes_per_token, "adjacent_pairs": float(score)}

    co, nat = summary(runs["co-activation"], chain_score), summary(runs["natural"], natural_score)
    ticks = [str(e) for e in range(config.num_experts)]
    figures = [
        Figure(f"Co-activation, layer {layer}, experts in natural order", "heatmap", False,
               f"counts from the routing trace of {lab.model_name} recorded on this machine",
               [{"name": "tokens choosing both", "z": shown.tolist(), "x": ticks, "y": ticks}],
               x_label="expert (expert id)", y_label="expert (expert id)"),
        Figure(f"The same layer in co-activation chain order", "heatmap", False,
               "the greedy chain of k3serve.weights.layout: mass moves next to the diagonal",
               [{"name": "tokens choosing both", "z": shown[np.ix_(order, order)].tolist(),
                 "x": [str(e) for e in order], "y": [str(e) for e in order]}], x_label="expert (expert id)",
               y_label="expert (expert id)"),
        Figure("Read calls per decoded token", "bar", True,
               f"{len(prompts)} held-out prompts (not in the trace) x {params['tokens']} tokens, cache "
               f"{params['cache']}, reads coalesced when adjacent",
               [{"name": "reads/token", "x": list(runs), "y": [nat["expert_reads_per_token"],
                                                                co["expert_reads_per_token"]]}],
               y_label="read calls per token (reads/token)"),
    ]
    labels = {"expert_reads_per_token": "read calls per token (trunk + experts)", "ms_per_token": "ms per token",
              "bytes_per_token": "bytes read per token", "adjacent_pairs": f"co-activations of neighbours (layer {layer})"}
    progress(1.0, "done")
    adjacency = chain_score / max(natural_score, 1)
    verdict = judge("The co-activation layout", "the natural layout", "expert_reads_per_token",
                    "read calls per token", co["expert_reads_per_token"], nat["expert_reads_per_token"],
                    higher_is_better=False, words=("fewer", "more"),
                    flips_when=f"the gain rests on neighbours that fire together: in layer {layer} chain neighbours "
                               f"share {chain_score} co-activations against {natural_score} in id order "
                               f"({adjacency:.1f}x) on the trace; on text where they co-fire no more than in id order "
                               "(1x) it reads as many calls as the natural layout, and the bytes are the same either "
                               "way")
    return LabResult(co, nat, figures, labels, metrics_name="co-activation layout", baseline_name="natural layout",
                     verdict=verdict,
                     notes=[f"layer {layer}: neighbours in the chain order share {chain_score} token co-activations, "
                            f"in id order {natural_score}"],
                     related_commands=["k3serve routing-stats --trace-out routing.trace",
                                       "k3serve coactivation routing.trace --out coact/",
                                       "k3serve pack CHECKPOINT packed-coact --layout coactivation --trace routing.trace"])


MODULE = LabModule(
    id="coactivation", number=7, title="Co-activation map and clustered layout",
    summary="Which experts fire together, and how many read calls a token costs when they sit side by side on disk.",
    explanation=(
        "C[i, j] counts the tokens that chose both experts i and j. Ordering a layer's experts on disk so that "
        "frequent pairs are neighbours (a greedy chain: start from the most popular, always append the unplaced "
        "expert with the highest C[last, j]) lets one coalesced read fetch several experts a token needs: reads per "
        "token fall while bytes stay the same. The layout is built from one trace and measured on other text."),
    params=(Param("layer", "int", 1, "which layer's map (a MoE layer, zero-based; the range is the model's)", min=0,
                  max=200),
            Param("expert_fraction", "float", 0.0, "budget = minimum + this share of the expert store", min=0.0,
                  max=1.0),
            Param("cache", "choice", "none", "expert cache policy (none: every token reads its experts)",
                  choices=("none", "lru", "lfu")),
            Param("experts", "choice", "1x", "experts widened (exactly)", choices=tuple(WIDENINGS)),
            Param("tokens", "int", 12, "generated per prompt", min=2, max=128, unit="tokens"),
            Param("prompts", "int", 2, "held-out prompts", min=1, max=8)),
    kind="both", run=run, limits=limits)
