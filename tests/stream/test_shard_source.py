"""An expert owner's source: one shard's experts under a budget, through the engine's expert cache."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.errors import K3Error
from k3serve.stream.budget import BudgetError
from k3serve.stream.shard_source import ShardExpertSource, ShardOptions
from k3serve.weights.shard import ShardSpec, pack_shard


@pytest.fixture(scope="module")
def shard(tiny_store, tmp_path_factory):
    return pack_shard(tiny_store.path, tmp_path_factory.mktemp("shard"), ShardSpec(1, 2))


def test_experts_are_the_stores_bytes_and_the_budget_sets_the_slots(shard, tiny_store, tiny_model):
    source = ShardExpertSource(shard, ShardOptions(ram_budget=3 * shard.expert_stride))
    assert source.num_slots == 3  # >= top-k (2), < the shard's 48 blobs
    layer = tiny_store.config.moe_layer_ids[0]
    source.begin_step(1)
    got = source.experts(layer, [7, 4, 5, 6])
    assert list(got) == [4, 5, 6, 7]
    for expert in got:  # ascending: each view valid until the next group loads
        want = tiny_model.source.experts(layer, [expert])[expert]
        assert all(np.array_equal(getattr(got[expert], f), getattr(want, f)) for f in vars(want))
    source.begin_step(1)
    source.experts(layer, [7])[7]  # still resident from the step before: retained
    stats = source.stats().stream
    assert (stats.expert_requests, stats.expert_misses, stats.expert_retained) == (5, 4, 1)
    assert stats.expert_bytes_read == 4 * shard.expert_stride
    source.check_integrity()
    source.close()


def test_a_budget_below_top_k_and_a_foreign_expert_are_refused(shard, tiny_store):
    with pytest.raises(BudgetError, match="needs at least 2 \\(top-k\\)"):
        ShardExpertSource(shard, ShardOptions(ram_budget=shard.expert_stride))
    source = ShardExpertSource(shard, ShardOptions())
    with pytest.raises(K3Error, match="does not hold layer 1 experts \\[3\\]"):
        source.experts(1, [3, 4])
    source.close()
