"""describe_host: the machine fields every benchmark record carries."""

from __future__ import annotations

import os
import platform

from k3serve.host import describe_host


def test_the_record_names_this_machine():
    host = describe_host()
    assert host["cores"] == os.cpu_count()
    assert host["python"] == platform.python_version()
    assert isinstance(host["cpu"], str) and host["cpu"]
    assert host["load_average"] >= 0


def test_a_peer_runs_at_its_own_defaults_not_at_the_wait_policy_k3serve_set(monkeypatch):
    """Importing the kernels sets OMP_WAIT_POLICY=PASSIVE in this process; a child started "at its defaults" must not
    inherit it (a benchmark once ran llama.cpp with its workers sleeping that way)."""
    import os

    import k3serve.model.kernels  # noqa: F401  (sets the variable when it was unset)
    from k3serve.host import defaults_environment

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    env = defaults_environment(2)
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env
    assert env["OMP_NUM_THREADS"] == env["NUMBA_NUM_THREADS"] == "2"
    assert env["PATH"] == os.environ["PATH"]
