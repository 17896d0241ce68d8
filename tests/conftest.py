"""Shared fixtures: the tiny oracle checkpoint, written once per test session, models over it, and its packed store
with expert shards."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

# every test run generates its own default model unless the caller points elsewhere
os.environ.setdefault("K3SERVE_CACHE", tempfile.mkdtemp(prefix="k3serve-test-cache-"))

from k3serve.config import tiny_config  # noqa: E402
from k3serve.loading import load_model  # noqa: E402
from k3serve.weights.checkpoint import Checkpoint  # noqa: E402
from k3serve.weights.synthetic import write_random_checkpoint  # noqa: E402

TINY_SEED = 0

_precompile: subprocess.Popen | None = None


def pytest_sessionstart(session):
    """Compile what the first tests leave to later ones on the core they leave idle (tests/_precompile.py)."""
    global _precompile
    _precompile = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "_precompile.py")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_sessionfinish(session, exitstatus):
    if _precompile is not None and _precompile.poll() is None:
        _precompile.kill()
        _precompile.wait()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    return write_random_checkpoint(tiny_config(), out, seed=TINY_SEED, max_shard_bytes=1 << 20)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    return load_model(tiny_dir).model


@pytest.fixture(scope="session")
def tiny_shards(tiny_dir, tmp_path_factory):
    """The tiny oracle packed (an expert-parallel front's trunk) and its expert shards i/2 and i/4: (store,
    {N: [shard paths]})."""
    from k3serve.weights.pack import pack_checkpoint
    from k3serve.weights.shard import ShardSpec, pack_shard

    root = tmp_path_factory.mktemp("tiny-shards")
    packed = pack_checkpoint(tiny_dir, root / "packed")
    shards = {n: [pack_shard(packed.path, root / f"s{i}of{n}", ShardSpec(i, n)).path for i in range(n)]
              for n in (2, 4)}
    return packed, shards


@pytest.fixture(scope="session")
def tiny_reference(tiny_dir):
    from k3serve.model.reference import ReferenceModel

    checkpoint = Checkpoint(tiny_dir)
    tensors = {name: checkpoint.read(name) for name in checkpoint.index.names()}
    return ReferenceModel(checkpoint.config, tensors)


@pytest.fixture(scope="session")
def tiny_store(tiny_dir, tmp_path_factory):
    """The tiny oracle packed in the natural layout (a streaming store)."""
    from k3serve.weights.pack import pack_checkpoint

    return pack_checkpoint(tiny_dir, tmp_path_factory.mktemp("tiny-packed"))
