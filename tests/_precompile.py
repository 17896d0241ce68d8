"""Run by tests/conftest.py in a background process at the start of a test session: compiles into numba's cache
(a fresh clone's is empty) the kernels that the session's first tests do not compile themselves, on the core they
leave idle while the first tests (the CLI's) compile K3's kernels in their own processes:

1. the read-only variants a model over shared pages runs (`serve` lends its model to the lab's worker: ~23 s of
   `test_serve_mounts_the_lab_on_loopback_only_unless_asked` when cold);
2. the families' dense expert kernels (~72 s cold on 2 cores), which `load_model` compiles only for a family.

Nothing depends on it: a test that needs a kernel first compiles it itself (numba writes each cache file whole)."""

from __future__ import annotations

import tempfile

from k3serve.config import tiny_config
from k3serve.loading import load_model
from k3serve.model.kernels import warmup_dense_experts
from k3serve.weights.synthetic import write_random_checkpoint

with tempfile.TemporaryDirectory() as folder:
    load_model(write_random_checkpoint(tiny_config(), folder, seed=0), share_weights=True)
warmup_dense_experts()
