"""Routing statistics: the three figures are computed from the engine's own routing, and agree with the trace."""

from __future__ import annotations

import numpy as np

from k3serve.cli.main import main
from k3serve.model.interface import ForwardItem
from k3serve.model.moe import guess_next_layer
from k3serve.lab.routing_stats import _overlap, _skew, measure_routing
from k3serve.stream.trace import TraceWriter, read_trace, trace_meta


def test_overlap_and_skew_on_hand_made_routing():
    a = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    b = np.array([[3, 2, 9, 8], [7, 6, 5, 4]])
    assert _overlap(a, b) == (2 + 4) / 8
    ids = np.array([[0, 1]] * 9 + [[2, 3]])  # 10 experts: expert 0 and 1 take 18 of 20 requests
    assert _skew(ids, 10) == 9 / 20  # the top 10% of 10 experts is one expert


def test_measure_routing_matches_the_forward_pass_and_its_trace(tiny_model, tmp_path):
    config = tiny_model.config
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (17, 9)]
    writer = TraceWriter(tmp_path / "t.trace", trace_meta(config))
    report = measure_routing(tiny_model, seqs, writer)
    writer.close()
    assert report.num_tokens == 26
    assert [l.layer for l in report.layers] == list(config.moe_layer_ids)

    # the same routing, straight from the model, gives the same reuse and skew
    routed = {}
    for seq in seqs:
        result = tiny_model.forward([ForwardItem(np.array(seq), tiny_model.new_cache())], keep_routing=True)
        for layer, r in result.routing.items():
            routed.setdefault(layer, []).append(r.expert_ids)
    trace = read_trace(tmp_path / "t.trace").token_sets()
    for entry in report.layers:
        ids = routed[entry.layer]
        reuse = _overlap(np.concatenate([x[1:] for x in ids]), np.concatenate([x[:-1] for x in ids]))
        assert entry.reuse_prev == reuse
        assert entry.skew_top10 == _skew(np.concatenate(ids), config.num_experts)
        assert [tuple(r) for r in np.concatenate(ids).tolist()] == trace[entry.layer]
        assert entry.next_layer_recall is not None and 0.0 <= entry.next_layer_recall <= 1.0


def test_a_layers_own_hidden_state_predicts_it_perfectly(tiny_model):
    """Guessing layer l from the very hidden state layer l's MoE reads is exact: the guess uses l's real router."""
    config = tiny_model.config
    layer = config.moe_layer_ids[-1]
    hidden = np.random.default_rng(0).standard_normal((5, config.hidden_size)).astype(np.float32)
    weights = tiny_model.source.layer(layer)
    from k3serve.model.moe import route
    from k3serve.model.ops import rms_norm

    expected = route(config, weights.mlp, rms_norm(hidden, weights.post_attention_norm, config.rms_norm_eps))
    assert np.array_equal(guess_next_layer(config, weights, hidden)[0], expected.expert_ids)


def test_routing_stats_command_on_a_text_file(tmp_path, capsys):
    text = tmp_path / "in.py"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 40)
    assert main(["routing-stats", "--text", str(text), "--tokens", "300", "--window", "100",
                 "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "top-10% share" in out and "300 tokens in 3 windows" in out
    import json
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["num_tokens"] == 300 and len(data["layers"]) > 0
