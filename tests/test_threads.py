"""How the kernels' threads wait (k3serve/threads.py): the policy set from K3SERVE_WAIT_POLICY, the CPU quota
read from the cgroup files, when the core keepers start, and the keepers themselves (idle class, spinning while a
forward is in flight, stopping on request)."""

from __future__ import annotations

import logging
import os
import time

import pytest

from k3serve.threads import CoreKeeper, WaitGovernor, configure_wait_policy, cpu_quota_cores, governed


def test_the_policy_sets_the_openmp_variables_and_an_explicit_one_wins(caplog):
    env: dict[str, str] = {}
    assert configure_wait_policy(env) == "adaptive" and env["OMP_WAIT_POLICY"] == "PASSIVE"  # + core keepers
    env = {"K3SERVE_WAIT_POLICY": "passive"}
    assert configure_wait_policy(env) == "passive" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    env = {"K3SERVE_WAIT_POLICY": "ACTIVE"}
    assert configure_wait_policy(env) == "active" and env["OMP_WAIT_POLICY"] == "ACTIVE"
    env = {"K3SERVE_SPIN": "300"}  # adaptive with a short spin before the workers sleep
    assert configure_wait_policy(env) == "adaptive" and env["GOMP_SPINCOUNT"] == "300" and "OMP_WAIT_POLICY" not in env
    env = {"K3SERVE_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "1000"}
    assert configure_wait_policy(env) == "explicit" and "OMP_WAIT_POLICY" not in env
    with caplog.at_level(logging.WARNING, logger="k3serve.threads"):
        assert configure_wait_policy({"K3SERVE_WAIT_POLICY": "spinny"}) == "adaptive"
    assert "spinny" in caplog.text and "passive" in caplog.text


def test_the_cpu_quota_is_read_from_cgroup_v2_and_v1(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job\n")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cpu.max").write_text("max 100000\n")
    assert cpu_quota_cores(str(tmp_path), str(proc)) is None
    (tmp_path / "job" / "cpu.max").write_text("150000 100000\n")
    assert cpu_quota_cores(str(tmp_path), str(proc)) == pytest.approx(1.5)
    v1 = tmp_path / "v1"
    (v1 / "cpu" / "job").mkdir(parents=True)
    proc.write_text("4:cpu,cpuacct:/job\n")
    (v1 / "cpu" / "job" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota_cores(str(v1), str(proc)) is None
    (v1 / "cpu" / "job" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu" / "job" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota_cores(str(v1), str(proc)) == pytest.approx(0.5)
    assert cpu_quota_cores(str(tmp_path / "none"), str(tmp_path / "missing")) is None


def test_keepers_start_only_where_they_help_and_cost_nothing():
    assert WaitGovernor("passive").keeper is None
    assert WaitGovernor("explicit").keeper is None
    assert WaitGovernor("adaptive", threads=1, cores=8).keeper is None
    assert WaitGovernor("adaptive", threads=4, cores=1).keeper is None
    quota = WaitGovernor("adaptive", threads=2, cores=2, quota=1.5)
    assert quota.keeper is None and "quota" in quota.reason
    governor = WaitGovernor("adaptive", threads=4, cores=2)
    assert governor.keeper is not None and governor.keeper.keepers == 2  # one per core the kernels use
    assert WaitGovernor("adaptive", threads=2, cores=2, keepers=1).keeper.keepers == 1
    assert WaitGovernor("adaptive", threads=2, cores=2, keepers=0).keeper is None


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_a_keeper_is_idle_class_spins_while_a_forward_is_in_flight_and_stops():
    keeper = CoreKeeper(1)
    try:
        assert keeper.start() and keeper.running
        thread = keeper.threads[0]
        assert os.sched_getscheduler(thread.native_id) == os.SCHED_IDLE
        before = keeper.spins
        keeper.begin()
        deadline = time.monotonic() + 10  # an idle-class thread runs when a core is free: soon, even under load
        while keeper.spins == before and time.monotonic() < deadline:
            time.sleep(0.01)
        keeper.end()
        assert keeper.spins > before
    finally:
        keeper.stop()
    if keeper.threads:
        keeper.threads[0].join(timeout=10)
        assert not keeper.threads[0].is_alive()


def test_forwards_in_several_threads_leave_no_forward_in_flight():
    """begin/end from many threads at once: the count of forwards in flight returns to 0 (a lost update would
    leave the keepers spinning for good)."""
    import threading

    from k3serve.threads import IN_FLIGHT

    keeper = CoreKeeper(1)  # not started: only the counting

    def work():
        for _ in range(2000):
            keeper.begin()
            keeper.end()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert keeper.state[IN_FLIGHT] == 0


def test_governed_keeps_the_forward_s_name_and_result_and_nests():
    calls = []
    governor = WaitGovernor("passive")

    class Model:
        @governed
        def forward(self, x):
            """doc"""
            calls.append(x)
            return x + 1

    assert Model().forward(1) == 2 and calls == [1]
    assert Model.forward.__name__ == "forward" and Model.forward.__doc__ == "doc"
    with governor.step():
        with governor.step():
            assert governor._local.depth == 2
    assert governor._local.depth == 0


_BLAS_PROBE = """
import os, sys, time
if sys.argv[1] == "k3serve-first":
    import k3serve
import numpy as np
import k3serve

def other_threads_cpu():
    ticks = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != os.getpid():
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")

a = np.ones((512, 512), np.float32)
for _ in range(3):
    a @ a  # threaded in OpenBLAS: its workers then spin, or sleep at once
before = other_threads_cpu()
time.sleep(0.3)
print(os.environ["OPENBLAS_THREAD_TIMEOUT"], k3serve.OPENBLAS_TIMEOUT_IN_FORCE, other_threads_cpu() - before)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="reads the threads' CPU time from Linux's /proc; OpenBLAS threads need 2 cores")
def test_importing_k3serve_before_numpy_makes_openblas_workers_sleep_after_a_call():
    """k3serve's __init__ sets OPENBLAS_THREAD_TIMEOUT before numpy loads OpenBLAS: after a threaded matmul its
    workers use no CPU (they spun ~0.1 s before, taking a core from the compiled kernels' threads). Imported after
    numpy, the setting is known not to be in force; a value the user set is kept."""
    import subprocess
    import sys

    def probe(order: str, **env: str) -> tuple[str, str, float]:
        environ = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
        done = subprocess.run([sys.executable, "-c", _BLAS_PROBE, order], env={**environ, "OPENBLAS_NUM_THREADS": "2",
                              **env}, capture_output=True, text=True, check=True)
        timeout, in_force, cpu = done.stdout.split()
        return timeout, in_force, float(cpu)

    timeout, in_force, spun = probe("k3serve-first")
    assert (timeout, in_force) == ("4", "True") and spun < 0.03
    assert probe("numpy-first")[:2] == ("4", "False")  # set for children, too late for this process's OpenBLAS
    assert probe("numpy-first", OPENBLAS_THREAD_TIMEOUT="12")[:2] == ("12", "True")


def test_a_model_loaded_where_numpy_came_first_warns_once(monkeypatch, caplog):
    import k3serve
    from k3serve.loading import loaded

    monkeypatch.setattr(k3serve, "OPENBLAS_TIMEOUT_IN_FORCE", False)
    monkeypatch.setattr(loaded, "_WARNED_BLAS_SPIN", False)
    with caplog.at_level(logging.WARNING, logger="k3serve.loading.loaded"):
        loaded.configure_threads(4096)
        loaded.configure_threads(4096)
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "OPENBLAS_THREAD_TIMEOUT=4" in caplog.records[0].getMessage()


def test_workers_spin_reads_the_environment_libgomp_reads():
    from k3serve.threads import workers_spin

    assert workers_spin({"OMP_WAIT_POLICY": "PASSIVE"}) is False  # adaptive and passive
    assert workers_spin({"OMP_WAIT_POLICY": "active"}) is True
    assert workers_spin({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300000"}) is False  # PASSIVE wins
    assert workers_spin({}) is True  # libgomp's own default: spin ~300,000 pauses, then sleep
    assert workers_spin({"GOMP_SPINCOUNT": "0"}) is False
    assert workers_spin({"GOMP_SPINCOUNT": "300"}) is True  # K3SERVE_SPIN=300
    assert workers_spin({"GOMP_SPINCOUNT": "2k"}) is True and workers_spin({"GOMP_SPINCOUNT": "infinite"}) is True
    env: dict[str, str] = {}
    configure_wait_policy(env)
    assert workers_spin(env) is False  # k3serve's default sleeps at once (keepers hold the cores instead)
    env = {"K3SERVE_WAIT_POLICY": "active"}
    configure_wait_policy(env)
    assert workers_spin(env) is True


def test_spinning_workers_give_numpy_s_blas_one_thread(monkeypatch):
    """Under `--wait-policy active` (or an explicit ACTIVE / spin count) a model of any width gets one BLAS thread:
    OpenBLAS's second thread would share a core with a spinning kernel worker. Sleeping workers leave a wide
    model's BLAS its threads."""
    from k3serve import threads
    from k3serve.loading import loaded

    calls: list[int] = []
    monkeypatch.setattr(loaded, "threadpool_limits", lambda limits, user_api: calls.append(limits))
    monkeypatch.setattr(threads, "workers_spin", lambda environ=None: False)
    loaded.configure_threads(4096)
    assert calls == []
    loaded.configure_threads(512)  # a small model: one thread whatever the policy
    assert calls == [1]
    monkeypatch.setattr(threads, "workers_spin", lambda environ=None: True)
    loaded.configure_threads(4096)
    assert calls == [1, 1]
