"""The training command is reproducible: the same seed writes byte-identical checkpoints, and they load."""

from __future__ import annotations

import json

from k3serve.loading import load_model
from k3serve.training.train import main

ARGS = ["--steps", "3", "--seq-len", "32", "--batch-size", "2", "--eval-every", "3", "--eval-windows", "2",
        "--code-bytes", "150000", "--prose-bytes", "40000", "--threads", "1"]


def test_same_seed_same_checkpoint(tmp_path):
    assert main(["--out", str(tmp_path / "a"), *ARGS]) == 0
    assert main(["--out", str(tmp_path / "b"), *ARGS]) == 0
    sums_a = (tmp_path / "a" / "SHA256SUMS").read_text()
    assert sums_a == (tmp_path / "b" / "SHA256SUMS").read_text()
    curve = json.loads((tmp_path / "a" / "train_log.json").read_text())["curve"]
    assert curve[-1]["step"] == 3 and all(curve[-1]["heldout_loss"][k] < curve[0]["heldout_loss"][k] for k in ("code", "prose"))
    loaded = load_model(tmp_path / "a")
    assert loaded.tokenizer is not None and loaded.model.config.num_experts == 64
