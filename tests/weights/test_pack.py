"""The packer: aligned, checksummed, byte-exact blobs; trunk layers contiguous; layouts are permutations."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from k3serve.weights import names
from k3serve.weights.checkpoint import Checkpoint
from k3serve.weights.layout import adjacency_score, coactivation_matrix, coactivation_order, layer_order
from k3serve.weights.pack import pack_checkpoint
from k3serve.weights.store import ALIGNMENT, StoreError, expert_parts


@pytest.fixture(scope="module")
def packed(tiny_dir, tmp_path_factory):
    return pack_checkpoint(tiny_dir, tmp_path_factory.mktemp("packed"))


def test_expert_blobs_are_aligned_checksummed_and_byte_exact(packed, tiny_dir):
    checkpoint = Checkpoint(tiny_dir)
    data = packed.expert_path.read_bytes()
    assert packed.expert_stride % ALIGNMENT == 0
    for layer in packed.config.moe_layer_ids:
        for expert in range(packed.config.num_experts):
            offset = packed.expert_offset(layer, expert)
            assert offset % ALIGNMENT == 0
            blob = data[offset:offset + packed.expert_blob_size]
            assert zlib.crc32(blob) == packed.experts[layer].crc32[expert]
            for part in expert_parts(packed.config):
                stored = checkpoint.index.read_raw(names.expert_name(layer, expert, part.matrix, part.part))
                assert blob[part.offset:part.offset + part.nbytes] == stored.tobytes()


def test_trunk_layers_are_one_contiguous_blob_each(packed, tiny_dir):
    checkpoint = Checkpoint(tiny_dir)
    data = packed.trunk_path.read_bytes()
    previous_end = packed.globals.offset + packed.globals.read_size
    for layer, blob in enumerate(packed.layers):
        assert blob.offset % ALIGNMENT == 0 and blob.offset == previous_end
        previous_end = blob.offset + blob.read_size
        raw = np.frombuffer(data[blob.offset:blob.offset + blob.size], np.uint8)
        assert zlib.crc32(raw.tobytes()) == blob.crc32
        decoded = blob.decode(raw)
        for spec in names.layer_trunk_specs(packed.config, layer):
            assert np.array_equal(decoded[spec.name], checkpoint.read(spec.name))


def test_layouts_are_permutations_and_coactivation_chains_partners():
    sets = [(0, 5), (0, 5), (0, 5), (2, 7), (2, 7), (1, 3)]
    for layout in ("natural", "frequency", "coactivation"):
        assert sorted(layer_order(layout, 8, sets)) == list(range(8))
    order = coactivation_order(coactivation_matrix(sets, 8))
    assert abs(order.index(0) - order.index(5)) == 1 and abs(order.index(2) - order.index(7)) == 1
    matrix = coactivation_matrix(sets, 8)
    assert adjacency_score(order, matrix) > adjacency_score(range(8), matrix)
    assert layer_order("frequency", 8, sets)[:2] == [0, 5]


def test_pack_refuses_a_trace_layout_without_a_trace(tiny_dir, tmp_path):
    with pytest.raises(StoreError, match="needs a routing trace"):
        pack_checkpoint(tiny_dir, tmp_path / "x", layout="coactivation")
