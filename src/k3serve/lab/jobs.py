"""The run queue: lab runs one at a time (a CPU machine measures one thing at a time), in arrival order.

`submit(module, params)` validates the parameters and returns a `Job`: at once finished when the same module ran
with the same parameters before (the cached result; `rerun=True` measures again), the job already queued or running
with those parameters, or a new job at the end of the queue (`LabQueueFull` when `max_queued` jobs wait already).
One dispatcher thread takes jobs in order and runs each in the lab's worker process (`lab/worker.py`), which keeps
the model loaded between runs. A job reports its progress, can be cancelled while queued (it never starts) or
running (the run stops at its next `cancel.check()`, or its worker process is killed within about a second), and
ends done, failed (the error message kept; a run past `LabQueueConfig.max_run_seconds` fails) or cancelled.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Literal

from k3serve.errors import ConfigError, K3Error
from k3serve.lab.fixtures import LabFixtures
from k3serve.lab.registry import CancelToken, LabModule
from k3serve.lab.worker import LabWorker, RunOutcome, StopReason

logger = logging.getLogger(__name__)

JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]
MAX_KEPT_JOBS = 256  # finished jobs kept for polling; the oldest go first
MAX_CACHED_RESULTS = 256  # results kept for identical parameters; the least recently asked go first


@dataclass(frozen=True)
class LabQueueConfig:
    max_run_seconds: float = 300.0  # a run still going after this is stopped and fails (defaults take ~10 s)
    max_queued: int = 16  # jobs waiting behind the running one; one more is refused (HTTP 429)

    def __post_init__(self) -> None:
        if not self.max_run_seconds > 0:
            raise ConfigError(f"max_run_seconds must be > 0, got {self.max_run_seconds}")
        if self.max_queued < 1:
            raise ConfigError(f"max_queued must be >= 1, got {self.max_queued}")


class LabQueueFull(K3Error):
    """The run queue holds `max_queued` jobs already; try again when one has run."""


@dataclass
class Job:
    id: str
    module: LabModule
    params: dict[str, Any]
    key: str
    status: JobStatus = "queued"
    progress: float = 0.0
    message: str = "queued"
    result: dict | None = None
    error: str | None = None
    cached: bool = False
    cancel: CancelToken = field(default_factory=CancelToken)
    created: float = field(default_factory=time.time)
    done_event: threading.Event = field(default_factory=threading.Event)

    @property
    def finished(self) -> bool:
        return self.status in ("done", "failed", "cancelled")


class RunQueue:
    def __init__(self, fixtures: LabFixtures, config: LabQueueConfig | None = None) -> None:
        self.fixtures = fixtures
        self.config = config if config is not None else LabQueueConfig()
        self.worker = LabWorker(fixtures)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[Job] = deque()
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._results: OrderedDict[str, dict] = OrderedDict()  # key -> result record, least recently used first
        self._active: dict[str, Job] = {}  # key -> queued or running job
        self._latest: dict[str, dict] = {}  # module id -> its latest finished run's record (the overview's figure)
        self._running: Job | None = None
        self._closed = False
        self._dispatcher = threading.Thread(target=self._work, name="k3lab-dispatcher", daemon=True)
        self._dispatcher.start()

    # ---- the API's side -------------------------------------------------------------------------------------
    def submit(self, module: LabModule, raw_params: dict[str, Any] | None, rerun: bool = False) -> Job:
        params = module.validate(raw_params, self.fixtures)  # LabParamError before anything is queued
        key = module.id + ":" + json.dumps(params, sort_keys=True)
        with self._lock:
            if self._closed:
                raise RuntimeError("the lab's run queue is closed")
            if not rerun and key in self._results:
                self._results.move_to_end(key)
                job = self._new_job(module, params, key)
                job.status, job.progress, job.message, job.cached = "done", 1.0, "cached result", True
                job.result = self._results[key]
                job.done_event.set()
                return job
            if key in self._active:
                return self._active[key]
            if len(self._queue) >= self.config.max_queued:
                raise LabQueueFull(f"the lab's run queue is full ({len(self._queue)} jobs waiting); try again when "
                                   "one has run, or cancel one")
            job = self._new_job(module, params, key)
            self._active[key] = job
            self._queue.append(job)
            self._wake.notify()
            return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def position(self, job: Job) -> int:
        """0 while running (or finished), 1 for the next to run, and so on."""
        with self._lock:
            try:
                return self._queue.index(job) + 1
            except ValueError:
                return 0

    def cancel(self, job_id: str) -> Job | None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.finished:
                return job
            job.cancel.cancel()
            if job.status == "queued":
                self._queue.remove(job)
                self._active.pop(job.key, None)
                self._finish(job, "cancelled", "cancelled before it started")
            return job

    def latest(self) -> dict[str, dict]:
        """Each module's latest finished run on this queue (any parameters), by module id."""
        with self._lock:
            return dict(self._latest)

    def snapshot(self, job: Job) -> dict:
        with self._lock:
            return self._snapshot(job)

    def active(self) -> list[dict]:
        """The running job, then the queued ones in order (what a page that was reloaded needs to re-attach)."""
        with self._lock:
            running = [self._running] if self._running is not None and not self._running.finished else []
            return [self._snapshot(job) for job in running + list(self._queue)]

    def _snapshot(self, job: Job) -> dict:
        position = self._queue.index(job) + 1 if job in self._queue else 0
        body = {"job_id": job.id, "module": job.module.id, "params": job.params, "status": job.status,
                "position": position, "progress": round(job.progress, 4), "message": job.message,
                "cached": job.cached}
        if job.result is not None:
            body["result"] = job.result
        if job.error is not None:
            body["error"] = job.error
        return body

    def close(self, timeout: float = 5.0) -> None:
        """Cancel everything, stop the running job and the worker process."""
        with self._lock:
            self._closed = True
            for job in list(self._queue):
                job.cancel.cancel()
                self._finish(job, "cancelled", "the lab is shutting down")
            self._queue.clear()
            if self._running is not None:
                self._running.cancel.cancel()
            self._wake.notify_all()
        self._dispatcher.join(timeout)
        self.worker.close()

    # ---- the dispatcher--------------------------------------------------------------------------------------
    def _new_job(self, module: LabModule, params: dict[str, Any], key: str) -> Job:
        job = Job(id=uuid.uuid4().hex[:12], module=module, params=params, key=key)
        self._jobs[job.id] = job
        while len(self._jobs) > MAX_KEPT_JOBS:
            oldest = next(iter(self._jobs.values()))
            if not oldest.finished:
                break
            self._jobs.popitem(last=False)
        return job

    def _finish(self, job: Job, status: JobStatus, message: str) -> None:
        job.status, job.message = status, message
        if status == "done":
            job.progress = 1.0
        job.done_event.set()

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                job.status, job.message = "running", "starting"
                self._running = job
            self._run(job)
            with self._lock:
                self._running = None
                self._active.pop(job.key, None)

    def _stop_reason(self, job: Job) -> StopReason | None:
        if self._closed:
            return "shutdown"
        return "cancelled" if job.cancel.cancelled else None

    def _run(self, job: Job) -> None:
        def progress(fraction: float, message: str) -> None:
            with self._lock:
                job.progress = min(max(float(fraction), 0.0), 1.0)
                job.message = message

        started = time.perf_counter()
        try:
            outcome: RunOutcome = self.worker.run(job.module, job.params, progress,
                                                  lambda: self._stop_reason(job), self.config.max_run_seconds)
        except Exception as exc:  # e.g. the worker process cannot start: fail this job, keep the queue going
            logger.exception("the lab's worker failed to run %s", job.module.id)
            self.worker.close()
            outcome = RunOutcome("failed", error=f"the lab's worker process failed: {type(exc).__name__}: {exc}")
        seconds = time.perf_counter() - started
        with self._lock:
            if outcome.status == "done":
                record = outcome.record
                job.result = record
                self._results[job.key] = record
                self._latest[job.module.id] = record
                self._results.move_to_end(job.key)
                while len(self._results) > MAX_CACHED_RESULTS:
                    self._results.popitem(last=False)
                self._finish(job, "done", f"done in {record['seconds']:.1f} s")
            elif outcome.status == "failed":
                job.error = outcome.error
                self._finish(job, "failed", "failed")
            elif outcome.stop_reason == "shutdown":
                self._finish(job, "cancelled", "the lab is shutting down")
            else:
                self._finish(job, "cancelled", f"cancelled after {seconds:.1f} s")
