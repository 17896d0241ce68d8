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
    """A wait setting in this process (a benchmark's OMP_WAIT_POLICY, k3serve's own K3SERVE_WAIT_POLICY) must not
    reach a child started "at its defaults" (a benchmark once ran llama.cpp with its workers sleeping that way)."""
    import os

    from k3serve.host import defaults_environment

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    for name, value in (("K3SERVE_WAIT_POLICY", "passive"), ("K3SERVE_CORE_KEEPERS", "1"), ("K3SERVE_SPIN", "300"),
                        ("OPENBLAS_THREAD_TIMEOUT", "4")):
        monkeypatch.setenv(name, value)
    env = defaults_environment(2)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "K3SERVE_WAIT_POLICY", "K3SERVE_CORE_KEEPERS", "K3SERVE_SPIN",
                 "OPENBLAS_THREAD_TIMEOUT"):
        assert name not in env, name
    assert env["OMP_NUM_THREADS"] == env["NUMBA_NUM_THREADS"] == "2"
    assert env["PATH"] == os.environ["PATH"]
