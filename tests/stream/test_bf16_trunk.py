"""A bf16 trunk: the trunk matrices held as their stored bf16 bits, charged as held, the read-ahead dropped when
the budget has no room for it; the same tokens as the resident model."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.engine.generate import generate
from k3serve.engine.sampling import SamplingParams
from k3serve.loading import load_model
from k3serve.model.weights import build_layer
from k3serve.stream.budget import BudgetError, minimum_budget_bytes, plan_budget
from k3serve.stream.options import StreamOptions

IDS = [1, 5, 9, 200, 17, 3, 88, 41]


def test_held_bytes_bound_what_the_built_layers_hold(tiny_store):
    import mmap
    for layer, blob in enumerate(tiny_store.layers):
        with open(tiny_store.trunk_path, "rb") as f:
            raw = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
            arrays = blob.decode(raw[blob.offset:blob.offset + blob.read_size], keep_bf16=True)
            built = build_layer(tiny_store.config, layer, arrays.__getitem__, "bf16")
        held = blob.held_bytes("bf16")
        assert built.nbytes <= held < blob.float32_bytes
        assert built.attention.o_proj.dtype == np.uint16  # kept as bf16 bits
        assert held >= 0.9 * built.nbytes  # the accounting is a bound, not a guess


def test_bf16_minimum_is_lower_and_drops_the_read_ahead(tiny_store):
    f32 = minimum_budget_bytes(tiny_store)
    bf16 = minimum_budget_bytes(tiny_store, trunk_dtype="bf16")
    assert bf16 < f32
    tight = plan_budget(tiny_store, bf16, trunk_dtype="bf16")
    assert not tight.trunk_read_ahead and tight.streamed_layers and tight.total_bytes <= bf16
    roomy = plan_budget(tiny_store, f32 * 2, trunk_dtype="bf16")
    assert roomy.trunk_read_ahead
    with pytest.raises(BudgetError, match="held as bf16"):
        plan_budget(tiny_store, bf16 - 1, trunk_dtype="bf16")


@pytest.mark.parametrize("budget", ["minimum", "unlimited"])
def test_bf16_trunk_streams_the_resident_models_tokens(tiny_store, tiny_model, budget):
    ram = minimum_budget_bytes(tiny_store, trunk_dtype="bf16") if budget == "minimum" else None
    loaded = load_model(tiny_store.path, stream=StreamOptions(ram_budget=ram, trunk_dtype="bf16", cache="lru",
                                                              prefetch="next-layer"))
    try:
        source = loaded.model.source
        assert source.plan.trunk_dtype == "bf16"
        assert source.plan.trunk_read_ahead == (budget == "unlimited")
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        assert generate(loaded.model, IDS[:4], params)[0] == generate(tiny_model, IDS[:4], params)[0]
        got, want = loaded.model.logits(IDS), tiny_model.logits(IDS)
        np.testing.assert_allclose(got, want, atol=2e-3 * float(np.abs(want).max()))
        source.check_integrity()
    finally:
        loaded.model.source.close()
