"""Outputs that are whole or absent: a command writes a temporary file in the output's own folder and renames it
over the output only once every byte is written, so a full disk, a crash or Ctrl-C never leaves a 0-byte or
half-written file under the name the user gave. Errors name the output's path (a write that fails with ENOSPC
carries no file name of its own)."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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
