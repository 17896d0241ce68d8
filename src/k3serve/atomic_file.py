"""Outputs that are whole or absent: a command writes a temporary file in the output's own folder and renames it
over the output only once every byte is written, so a full disk, a crash or Ctrl-C never leaves a 0-byte or
half-written file under the name the user gave. Errors name the output's path (a write that fails with ENOSPC
carries no file name of its own)."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

STAGING_PREFIX = ".staging-"  # builders' folders in a shared cache: `.staging-PID-...`


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Re-raise an OSError that names no file (a failed write: ENOSPC, EIO) as the same error naming `path`."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path)) from exc


def temporary_sibling(path: str | Path) -> Path:
    """A new, empty file beside `path` (same folder, so the final rename is atomic), made with the usual
    permissions (0o666 less the umask, as `open` would)."""
    path = Path(path)
    while True:
        candidate = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return candidate
        except FileExistsError:
            continue


@contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces `path`, on any error (or interrupt) it is removed.
    The folder of `path` must exist: nothing is created above it."""
    path = Path(path)
    with naming(path):
        staging = temporary_sibling(path)
        try:
            yield staging
            os.replace(staging, path)
        finally:
            staging.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> None:
    """`path.write_text(text)`, whole or not at all."""
    with atomic_output(path) as staging:
        staging.write_text(text)


@contextmanager
def staged_folder(path: str | Path) -> Iterator[Path]:
    """Yield a new folder beside `path` to fill; on success it becomes `path` (which must be absent or an empty
    folder), on any error it is removed, so a full disk or Ctrl-C never leaves a half-written folder."""
    path = Path(path)
    with naming(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.staging-", dir=path.parent))
        try:
            yield staging
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
            staging.rename(path)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)


def new_staging_folder(parent: str | Path) -> Path:
    """A new folder `.staging-PID-...` in `parent` (created) for a builder in a cache that several processes share:
    the PID in its name lets a later `remove_stale_staging` tell a killed builder's folder from a live one's."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=parent))


def remove_stale_staging(parent: str | Path) -> None:
    """Remove the staging folders in `parent` that killed builders left (`.staging-PID-*` whose process is gone,
    or one named before the PID was part of the name); a live builder's folder is kept."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for staging in parent.glob(STAGING_PREFIX + "*"):
        pid_text = staging.name[len(STAGING_PREFIX):].split("-", 1)[0]
        if pid_text.isdigit() and process_alive(int(pid_text)):
            continue
        logger.info("removing %s (left by an interrupted build)", staging)
        shutil.rmtree(staging, ignore_errors=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: a number no pid can be
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
