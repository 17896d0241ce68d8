"""Fixtures of the families tests: one tiny transformers model per family (built once per session), and the
measured-error report.

Set K3SERVE_PARITY_REPORT=path.json to write every measured error to that file (docs/FAMILIES.md quotes it):
    K3SERVE_PARITY_REPORT=/tmp/parity.json .venv/bin/pytest tests/model/families -q
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402  (a missing torch must fail the run, not skip it)

import _hf_tiny  # noqa: E402

torch.set_num_threads(1)  # CI has 2 shared cores; the tiny models gain nothing from more


@pytest.fixture(scope="session")
def parity_report():
    report: dict = {"transformers": _hf_tiny.TRANSFORMERS_VERSION, "torch": _hf_tiny.TORCH_VERSION, "families": {}}
    yield report["families"]
    path = os.environ.get("K3SERVE_PARITY_REPORT")
    if path:
        Path(path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """family -> (transformers model, checkpoint folder), built on first use."""
    built: dict = {}

    def get(family: str):
        if family not in built:
            folder = tmp_path_factory.mktemp(f"hf-{family}")
            built[family] = (_hf_tiny.build_tiny(family, folder), folder)
        return built[family]

    return get
