"""`k3serve serve` as a child process of a lab run, on a free loopback port, stopped on every path.

A run can end four ways: it finishes, it raises, it is cancelled at a `cancel.check()`, or the lab's worker process
is killed (Cancel or the time limit when the run does not answer in time: SIGTERM, then SIGKILL). The first three
leave through `ServerProcess.stop()` (a context manager's exit); the fourth runs no Python at all, so the child is
tied to its parent by the kernel: it starts by asking for SIGKILL when its parent dies (Linux's
PR_SET_PDEATHSIG, set by the child itself before it imports anything heavy, so no `preexec_fn` runs in a process
with threads), and it checks its parent is still the one that started it, closing the window between fork and that
call. (Linux sends that signal when the *thread* that started the child ends: a lab run executes on its worker's
main thread.) The server runs in a process group of its own, and `stop()` / `stop_all()` signal the group: SIGTERM,
then SIGKILL after `STOP_WAIT_SECONDS`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from k3serve.errors import K3Error

STOP_WAIT_SECONDS = 0.5  # SIGTERM, then SIGKILL: within the lab worker's 0.8 s grace after a cancel (worker.py)
READY_POLL_SECONDS = 0.1

# The child's first lines: die with the parent, then run the `k3serve` entry point with the given arguments.
_BOOT = r"""
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
try:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
except AttributeError:  # not Linux: stop() still covers every end but a killed parent
    pass
if os.getppid() != int(sys.argv[1]):  # the parent died before prctl: nobody would stop us
    sys.exit(1)
sys.argv = ["k3serve"] + sys.argv[2:]
from k3serve.cli.entry import main
sys.exit(main())
"""


class ServerStartError(K3Error):
    """The server did not answer /health in time, or exited first; the message carries its last log lines."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's choice for port 0). Another process may take it before the
    server binds it: `ServerProcess.start` then fails with the server's own message."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class ServerProcess:
    """One `k3serve serve` child. `args` are the serve flags after `serve` (the port and host are added):

        with ServerProcess(["--scheduling", "fair"], cancel=cancel) as server:
            client = openai.OpenAI(base_url=server.base_url, api_key="...")
    """

    def __init__(self, args: list[str], cancel=None, ready_timeout_s: float = 120.0,
                 env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.cancel = cancel
        self.ready_timeout_s = ready_timeout_s
        self.env = env
        self.host = "127.0.0.1"
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self.start_seconds: float | None = None  # from the spawn to the first healthy answer
        self._log = None
        self._launched = 0.0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def command(self) -> list[str]:
        return [sys.executable, "-c", _BOOT, str(os.getpid()), "serve", "--host", self.host, "--port",
                str(self.port), "--no-lab", "--shutdown-timeout", "1", *self.args]

    def start(self) -> "ServerProcess":
        """Launch and wait until /health answers (on failure the server is stopped and the error raised)."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> "ServerProcess":
        """Spawn the server without waiting for it (start several at once, then `wait_ready` each)."""
        self.port = free_port(self.host)
        self._log = tempfile.TemporaryFile(prefix="k3lab-serve-")
        env = {**os.environ, **(self.env or {})}
        src = str(Path(__file__).resolve().parents[2])  # the k3serve this process runs, also in a source tree
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._launched = time.perf_counter()
        self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def wait_ready(self) -> "ServerProcess":
        try:
            self._wait_ready(self._launched)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - self._launched
        return self

    def _wait_ready(self, started: float) -> None:
        url = f"http://{self.host}:{self.port}/health"
        while True:
            if self.cancel is not None:
                self.cancel.check()
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(f"k3serve serve exited with code {code} before it answered: {self.log_tail()}")
            if time.perf_counter() - started > self.ready_timeout_s:
                raise ServerStartError(f"k3serve serve did not answer {url} within {self.ready_timeout_s:g} s: "
                                       f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(READY_POLL_SECONDS)

    def log_tail(self, num_chars: int = 1500) -> str:
        if self._log is None or self._log.closed:
            return "(no log)"
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - num_chars))
        return self._log.read().decode("utf-8", "replace").strip() or "(no output)"

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def stop(self) -> int | None:
        """SIGTERM to the server's process group, SIGKILL after STOP_WAIT_SECONDS; returns its exit code."""
        stop_all([self])
        return None if self.process is None else self.process.returncode

    def _terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self._signal_group(signal.SIGTERM)

    def _reap(self, deadline: float) -> None:
        process = self.process
        if process is None:
            return
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            process.wait()
        self._signal_group(signal.SIGKILL)  # anything the server started in its group
        if self._log is not None and not self._log.closed:
            self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_all(servers: list[ServerProcess]) -> None:
    """Stop several servers at once: SIGTERM to every group first, then one shared STOP_WAIT_SECONDS before SIGKILL
    (a cancelled run has 0.8 s before the lab kills its worker; the servers would then die by PR_SET_PDEATHSIG)."""
    for server in servers:
        server._terminate()
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    for server in servers:
        server._reap(deadline)
