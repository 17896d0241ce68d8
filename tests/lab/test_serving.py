"""The `serving` module's server child: it answers, it is stopped on cancel, it dies with a killed parent, a failed
start says why; and the module's verdict follows its numbers. (A whole run at small parameters is in test_api.py's
every-module test, through the lab's worker process.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from k3serve.lab.registry import CancelToken, RunCancelled
from k3serve.lab.server_process import ServerProcess, ServerStartError
from k3serve.lab.serving_load import StreamedRequest, percentiles

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_dead(pid: int, seconds: float = 10.0) -> bool:
    """True when `pid` is gone within `seconds`; a survivor is killed (the test started it) and False returned."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return False


@pytest.mark.parametrize("cancel_at, params", [
    ("warming up", {"max_tokens": 256, "max_concurrency": 2}),  # in concurrent streams
    ("repeat 1: tenant A floods", {"max_tokens": 2, "max_concurrency": 1, "tenant_seconds": 30.0}),  # two tenants
])
def test_a_cancelled_serving_run_stops_both_servers(lab_fixtures, monkeypatch, cancel_at, params):
    from k3serve.lab.modules import serving

    started: list[ServerProcess] = []

    class Recorded(ServerProcess):
        def launch(self):
            started.append(self)
            return super().launch()

    monkeypatch.setattr(serving, "ServerProcess", Recorded)
    cancel = CancelToken()

    cancelled_at = []

    def progress(fraction: float, message: str) -> None:
        if message.startswith(cancel_at) and not cancelled_at:  # both servers answer /health by now
            assert all(_alive(s.pid) for s in started)
            cancelled_at.append(time.monotonic() + 0.2)
            threading.Timer(0.2, cancel.cancel).start()  # mid-traffic

    with pytest.raises(RunCancelled):
        serving.MODULE.run(serving.MODULE.validate(params, lab_fixtures), progress, cancel, lab_fixtures)
    assert time.monotonic() - cancelled_at[0] < 8.0  # seen within a chunk or 50 ms, then the servers' SIGTERM
    assert len(started) == 2
    for server in started:
        assert server.process.returncode is not None and not _alive(server.pid)


def test_the_server_dies_with_a_killed_parent(tmp_path):
    """The lab's worker is SIGKILLed when a run ignores Cancel: no Python runs then, the kernel stops the child."""
    parent = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {SRC!r})
        from k3serve.lab.server_process import ServerProcess
        server = ServerProcess([]).start()
        print(server.pid, flush=True)
        time.sleep(600)
    """)
    process = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(process.stdout.readline())
        assert _alive(server_pid)
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        assert _wait_dead(server_pid), "the server outlived its killed parent"
    finally:
        if process.poll() is None:
            process.kill()


def test_a_server_that_cannot_start_says_why(tmp_path):
    server = ServerProcess(["--model", str(tmp_path / "no-such-model")], ready_timeout_s=60)
    with pytest.raises(ServerStartError, match="exited with code") as error:
        server.start()
    assert "no-such-model" in str(error.value)
    assert server.process.returncode is not None and not _alive(server.pid)


def test_percentiles_and_streamed_gaps():
    assert percentiles([]) == {50: pytest.approx(float("nan"), nan_ok=True), 90: pytest.approx(float("nan"),
                                                                                               nan_ok=True),
                               99: pytest.approx(float("nan"), nan_ok=True)}
    got = percentiles([float(v) for v in range(1, 101)])
    assert got[50] == pytest.approx(50.5) and got[90] == pytest.approx(90.1) and got[99] == pytest.approx(99.01)
    request = StreamedRequest(sent=1.0, first_token=1.5, token_times=[1.5, 1.6, 1.8])
    assert request.ttft == pytest.approx(0.5) and request.gaps() == pytest.approx([0.1, 0.2])


def _row(tok_per_s: float, itl_ms: float) -> dict[str, float]:
    return {"tok_per_s": tok_per_s, "itl_p50_ms": itl_ms, "itl_p99_ms": 2 * itl_ms}


def test_the_verdict_follows_the_sweep():
    from k3serve.lab.modules.serving import _verdict

    growing = _verdict({1: _row(50.0, 10.0), 2: _row(90.0, 11.0), 4: _row(150.0, 13.0)})
    assert growing.outcome == "won" and growing.factor == pytest.approx(3.0) and growing.metric == "tok_per_s"
    assert "150 tok/s to 4 concurrent openai clients here, 3.00x one client's 50 tok/s, at 1.30x" in growing.sentence
    assert growing.flips_when.startswith("throughput still grew at every step up to 4 streams")
    saturated = _verdict({1: _row(50.0, 10.0), 2: _row(90.0, 11.0), 4: _row(80.0, 25.0), 8: _row(95.0, 40.0)})
    assert saturated.outcome == "won" and saturated.flips_when == "more streams stopped paying at 4: 80 tok/s " \
        "against 90 at 2"
    assert _verdict({1: _row(50.0, 10.0), 2: _row(49.0, 20.0)}).outcome == "even"
    assert _verdict({1: _row(50.0, 10.0), 2: _row(30.0, 20.0)}).outcome == "lost"


@pytest.mark.parametrize("fcfs_ms, fair_ms, said", [(300.0, 100.0, "cut tenant B's p99 time to first token 3.00x"),
                                                    (100.0, 300.0, "raised tenant B's p99 time to first token 3.00x"),
                                                    (100.0, 98.0, "left tenant B's p99 time to first token even")])
def test_the_tenants_sentence_follows_the_measured_p99(fcfs_ms, fair_ms, said):
    from k3serve.lab.modules.serving import _tenants_sentence

    tenants = {"fcfs": {"b_ttft_p99_ms": fcfs_ms, "total_tok_per_s": 200.0},
               "fair": {"b_ttft_p99_ms": fair_ms, "total_tok_per_s": 190.0}}
    sentence = _tenants_sentence(tenants)
    assert sentence.startswith(f"Fair scheduling {said}") and "at 0.95x fcfs's total throughput" in sentence


def _servers_of_a_serving_run() -> list[int]:
    """Pids of live `k3serve serve` children started by a serving run (their tenants file is in k3lab-serving-*)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in command and any(b"/k3lab-serving-" in part for part in command) and _alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def test_a_killed_lab_worker_takes_its_servers_with_it(lab_fixtures):
    """What the lab does to a run that does not stop within its grace: the worker process is SIGKILLed."""
    from k3serve.lab.modules import serving
    from k3serve.lab.worker import LabWorker

    worker = LabWorker(lab_fixtures)
    seen: list[int] = []

    def on_progress(fraction: float, message: str) -> None:
        if message.startswith("warming up") and not seen:
            seen.extend(_servers_of_a_serving_run())
            os.kill(worker.pid, signal.SIGKILL)

    try:
        params = serving.MODULE.validate({"max_tokens": 256, "max_concurrency": 2}, lab_fixtures)
        outcome = worker.run(serving.MODULE, params, on_progress, lambda: None, time_limit=120)
    finally:
        worker.close()
    assert outcome.status == "failed" and outcome.worker_replaced and "died" in outcome.error
    assert len(seen) == 2, seen  # both servers were up when the worker died
    for pid in seen:
        assert _wait_dead(pid), f"server {pid} outlived the killed worker"
