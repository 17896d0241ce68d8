"""One interrupt policy for every command (docs/RELIABILITY.md, "Interrupts and exit codes"):

- the first SIGINT (Ctrl-C) or SIGTERM asks the command to stop cleanly: a server (`serve`, `cluster`, `lab`)
  closes its listener and drains its in-flight requests, then exits 0; any other command stops where it is,
  removes its half-written outputs, prints `k3serve: error: interrupted` and exits 130 (SIGINT) or 143 (SIGTERM);
- a second signal ends the process at once, whatever it is doing, with one line and exit 128 + the signal:
  no traceback from a thread, a finally block or the interpreter's shutdown.

A signal that was ignored when the process started (a background job started with SIGINT ignored, `nohup`) stays
ignored, as the shell asked."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import Iterator

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The first SIGINT or SIGTERM, raised in the main thread; `signum` gives the exit code (128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_now(signum: int, why: str = "interrupted again") -> None:
    """End the process at once with one line on stderr and exit 128 + signum (os._exit: no cleanup, no threads
    joined, nothing left to print a traceback)."""
    os.write(2, f"k3serve: {why}: exiting now ({signal.Signals(signum).name})\n".encode())
    os._exit(128 + signum)


def _early(signum: int, frame) -> None:
    exit_now(signum, "interrupted")


def install_early() -> None:
    """Before the heavy imports: a signal ends the process with one line (there is nothing to clean up yet)."""
    for signum in HANDLED:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _early)


@contextmanager
def policy() -> Iterator[None]:
    """For the length of a command: the first signal raises `Interrupted` in the main thread, the second exits
    at once. The handlers in place before are restored after (a test calling `main()` keeps its own)."""
    seen: list[int] = []

    def handle(signum: int, frame) -> None:
        if seen:
            exit_now(signum)
        seen.append(signum)
        raise Interrupted(signum)

    previous = {signum: signal.getsignal(signum) for signum in HANDLED}
    installed = [s for s in HANDLED if previous[s] is not signal.SIG_IGN] if _main_thread() else []
    for signum in installed:
        signal.signal(signum, handle)
    try:
        yield
    finally:
        for signum in installed:
            signal.signal(signum, previous[signum])


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def serve_until_signal(server, sockets) -> None:
    """Run a uvicorn server: the first SIGINT or SIGTERM drains it (uvicorn closes the listener and waits for
    in-flight requests, a DrainingServer up to --shutdown-timeout) and `run` returns, so the command exits 0; a
    second signal during the drain exits at once with one line."""

    def handle_exit(signum: int, frame) -> None:
        if server.should_exit:
            exit_now(signum)
        server.should_exit = True  # not re-raised after the run: a drained server is a clean exit

    server.handle_exit = handle_exit  # uvicorn's capture_signals installs self.handle_exit for the run
    server.run(sockets=sockets)
