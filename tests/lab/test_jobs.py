"""The run queue with stand-in modules: one run at a time in order, the result cache, cancellation, failures."""

from __future__ import annotations

import threading
import time

import pytest

from k3serve.lab.jobs import RunQueue
from k3serve.lab.registry import Figure, LabModule, LabParamError, LabResult, Param


class _Fixtures:
    model_arg = None


def _module(name: str, body) -> LabModule:
    return LabModule(id=name, number=90, title=name, summary="s", explanation="e", kind="simulated",
                     params=(Param("x", "int", 1, min=0, max=1000),), run=body)


def _result(value: float) -> LabResult:
    return LabResult({"v": value}, {"v": 0.0}, [Figure("f", "bar", False, "test", [{"name": "a", "x": [1], "y": [value]}])])


@pytest.fixture
def queue():
    q = RunQueue(_Fixtures())
    yield q
    q.close()


def test_runs_are_serialized_in_order_and_cached(queue):
    active, order, overlap = [0], [], []
    lock = threading.Lock()

    def body(params, progress, cancel, lab):
        with lock:
            active[0] += 1
            overlap.append(active[0])
        time.sleep(0.05)
        order.append(params["x"])
        with lock:
            active[0] -= 1
        return _result(params["x"])

    module = _module("serial", body)
    jobs = [queue.submit(module, {"x": i}) for i in range(4)]
    assert queue.position(jobs[3]) in (3, 4)  # behind the running one (or all four still queued)
    for job in jobs:
        assert job.done_event.wait(5)
    assert order == [0, 1, 2, 3] and max(overlap) == 1
    assert [j.result["metrics"]["v"] for j in jobs] == [0, 1, 2, 3]
    again = queue.submit(module, {"x": 2})
    assert again.cached and again.status == "done" and again.result is jobs[2].result
    fresh = queue.submit(module, {"x": 2}, rerun=True)
    assert not fresh.cached and fresh.done_event.wait(5) and order[-1] == 2


def test_identical_queued_request_joins_the_existing_job(queue):
    gate = threading.Event()
    module = _module("join", lambda p, progress, cancel, lab: (gate.wait(5), _result(1))[1])
    first = queue.submit(module, {"x": 1})
    second = queue.submit(module, {"x": 1})
    assert second is first
    gate.set()
    assert first.done_event.wait(5) and first.status == "done"


def test_cancel_stops_a_running_job_and_drops_a_queued_one(queue):
    steps = []

    def body(params, progress, cancel, lab):
        for i in range(1000):
            cancel.check()
            steps.append(i)
            progress(i / 1000, f"step {i}")
            time.sleep(0.01)
        return _result(0)

    module = _module("long", body)
    running = queue.submit(module, {"x": 1})
    queued = queue.submit(module, {"x": 2})
    while running.status != "running" or len(steps) < 3:
        time.sleep(0.01)
    queue.cancel(queued.id)
    assert queued.status == "cancelled" and queued.done_event.is_set()
    queue.cancel(running.id)
    assert running.done_event.wait(5)
    assert running.status == "cancelled" and len(steps) < 1000 and running.result is None
    count = len(steps)
    time.sleep(0.1)
    assert len(steps) == count  # nothing keeps running, and the cancelled queued job never started


def test_a_failing_module_fails_its_job_only(queue):
    def bad(params, progress, cancel, lab):
        raise ValueError("boom")

    failed = queue.submit(_module("bad", bad), {})
    good = queue.submit(_module("good", lambda p, progress, cancel, lab: _result(3)), {})
    assert failed.done_event.wait(5) and good.done_event.wait(5)
    assert failed.status == "failed" and "boom" in failed.error
    assert good.status == "done" and good.result["metrics"]["v"] == 3


def test_bad_parameters_are_refused_before_queueing(queue):
    with pytest.raises(LabParamError):
        queue.submit(_module("p", lambda *a: _result(0)), {"x": -1})


def test_the_result_cache_is_bounded(queue, monkeypatch):
    import k3serve.lab.jobs as jobs

    monkeypatch.setattr(jobs, "MAX_CACHED_RESULTS", 2)
    module = _module("bounded", lambda p, progress, cancel, lab: _result(p["x"]))
    for x in (1, 2, 3):
        assert queue.submit(module, {"x": x}).done_event.wait(5)
    assert not queue.submit(module, {"x": 1}).cached  # evicted: measured again
    assert queue.submit(module, {"x": 3}).cached
