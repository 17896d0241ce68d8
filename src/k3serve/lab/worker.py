"""The process a lab run executes in, so that a run can always be stopped: a module that never reaches its next
`cancel.check()` (a long simulation, a numba kernel) is killed with its process, and the queue moves on.

One worker process serves the run queue, one run at a time, and lives across runs: its `LabFixtures` load the model
(and numba compiles or loads its kernels) on first use and keep them, so the second run pays none of that. The
process is started with the 'spawn' method (the server runs threads, and forking a process with threads is
unsafe). Spawning imports the parent's main module in the worker, so a script that starts the lab must keep its
top-level code under `if __name__ == "__main__":` (the `k3serve` command does). Parent and worker talk over one pipe:

    parent -> worker   (module, params)                 run this; None: exit
    worker -> parent   ("progress", fraction, message)  any number of times during a run
                       ("done", record) | ("failed", error) | ("cancelled",)   once, at the end of a run

To stop a run (Cancel, the time limit, shutdown) the parent sets a shared event, which the module's `CancelToken`
reads. If the worker does not answer within `STOP_GRACE_SECONDS` it is terminated (then killed), and the next run
starts a fresh one.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from k3serve.lab.registry import CancelToken, LabModule, RunCancelled, result_json

logger = logging.getLogger(__name__)

CONTEXT = multiprocessing.get_context("spawn")
POLL_SECONDS = 0.05  # how often the parent looks at Cancel and the time limit while a run is going
STOP_GRACE_SECONDS = 0.8  # a stopped run may end at its next cancel.check() within this; then the process goes
KILL_WAIT_SECONDS = 0.5  # after SIGTERM, before SIGKILL

StopReason = Literal["cancelled", "time limit", "shutdown"]


@dataclass(frozen=True)
class RunOutcome:
    status: Literal["done", "failed", "cancelled"]
    record: dict | None = None  # the run record (status done)
    error: str | None = None  # what went wrong (status failed)
    stop_reason: StopReason | None = None  # why it was stopped, if it was
    worker_replaced: bool = False  # the worker was killed (or died) during this run


def _serve(conn, cancel_event, fixtures) -> None:
    """The worker's loop. `fixtures` are built once here and shared by every run this process makes."""
    cancel = CancelToken(cancel_event)
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        except Exception as exc:  # noqa: BLE001 - e.g. a module that cannot be imported here
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            continue
        if message is None:
            return
        module, params = message
        started = time.perf_counter()

        def progress(fraction: float, text: str) -> None:
            conn.send(("progress", float(fraction), str(text)))

        try:
            cancel.check()
            result = module.run(params, progress, cancel, fixtures)
            record = result_json(module, params, result, time.perf_counter() - started, fixtures.model_arg)
        except RunCancelled:
            conn.send(("cancelled",))
            continue
        except Exception as exc:  # one module's failure is reported on its job, never the server's
            logger.exception("lab module %s failed", module.id)
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("done", record))


class LabWorker:
    """The parent's handle on the worker process: `run` one module and wait for it, `close` at the end."""

    def __init__(self, fixtures: Any) -> None:
        self.fixtures = fixtures  # pickled into the worker (LabFixtures travel as their folders, unloaded)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn = None
        self._cancel = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None and self._process.is_alive() else None

    def _start(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        self._discard()
        parent_end, child_end = CONTEXT.Pipe()
        self._cancel = CONTEXT.Event()
        self._process = CONTEXT.Process(target=_serve, args=(child_end, self._cancel, self.fixtures),
                                        name="k3lab-worker", daemon=True)
        self._process.start()
        child_end.close()
        self._conn = parent_end

    def run(self, module: LabModule, params: dict[str, Any], on_progress: Callable[[float, str], None],
            should_stop: Callable[[], StopReason | None], time_limit: float) -> RunOutcome:
        """Run `module` in the worker; `should_stop()` is asked every POLL_SECONDS; past `time_limit` seconds the run
        is stopped as for Cancel and fails."""
        self._start()
        self._cancel.clear()
        try:
            self._conn.send((module, params))
        except Exception as exc:  # noqa: BLE001 - e.g. a module whose run function cannot be pickled
            return RunOutcome("failed", error=f"cannot send the run to the worker: {type(exc).__name__}: {exc}")
        deadline = time.monotonic() + time_limit
        while True:
            reason = should_stop()
            if reason is None and time.monotonic() > deadline:
                reason = "time limit"
            if reason is not None:
                return self._stop(reason, time_limit)
            if not self._conn.poll(POLL_SECONDS):
                continue
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                return self._died()
            if message[0] == "progress":
                on_progress(message[1], message[2])
                continue
            return self._outcome(message)

    def _outcome(self, message: tuple, reason: StopReason | None = None, time_limit: float = 0.0) -> RunOutcome:
        kind = message[0]
        if kind == "done":
            return RunOutcome("done", record=message[1])
        if kind == "failed":
            return RunOutcome("failed", error=message[1])
        if reason == "time limit":
            return RunOutcome("failed", error=f"the run passed the time limit of {time_limit:g} s and was stopped",
                              stop_reason=reason)
        return RunOutcome("cancelled", stop_reason=reason)

    def _stop(self, reason: StopReason, time_limit: float) -> RunOutcome:
        """Ask the run to stop at its next check; kill the worker if it has not within STOP_GRACE_SECONDS."""
        self._cancel.set()
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while (left := deadline - time.monotonic()) > 0:
            if not self._conn.poll(left):
                break
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] != "progress":
                return self._outcome(message, reason, time_limit)
        self._kill()
        outcome = self._outcome(("cancelled",), reason, time_limit)
        return RunOutcome(outcome.status, error=outcome.error, stop_reason=reason, worker_replaced=True)

    def _died(self) -> RunOutcome:
        code = None
        if self._process is not None:
            self._process.join(KILL_WAIT_SECONDS)  # its pipe closed first: let it finish exiting
            code = self._process.exitcode
        self._kill()
        return RunOutcome("failed", error=f"the worker process died (exit code {code})", worker_replaced=True)

    def _kill(self) -> None:
        process = self._process
        if process is not None and process.is_alive():
            process.terminate()
            process.join(KILL_WAIT_SECONDS)
            if process.is_alive():
                process.kill()
                process.join(KILL_WAIT_SECONDS)
        self._discard()

    def _discard(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

    def close(self, timeout: float = 2.0) -> None:
        """Let an idle worker exit; kill one that does not."""
        process = self._process
        if process is None:
            return
        if process.is_alive():
            try:
                self._conn.send(None)
            except (OSError, ValueError):
                pass
            process.join(timeout)
        self._kill()
