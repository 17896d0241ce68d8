"""Run by tests/conftest.py in a background process at the start of a test session: compiles into numba's cache
(a fresh clone's is empty) the kernels that the session's first tests do not compile themselves, on the core they
leave idle while the first tests (the CLI's) compile K3's kernels in their own processes:

1. the read-only variants a model over shared pages runs (`serve` lends its model to the lab's worker: ~23 s of
   `test_serve_mounts_the_lab_on_loopback_only_unless_asked` when cold);
2. the families' dense expert kernels (~72 s cold on 2 cores), which `load_model` compiles only for a family;
3. a GGUF's Q8_0 expert kernels (`q8_0_experts_run`) with float16 and float32 block scales (~35 s each cold since
   their tiles, 2026-12-07 late night), which their tests would otherwise compile.

Nothing depends on it: a test that needs a kernel first compiles it itself (numba writes each cache file whole)."""

from __future__ import annotations

import tempfile

import numpy as np

from k3serve.config import tiny_config
from k3serve.loading import load_model
from k3serve.model.kernels import q8_0_experts_run, warmup_dense_experts
from k3serve.weights.synthetic import write_random_checkpoint

with tempfile.TemporaryDirectory() as folder:
    load_model(write_random_checkpoint(tiny_config(), folder, seed=0), share_weights=True)
warmup_dense_experts()
gate_up, down = np.zeros((1, 640, 288), np.int8), np.zeros((1, 288, 320), np.int8)  # rows of 9-10 blocks: tiles
one, x = np.zeros(1, np.int64), np.ones((12, 288), np.float32)
for dtype in (np.float16, np.float32):
    q8_0_experts_run(gate_up, np.ones((1, 640, 9), dtype), down, np.ones((1, 288, 10), dtype), one, x,
                     np.zeros(12, np.int64), one, np.full(1, 12, np.int64))
