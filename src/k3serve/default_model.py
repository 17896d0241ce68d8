"""Where models live: the embedded default model inside the package (checked against its SHA256SUMS once per
process) and the user cache (`$K3SERVE_CACHE`, else `$XDG_CACHE_HOME/k3serve`).

The embedded default is a small K3 that k3serve trained itself (docs/MODEL.md; `python -m k3serve.training.train`
rebuilds it); a file that does not match its checksum is refused with its name.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from k3serve.errors import CheckpointError

DEFAULT_MODEL_NAME = "k3-trained-default"
DEFAULT_MODEL_PATH = Path(__file__).parent / "assets" / "default_model"
_verified: dict[Path, str] = {}


def cache_root() -> Path:
    if os.environ.get("K3SERVE_CACHE"):
        return Path(os.environ["K3SERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "k3serve"


def verify_checksums(folder: Path) -> str:
    """Check every file listed in folder/SHA256SUMS; returns the digest of that list (the model's identity)."""
    folder = Path(folder)
    if folder in _verified:
        return _verified[folder]
    sums = folder / "SHA256SUMS"
    try:
        listing = sums.read_text()
    except OSError as exc:
        raise CheckpointError(f"{sums}: cannot read the checksum list: {exc}") from exc
    for line in listing.splitlines():
        if not line.strip():
            continue
        expected, _, name = line.partition("  ")
        path = folder / name
        try:
            actual = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read: {exc}") from exc
        if actual != expected:
            raise CheckpointError(f"{path}: sha256 {actual} does not match {expected} in {sums}; the file is "
                                  "damaged (reinstall k3serve)")
    digest = hashlib.sha256(listing.encode()).hexdigest()
    _verified[folder] = digest
    return digest


def default_model_dir() -> Path:
    """The embedded default model's folder (inside the package), after its checksums are verified."""
    verify_checksums(DEFAULT_MODEL_PATH)
    return DEFAULT_MODEL_PATH
