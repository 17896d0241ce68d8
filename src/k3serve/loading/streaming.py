"""The embedded default model's packed store, made in the user cache on its first streaming use (the openers of
each architecture's stores are in loading/k3.py and loading/families.py)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from k3serve.atomic_file import new_staging_folder, remove_stale_staging
from k3serve.default_model import DEFAULT_MODEL_NAME, cache_root, default_model_dir, verify_checksums
from k3serve.weights.store import STORE_VERSION, is_packed_store

logger = logging.getLogger(__name__)


def default_packed_dir() -> Path:
    source = default_model_dir()
    # NOTE: the store format is in the name, so a cache packed by an older k3serve is not reused (it would still
    # open, but run as that format: a format-1 store builds its trunk as copies)
    target = cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-{verify_checksums(source)[:12]}-packed-v{STORE_VERSION}"
    remove_stale_staging(target.parent)
    if is_packed_store(target):
        return target
    from k3serve.weights.pack import pack_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("packing the default model into %s (first streaming use only)", target)
    staging = new_staging_folder(target.parent)
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
