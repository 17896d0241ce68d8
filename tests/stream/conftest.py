"""A routing trace of the tiny oracle's packed store (`tiny_store`, tests/conftest.py) and its co-activation layout."""

from __future__ import annotations

import pytest

from k3serve.weights.pack import pack_checkpoint


@pytest.fixture(scope="session")
def tiny_trace(tiny_store, tmp_path_factory):
    from k3serve.loading import load_model
    from k3serve.stream.options import StreamOptions

    path = tmp_path_factory.mktemp("trace") / "tiny.trace"
    loaded = load_model(tiny_store.path, stream=StreamOptions(trace_out=path))
    loaded.model.greedy([1, 5, 9, 200, 17], 12)
    loaded.model.source.close()
    return path


@pytest.fixture(scope="session")
def tiny_store_coactivation(tiny_dir, tiny_trace, tmp_path_factory):
    from k3serve.stream.trace import read_trace

    return pack_checkpoint(tiny_dir, tmp_path_factory.mktemp("tiny-packed-co"), layout="coactivation",
                           token_sets=read_trace(tiny_trace).token_sets())
