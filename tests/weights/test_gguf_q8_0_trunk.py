"""A K3 GGUF file whose trunk is Q8_0 (as llama.cpp's Q8_0 files are) keeps that trunk as its Q8_0 blocks: held in
RAM as the file's bytes, multiplied by the Q8_0 kernel, packed unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from test_gguf_k3 import write_k3_gguf

from k3serve.loading import load_model
from k3serve.stream.options import StreamOptions
from k3serve.weights.gguf_file import GGUFFile
from k3serve.weights.pack import pack_checkpoint
from k3serve.weights.quantized import QuantizedMatrix

IDS = [1, 5, 9, 200, 17, 3]


@pytest.fixture(scope="module")
def q8_0_gguf(tiny_dir, tmp_path_factory):
    return write_k3_gguf(tiny_dir, tmp_path_factory.mktemp("k3q8") / "tiny-q8_0.gguf", trunk_type="Q8_0")


@pytest.fixture(scope="module")
def bf16_gguf(tiny_dir, tmp_path_factory):
    return write_k3_gguf(tiny_dir, tmp_path_factory.mktemp("k3bf16") / "tiny.gguf")


def _trunk_bytes(model) -> int:
    return sum(model.source.layer(l).nbytes for l in range(model.config.num_layers))


def test_q8_0_trunk_is_held_as_the_files_blocks(q8_0_gguf, bf16_gguf):
    loaded = load_model(q8_0_gguf)
    layer = loaded.model.source.layer(0)
    o_proj = layer.attention.o_proj
    assert isinstance(o_proj, QuantizedMatrix) and o_proj.precision == "q8_0"
    file = GGUFFile(q8_0_gguf)
    try:
        stored = np.asarray(file.tensor("blk.0.attn_output.weight").data).reshape(-1)
        assert np.array_equal(o_proj.data.reshape(-1), stored)  # the bytes, not a re-encoding
    finally:
        file.close()
    assert isinstance(loaded.model.source.global_weights().lm_head, QuantizedMatrix)
    float_model = load_model(bf16_gguf).model  # the same trunk read from BF16 is widened to float32
    assert _trunk_bytes(loaded.model) < 0.45 * _trunk_bytes(float_model)
    assert np.all(np.isfinite(loaded.model.logits(IDS)))


def test_packing_a_q8_0_gguf_keeps_its_blocks_and_its_logits(q8_0_gguf, tmp_path):
    resident = load_model(q8_0_gguf).model
    store = pack_checkpoint(q8_0_gguf, tmp_path / "store")
    dtypes = {t.dtype for b in store.layers for t in b.tensors}
    assert "Q8_0" in dtypes and store.trunk_precision == "bf16"  # "as stored": the file's Q8_0 stays Q8_0
    loaded = load_model(store.path, stream=StreamOptions(trunk_dtype="bf16"))
    try:
        assert np.array_equal(loaded.model.logits(IDS), resident.logits(IDS))
    finally:
        loaded.model.source.close()
    again = pack_checkpoint(q8_0_gguf, tmp_path / "again", trunk_precision="q8_0")  # nothing re-encoded
    assert again.trunk_path.read_bytes() == store.trunk_path.read_bytes()
