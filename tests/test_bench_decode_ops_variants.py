"""benchmarks/bench_decode_ops.py --k3serve-variants: the k3serve settings it alternates, each a label and the
environment variables its child gets on top of the defaults."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_decode_ops.py"


def test_variants_are_labels_with_their_environment():
    parse = runpy.run_path(str(BENCH))["parse_variants"]
    assert parse("") == {}
    assert parse("default; passive:K3SERVE_CORE_KEEPERS=0 ;active:K3SERVE_WAIT_POLICY=active,OPENBLAS_NUM_THREADS=1") \
        == {"default": {}, "passive": {"K3SERVE_CORE_KEEPERS": "0"},
            "active": {"K3SERVE_WAIT_POLICY": "active", "OPENBLAS_NUM_THREADS": "1"}}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse("spin:K3SERVE_SPIN")
    with pytest.raises(ValueError, match="twice"):
        parse("a;a:X=1")
