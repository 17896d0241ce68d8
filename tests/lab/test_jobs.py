"""The run queue with stand-in modules: one run at a time in order, in one worker process that lives across runs; the
result cache; cancellation, also of a run that never checks; the time limit; failures.

The stand-in modules' functions are defined at the top level: the worker process imports them by name."""

from __future__ import annotations

import os
import time

import pytest

from k3serve.lab.jobs import LabQueueConfig, RunQueue
from k3serve.lab.registry import Figure, LabModule, LabParamError, LabResult, Param

FIXTURES_BUILT = 0  # in the worker process: how many times the fixtures were built there


class _Fixtures:
    model_arg = None

    def __init__(self) -> None:
        global FIXTURES_BUILT
        FIXTURES_BUILT += 1

    def __reduce__(self):
        return _Fixtures, ()


def _module(name: str, body) -> LabModule:
    return LabModule(id=name, number=90, title=name, summary="s", explanation="e", kind="simulated",
                     params=(Param("x", "int", 1, min=0, max=100000),), run=body)


def _result(value: float, **extra: float) -> LabResult:
    return LabResult({"v": value, **extra}, {"v": 0.0},
                     [Figure("f", "bar", False, "test", [{"name": "a", "x": [1], "y": [value]}], y_label="value (count)")])


def timed(params, progress, cancel, lab) -> LabResult:
    start = time.time()
    time.sleep(0.05)
    return _result(params["x"], start=start, end=time.time(), pid=os.getpid(), fixtures_built=FIXTURES_BUILT)


def sleepy(params, progress, cancel, lab) -> LabResult:
    time.sleep(params["x"] / 1000)
    return _result(params["x"], pid=os.getpid())


def cooperative(params, progress, cancel, lab) -> LabResult:
    for i in range(params["x"]):
        cancel.check()
        progress(i / params["x"], f"step {i}")
        time.sleep(0.01)
    return _result(0, pid=os.getpid())


def stuck(params, progress, cancel, lab) -> LabResult:
    """Never checks for cancellation (as a long simulation between checks, or a compiled kernel)."""
    progress(0.05, "stuck")
    time.sleep(3600)
    return _result(0)


def halfway(params, progress, cancel, lab) -> LabResult:
    progress(0.5, "halfway")
    time.sleep(params["x"] / 1000)
    return _result(1)


def failing(params, progress, cancel, lab) -> LabResult:
    raise ValueError("boom")


def crashing(params, progress, cancel, lab) -> LabResult:
    os._exit(3)


@pytest.fixture
def queue():
    q = RunQueue(_Fixtures(), LabQueueConfig(max_run_seconds=30))
    yield q
    q.close()


def _wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_runs_are_serialized_in_order_in_one_worker_and_cached(queue):
    module = _module("serial", timed)
    jobs = [queue.submit(module, {"x": i}) for i in range(4)]
    assert queue.position(jobs[3]) in (3, 4)  # behind the running one (or all four still queued)
    for job in jobs:
        assert job.done_event.wait(30), job.message
    metrics = [j.result["metrics"] for j in jobs]
    assert [m["v"] for m in metrics] == [0, 1, 2, 3]
    assert all(a["end"] <= b["start"] for a, b in zip(metrics, metrics[1:]))  # in order, never overlapping
    assert {m["pid"] for m in metrics} == {queue.worker.pid} and queue.worker.pid != os.getpid()
    assert {m["fixtures_built"] for m in metrics} == {1}  # the worker's fixtures are built once and reused
    again = queue.submit(module, {"x": 2})
    assert again.cached and again.status == "done" and again.result is jobs[2].result
    fresh = queue.submit(module, {"x": 2}, rerun=True)
    assert not fresh.cached and fresh.done_event.wait(30) and fresh.result["metrics"]["start"] > metrics[3]["end"]


def test_identical_queued_request_joins_the_existing_job(queue):
    module = _module("join", sleepy)
    first = queue.submit(module, {"x": 300})
    second = queue.submit(module, {"x": 300})
    assert second is first
    assert first.done_event.wait(30) and first.status == "done"


def test_progress_reaches_the_job(queue):
    job = queue.submit(_module("halfway", halfway), {"x": 3000})
    _wait_until(lambda: job.message == "halfway")
    assert job.progress == 0.5 and job.status == "running"
    assert queue.cancel(job.id) is job


def test_cancel_stops_a_running_job_and_drops_a_queued_one(queue):
    module = _module("long", cooperative)
    running = queue.submit(module, {"x": 100000})
    queued = queue.submit(module, {"x": 99999})
    _wait_until(lambda: running.status == "running" and running.progress > 0)
    pid = queue.worker.pid
    queue.cancel(queued.id)
    assert queued.status == "cancelled" and queued.done_event.is_set()
    queue.cancel(running.id)
    assert running.done_event.wait(2)
    assert running.status == "cancelled" and running.result is None
    after = queue.submit(_module("after", sleepy), {"x": 1})
    assert after.done_event.wait(30) and after.status == "done"
    assert after.result["metrics"]["pid"] == pid  # a run that stops at its check keeps the worker


def test_cancel_stops_a_run_that_never_checks_within_two_seconds(queue):
    job = queue.submit(_module("stuck", stuck), {})
    _wait_until(lambda: job.message == "stuck")
    pid = queue.worker.pid
    cancelled_at = time.monotonic()
    queue.cancel(job.id)
    assert job.done_event.wait(2) and time.monotonic() - cancelled_at < 2.0
    assert job.status == "cancelled" and job.result is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the worker that ran it is gone
    after = queue.submit(_module("after", sleepy), {"x": 1})  # the queue moves on, in a fresh worker
    assert after.done_event.wait(30) and after.status == "done", after.error
    assert after.result["metrics"]["pid"] != pid


def test_a_run_past_the_time_limit_fails_and_the_queue_moves_on():
    queue = RunQueue(_Fixtures(), LabQueueConfig(max_run_seconds=1.0))
    try:
        job = queue.submit(_module("stuck", stuck), {})
        behind = queue.submit(_module("after", sleepy), {"x": 1})
        assert job.done_event.wait(10)
        assert job.status == "failed" and "time limit of 1 s" in job.error
        assert behind.done_event.wait(30) and behind.status == "done"
    finally:
        queue.close()


def test_a_failing_module_fails_its_job_only(queue):
    failed = queue.submit(_module("bad", failing), {})
    good = queue.submit(_module("good", sleepy), {"x": 1})
    assert failed.done_event.wait(30) and good.done_event.wait(30)
    assert failed.status == "failed" and "boom" in failed.error
    assert good.status == "done" and good.result["metrics"]["v"] == 1


def test_a_worker_that_dies_fails_its_job_and_is_replaced(queue):
    died = queue.submit(_module("crash", crashing), {})
    good = queue.submit(_module("good", sleepy), {"x": 1})
    assert died.done_event.wait(30) and good.done_event.wait(30)
    assert died.status == "failed" and "exit code 3" in died.error
    assert good.status == "done"


def test_a_module_the_worker_cannot_receive_fails_its_job(queue):
    job = queue.submit(_module("lambda", lambda params, progress, cancel, lab: _result(0)), {})
    assert job.done_event.wait(30) and job.status == "failed" and "worker" in job.error


def test_bad_parameters_are_refused_before_queueing(queue):
    with pytest.raises(LabParamError):
        queue.submit(_module("p", sleepy), {"x": -1})


def test_the_result_cache_is_bounded(queue, monkeypatch):
    import k3serve.lab.jobs as jobs

    monkeypatch.setattr(jobs, "MAX_CACHED_RESULTS", 2)
    module = _module("bounded", sleepy)
    for x in (1, 2, 3):
        assert queue.submit(module, {"x": x}).done_event.wait(30)
    assert not queue.submit(module, {"x": 1}).cached  # evicted: measured again
    assert queue.submit(module, {"x": 3}).cached


def test_the_queue_is_bounded():
    from k3serve.lab.jobs import LabQueueFull

    queue = RunQueue(_Fixtures(), LabQueueConfig(max_run_seconds=30, max_queued=2))
    try:
        module = _module("bounded_queue", cooperative)
        running = queue.submit(module, {"x": 100000})
        _wait_until(lambda: running.status == "running")
        waiting = [queue.submit(module, {"x": x}) for x in (99998, 99999)]
        with pytest.raises(LabQueueFull):
            queue.submit(module, {"x": 99997})
        assert queue.submit(module, {"x": 99999}) is waiting[1]  # joining a queued job adds nothing
        queue.cancel(waiting[0].id)
        assert queue.submit(module, {"x": 99997}).status == "queued"  # room again
    finally:
        queue.close()


def test_a_worker_that_cannot_start_fails_the_job_and_the_queue_goes_on(queue, monkeypatch):
    real_start = queue.worker._start
    calls = []

    def start_once_broken() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("no processes left")
        real_start()

    monkeypatch.setattr(queue.worker, "_start", start_once_broken)
    broken = queue.submit(_module("first", sleepy), {"x": 1})
    good = queue.submit(_module("second", sleepy), {"x": 2})
    assert broken.done_event.wait(30) and good.done_event.wait(30)
    assert broken.status == "failed" and "no processes left" in broken.error
    assert good.status == "done"
