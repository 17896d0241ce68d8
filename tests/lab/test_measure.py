"""Decode-phase figures of a streaming model: prefill reads apart, decode reads per step, same tokens as resident."""

from __future__ import annotations

from k3serve.loading import load_model
from k3serve.lab.measure import measure_decode
from k3serve.stream.options import StreamOptions


def test_decode_figures_count_steps_and_reads(tiny_store, tiny_model):
    loaded = load_model(tiny_store.path, stream=StreamOptions(cache="none"))
    prompts = [[1, 5, 9, 200, 17], [1, 7, 7, 30]]
    calls = []
    result = measure_decode(loaded.model, prompts, 6, between=lambda: calls.append(1))
    loaded.model.source.close()
    assert calls == [1, 1] and result.decode_steps == 2 * 5
    assert result.outputs == [tiny_model.greedy(p, 6) for p in prompts]
    assert result.prefill.bytes_read > 0 and result.decode.bytes_read > 0
    assert result.decode.expert_retained == 0  # no cache: nothing is resident before a step
    assert result.bytes_per_token == result.decode.bytes_read / 10 and result.reads_per_token > 0
