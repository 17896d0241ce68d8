"""`sim k3 --trunk-dtype q8_0|mxfp4`: the virtual store holds what `pack --trunk-precision` writes, byte for byte,
and the simulator reads what the engine reads from such a store."""

from __future__ import annotations

import pytest

from k3serve.config import full_k3_config
from k3serve.engine.generate import generate
from k3serve.engine.sampling import SamplingParams
from k3serve.loading import load_model
from k3serve.sim.full import SimConfigError, VirtualStore, minimum_ram, replay_config, simulate
from k3serve.sim.presets import laptop
from k3serve.stream.budget import minimum_budget_bytes
from k3serve.stream.options import StreamOptions
from k3serve.stream.trace import read_trace
from k3serve.weights.pack import pack_checkpoint


@pytest.fixture(scope="module", params=["q8_0", "mxfp4"])
def quantized_store(request, tiny_dir, tmp_path_factory):
    return request.param, pack_checkpoint(tiny_dir, tmp_path_factory.mktemp(f"sim-{request.param}"),
                                          trunk_precision=request.param)


def test_virtual_store_holds_the_packed_bytes(quantized_store):
    precision, store = quantized_store
    virtual = VirtualStore(store.config, trunk_dtype=precision)
    for real, made in zip([store.globals, *store.layers], [virtual.globals, *virtual.layers]):
        assert [(t.name, t.dtype, t.shape) for t in real.tensors] == list(made.tensors)
        assert list(real.tensors) == list(made.entries)  # each tensor's place as pack writes it (format 2)
        assert real.size == made.size
        assert real.held_bytes("bf16") == made.held_bytes("bf16")


@pytest.mark.parametrize("extra_slots", [0, 3])  # at the minimum the lm_head streams in row chunks
def test_simulator_reads_what_the_engine_reads_from_a_quantized_trunk(quantized_store, extra_slots, tmp_path):
    precision, store = quantized_store
    budget = minimum_budget_bytes(store, trunk_dtype="bf16") + extra_slots * store.expert_stride
    trace_path = tmp_path / "run.trace"
    loaded = load_model(store.path, stream=StreamOptions(ram_budget=budget, io="pread", queue_depth=4, cache="lru",
                                                         prefetch="none", trace_out=trace_path, trunk_dtype="bf16"))
    source = loaded.model.source
    generate(loaded.model, [1, 5, 9, 200, 17, 3], SamplingParams(max_tokens=9, ignore_eos=True))
    source.close()
    real, plan = source.stats().stream, source.plan
    assert plan.streamed_layers and real.trunk_bytes_read > 0
    assert plan.trunk_views  # both held as views of the staging ring (an MXFP4 entry by rows, store format 3)
    assert extra_slots or not plan.head_pinned
    result = simulate(replay_config(read_trace(trace_path), laptop(), store=VirtualStore.from_store(store, precision),
                                    ram_bytes=budget, policy="lru", prefetch="none", queue_depth=4,
                                    count_prefill=True, trunk_dtype=precision))
    assert result.plan["pinned_layers"] == len(plan.pinned_layers)
    assert result.plan["expert_slots"] == plan.expert_slots
    assert result.totals["trunk_bytes"] == real.trunk_bytes_read
    assert result.totals["expert_bytes"] == real.expert_bytes_read
    assert result.totals["num_reads"] == real.num_reads


def test_full_k3_trunk_bytes_per_precision():
    config = full_k3_config()
    sizes = {d: VirtualStore(config, trunk_dtype=d).trunk_bytes for d in ("bf16", "q8_0", "mxfp4")}
    assert 0.53 < sizes["q8_0"] / sizes["bf16"] < 0.56  # 34 / 64 on the matrices, the rest (norms) as stored
    assert 0.265 < sizes["mxfp4"] / sizes["bf16"] < 0.29  # 17 / 64
    # all three are held as views of their read buffers (the memory floor; an MXFP4 entry by rows, store format 3),
    # so the floor follows the bytes
    assert minimum_ram(config, "mxfp4") < minimum_ram(config, "q8_0") < minimum_ram(config, "bf16")
    with pytest.raises(SimConfigError, match="trunk dtype"):
        VirtualStore(config, trunk_dtype="q4_k")
