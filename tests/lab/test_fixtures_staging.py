"""The lab's cache folders are whole or absent (lab/fixtures.py `_atomic_dir`): a failed build leaves nothing, and a
build whose process was killed (a cancelled run's worker) leaves a `.staging-PID-*` folder that the next build in
that folder removes, while a live builder's is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from k3serve.lab.fixtures import _atomic_dir


def _write_one(folder) -> None:
    (folder / "done.txt").write_text("whole")


def test_a_failed_build_leaves_nothing(tmp_path):
    def failing(folder) -> None:
        (folder / "half.bin").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        _atomic_dir(tmp_path / "packed", failing)
    assert list(tmp_path.iterdir()) == []


def test_a_killed_build_is_removed_by_the_next_one_and_a_live_one_is_kept(tmp_path):
    code = ("import os, signal\nfrom pathlib import Path\nfrom k3serve.lab.fixtures import _atomic_dir\n"
            "def build(folder):\n    (folder / 'half.bin').write_bytes(b'half')\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            f"_atomic_dir(Path({str(tmp_path / 'packed')!r}), build)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, env=os.environ.copy())
    assert result.returncode == -9, result.stderr
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".staging-") and (left / "half.bin").exists()
    live = tmp_path / f".staging-{os.getpid()}-ab12"  # this process: a build still running
    live.mkdir()
    target = _atomic_dir(tmp_path / "families", _write_one)
    assert (target / "done.txt").read_text() == "whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["families", live.name])
    assert _atomic_dir(tmp_path / "families", _write_one) == target  # built once
