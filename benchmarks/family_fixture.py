"""`--model DIR` or `--family NAME` for the benchmarks that run any model family.

`--family NAME` (kimi_linear, deepseek_v3, qwen3_moe, qwen3_next) writes a random tiny checkpoint of that family
(`k3serve.model.families.synthetic`, no torch needed) once into $K3BENCH_DIR/families/NAME (default
/tmp/k3bench-families/NAME) and benchmarks that. The tiny models have hidden size 64 and random weights: their
figures show that a path runs and how its parts compare, not the speed of a released model of the family; pass
`--model DIR` for a real checkpoint.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from k3serve.model.families.synthetic import SYNTHETIC_FAMILIES, write_random_family

_ROOT = Path(os.environ.get("K3BENCH_DIR", "/tmp/k3bench-families")) / "families"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--model", default=None, help="checkpoint folder, K3 or a family (default: the embedded model)")
    group.add_argument("--family", choices=SYNTHETIC_FAMILIES, default=None,
                       help="a random tiny checkpoint of this family (k3serve.model.families.synthetic)")


def family_model_dir(family: str) -> Path:
    folder = _ROOT / family
    if not (folder / "config.json").exists():
        write_random_family(family, folder)
    return folder


def model_path(args: argparse.Namespace) -> tuple[str | None, str]:
    """(what load_model takes, the label the record carries)."""
    if getattr(args, "family", None):
        return str(family_model_dir(args.family)), f"random tiny {args.family} (k3serve.model.families.synthetic)"
    return args.model, args.model or "embedded default"
