"""`load_model(share_weights=True)` (a resident K3 checkpoint's weights in sealed shared pages) and
`load_model(path, shared_weights=...)` (a model over pages shared before): the same logits bit for bit as a plain
load, every weight a read-only view inside the one memory file, and a clear error for weights of another folder.
What cannot share (a streamed store, a family) loads as before, with no handle."""

from __future__ import annotations

import numpy as np
import pytest

from _shared_weights import PROMPT, inside, memfd_spans, weight_arrays
from k3serve.errors import CheckpointError
from k3serve.loading import load_model
from k3serve.weights.shared_pages import supported

pytestmark = pytest.mark.skipif(not supported(), reason="shared pages need Linux's memfd_create")


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def shared(tiny_dir):
    return load_model(tiny_dir, share_weights=True)


def test_shared_weights_give_the_same_logits_bit_for_bit(plain, shared):
    assert plain.shared_weights is None and shared.shared_weights is not None
    assert np.array_equal(plain.model.logits(PROMPT), shared.model.logits(PROMPT))
    assert np.array_equal(plain.model.logits(PROMPT[:6], mode="incremental"),
                          shared.model.logits(PROMPT[:6], mode="incremental"))
    assert shared.model.source.nbytes == plain.model.source.nbytes
    assert plain.model.source.nbytes <= shared.shared_weights.nbytes < plain.model.source.nbytes + 64 * 1024


def test_every_weight_is_a_read_only_view_of_the_one_memory_file(shared):
    spans = memfd_spans(shared.shared_weights.arrays.pages.inode)
    arrays = weight_arrays(shared.model.source)
    assert spans and len(arrays) > 50
    assert all(not a.flags.writeable for a in arrays)
    assert all(inside(a, spans) for a in arrays)
    with pytest.raises(ValueError, match="read-only"):
        shared.model.source.global_weights().embed[0, 0] = 1.0


def test_a_second_model_over_the_shared_weights_maps_the_same_pages(tiny_dir, plain, shared):
    again = load_model(tiny_dir, shared_weights=shared.shared_weights)
    assert again.shared_weights is shared.shared_weights and again.tokenizer is None  # the tiny oracle has none
    spans = memfd_spans(shared.shared_weights.arrays.pages.inode)
    assert all(inside(a, spans) for a in weight_arrays(again.model.source))
    assert np.array_equal(again.model.logits(PROMPT), plain.model.logits(PROMPT))


def test_shared_weights_of_another_folder_are_refused(shared, tiny_store):
    with pytest.raises(CheckpointError, match="shared weights"):
        load_model(None, shared_weights=shared.shared_weights)  # the embedded model's folder, not the tiny one
    with pytest.raises(CheckpointError, match="shared weights"):
        load_model(tiny_store.path, shared_weights=shared.shared_weights)


def test_what_cannot_share_loads_as_before_with_no_handle(tiny_store, tmp_path):
    from k3serve.model.families.synthetic import write_random_family

    streamed = load_model(tiny_store.path, share_weights=True)  # a streamed store: its experts come from disk
    assert streamed.shared_weights is None
    family_dir = tmp_path / "qwen3_moe"
    write_random_family("qwen3_moe", family_dir)
    family = load_model(family_dir, share_weights=True)  # the families offer no shared weights
    assert family.shared_weights is None and family.architecture.share_folder is None
    assert np.isfinite(family.model.logits([1, 2, 3])).all()
