"""The serving engine over a streaming source: batched requests under a tight RAM budget give exactly the
resident engine's tokens, and the bytes read per generated token fall as the batch grows."""

from __future__ import annotations

import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.loading import load_model
from k3serve.stream.options import StreamOptions


def _run(model, prompts, params):
    engine = LLMEngine(model, EngineConfig(max_seqs=16, num_blocks=256, block_size=16), stop_ids=())
    for prompt in prompts:
        engine.add_request(prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        engine.check_integrity()
    return [outputs[k] for k in sorted(outputs, key=lambda r: int(r.split("-")[-1]))]


def test_engine_on_a_streaming_source_matches_resident_tokens(tiny_dir, tiny_store):
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 256, int(n))] for n in rng.integers(3, 30, 8)]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True)
    resident = load_model(tiny_dir).model
    # 3 MiB: a few expert slots beside the streamed trunk (the tiny oracle's weights are ~4x that)
    streamed = load_model(tiny_store.path, stream=StreamOptions(ram_budget=3 << 20, io="direct", cache="lfu")).model
    for params in (greedy, seeded):
        assert _run(streamed, prompts, params) == _run(resident, prompts, params)
    streamed.source.close()


def test_bytes_read_per_generated_token_fall_with_batch_size(tiny_store):
    per_token = {}
    for batch in (1, 8):
        model = load_model(tiny_store.path, stream=StreamOptions(ram_budget=3 << 20, io="pread", cache="lru")).model
        before = model.source.stats().stream
        prompts = [[5 + i, 9, 13] for i in range(batch)]
        outputs = _run(model, prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        read = model.source.stats().stream.minus(before).bytes_read
        per_token[batch] = read / sum(len(o) for o in outputs)
        model.source.close()
    assert per_token[8] < 0.5 * per_token[1], per_token


def test_cache_resident_draft_over_a_streaming_source_keeps_greedy_tokens(tiny_store):
    from k3serve.engine.generate import generate
    from k3serve.engine.speculative import SpeculativeConfig

    options = StreamOptions(ram_budget=3 << 20, io="pread", cache="lru")
    plain_model = load_model(tiny_store.path, stream=options).model
    prompt = [1, 17, 200, 45, 3, 99, 128, 7]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain, _ = generate(plain_model, prompt, params)
    resident = [plain_model.source.resident_experts(layer) for layer in plain_model.config.moe_layer_ids]
    # a real subset: the budget holds a few slots, so most layers have nothing resident and none has everything
    assert 0 < sum(map(len, resident)) < plain_model.config.num_experts
    assert all(len(r) < plain_model.config.num_experts for r in resident)
    plain_model.source.close()
    model = load_model(tiny_store.path, stream=options).model
    spec, _ = generate(model, prompt, params, speculative=SpeculativeConfig(drafter="resident", adaptive=False))
    assert spec == plain
    model.source.close()


def test_metrics_report_a_streaming_sources_reads_and_cache_and_a_resident_model_none(tiny_dir, tiny_store):
    from k3serve.serve.metrics import render_metrics

    model = load_model(tiny_store.path, stream=StreamOptions(ram_budget=3 << 20, io="pread", cache="lru")).model
    engine = LLMEngine(model, EngineConfig(max_seqs=4, num_blocks=64, block_size=16), stop_ids=())
    engine.add_request([5, 9, 13, 200], SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats, snap = model.source.stats().stream, engine.metrics.snapshot()  # no step between the two
    assert snap["weights_expert_bytes_read"] == stats.expert_bytes_read > 0
    assert snap["weights_trunk_bytes_read"] == stats.trunk_bytes_read
    assert snap["expert_requests"] == stats.expert_requests > snap["expert_retained"] == stats.expert_retained
    assert snap["expert_misses"] == stats.expert_misses > 0
    assert snap["expert_retention"] == stats.expert_retained / stats.expert_requests
    text = render_metrics(engine.metrics)[0].decode()
    samples = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    assert samples["k3serve_weights_expert_bytes_read_total"] == stats.expert_bytes_read
    assert samples["k3serve_expert_retention"] == snap["expert_retention"]
    model.source.close()
    resident = LLMEngine(load_model(tiny_dir).model, EngineConfig(max_seqs=4, num_blocks=64, block_size=16))
    assert "weights_expert_bytes_read" not in resident.metrics.snapshot()


def test_a_batch_decode_step_reads_the_streamed_trunk_once(tiny_store):
    """Issue 34 item 4: with every trunk layer and the lm_head streamed, a decode step of B sequences reads each
    layer and the lm_head once for all of them: the trunk bytes per step, less one embedding row per token, are the
    same at batch 1, 3 and 8 (exact counts), so the trunk bytes per generated token fall as 1 / B."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_batch_trunk.py"
    spec = importlib.util.spec_from_file_location("bench_batch_trunk", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = {b: bench.measure(tiny_store.path, b, steps=2) for b in (1, 3, 8)}
    shared = rows[1]["trunk_bytes_per_step_less_embedding_rows"][0]
    layers = sum(b.size for b in tiny_store.layers)
    assert shared >= layers  # every layer (and the lm_head) is read each step: nothing pinned
    for b, r in rows.items():
        assert r["trunk_bytes_per_step_less_embedding_rows"] == [shared, shared], b
        assert r["trunk_bytes_per_step"] == [shared + b * r["row_bytes"]] * 2, b
    assert rows[8]["trunk_bytes_per_token"] < rows[1]["trunk_bytes_per_token"] / 7
