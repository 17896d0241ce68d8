"""The embedded default model's packed store, made in the user cache on its first streaming use (the openers of
each architecture's stores are in loading/k3.py and loading/families.py)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from k3serve.default_model import DEFAULT_MODEL_NAME, cache_root, default_model_dir, verify_checksums
from k3serve.weights.store import is_packed_store

logger = logging.getLogger(__name__)


STAGING_PREFIX = ".staging-"


def _remove_stale_staging(folder: Path) -> None:
    """Remove the staging folders a killed packer left (`.staging-PID-*` whose process is gone, or one named before
    the PID was part of the name); a live packer's folder is kept."""
    if not folder.is_dir():
        return
    for staging in folder.glob(STAGING_PREFIX + "*"):
        pid_text = staging.name[len(STAGING_PREFIX):].split("-", 1)[0]
        if pid_text.isdigit() and _process_alive(int(pid_text)):
            continue
        logger.info("removing %s (left by an interrupted packing)", staging)
        shutil.rmtree(staging, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: a number no pid can be
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def default_packed_dir() -> Path:
    source = default_model_dir()
    target = cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-{verify_checksums(source)[:12]}-packed"
    _remove_stale_staging(target.parent)
    if is_packed_store(target):
        return target
    from k3serve.weights.pack import pack_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("packing the default model into %s (first streaming use only)", target)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=target.parent))
    try:
        pack_checkpoint(source, staging)
        try:
            staging.rename(target)
        except OSError:
            if not is_packed_store(target):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
