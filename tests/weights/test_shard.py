"""Expert-store shards (`k3serve pack --shard i/N`): the owned blocks, byte-exact blobs from a checkpoint or a
packed store, and clear errors for a bad spec, a count that does not divide the experts, or a damaged shard."""

from __future__ import annotations

import json

import numpy as np
import pytest

from k3serve.errors import ConfigError
from k3serve.weights.pack import pack_checkpoint
from k3serve.weights.shard import SHARD_INDEX, ExpertShard, ShardSpec, pack_shard
from k3serve.weights.store import StoreError


@pytest.fixture(scope="module")
def packed(tiny_dir, tmp_path_factory):
    return pack_checkpoint(tiny_dir, tmp_path_factory.mktemp("packed"))


def test_shards_own_contiguous_blocks_with_the_stores_exact_blobs(tiny_dir, packed, tmp_path):
    ne = packed.config.num_experts
    owned = []
    for i in range(4):
        from_checkpoint = pack_shard(tiny_dir, tmp_path / f"c{i}", ShardSpec(i, 4))
        from_store = pack_shard(packed.path, tmp_path / f"s{i}", ShardSpec(i, 4))
        assert from_checkpoint.expert_path.read_bytes() == from_store.expert_path.read_bytes()
        owned += list(from_store.owned)
        blobs = np.fromfile(from_store.expert_path, np.uint8)
        store_blobs = np.fromfile(packed.expert_path, np.uint8)
        for layer in packed.config.moe_layer_ids:
            for expert in from_store.owned:
                mine = from_store.experts[layer].offsets[expert]
                theirs = packed.expert_offset(layer, expert)
                assert from_store.experts[layer].crc32[expert] == packed.experts[layer].crc32[expert]
                assert np.array_equal(blobs[mine:mine + packed.expert_blob_size],
                                      store_blobs[theirs:theirs + packed.expert_blob_size])
        assert from_store.owned == range(i * ne // 4, (i + 1) * ne // 4)
    assert owned == list(range(ne))


@pytest.mark.parametrize("text, message", [("2", "i/N"), ("2/2", "0 <= i < N"), ("a/b", "i/N"), ("0/0", "0 <= i")])
def test_a_bad_shard_spec_is_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        ShardSpec.parse(text)


def test_a_count_that_does_not_divide_the_experts_is_refused_before_writing(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match="3 shards do not divide the model's 8 experts"):
        pack_shard(tiny_dir, tmp_path / "x", ShardSpec(0, 3))
    assert not (tmp_path / "x").exists()


def test_a_damaged_shard_is_refused_at_open(packed, tmp_path):
    shard = pack_shard(packed.path, tmp_path / "s", ShardSpec(1, 2))
    with open(shard.expert_path, "r+b") as f:
        f.truncate(shard.expert_stride)
    with pytest.raises(StoreError, match="truncated"):
        ExpertShard(shard.path)
    index = json.loads((shard.path / SHARD_INDEX).read_text())
    index["experts"] = [0, 4]
    (shard.path / SHARD_INDEX).write_text(json.dumps(index))
    with pytest.raises(StoreError, match="owns experts 0..3, shard 1/2"):
        ExpertShard(shard.path)
    with pytest.raises(StoreError, match="not an expert shard"):
        ExpertShard(packed.path)
