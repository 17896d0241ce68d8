"""The interrupt policy (cli/interrupts.py), on the command line as a user meets it: the first SIGINT or SIGTERM
drains a server (exit 0) or stops a command (130 / 143), a second exits at once in one line, and a Ctrl-C while
the command is still importing is one line too."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest


def _default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a test run in the background inherits SIGINT ignored


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "k3serve.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_answering(process: subprocess.Popen, url: str) -> None:
    """Poll `url` until the server answers (its signal handlers are in place once it serves)."""
    import time

    for _ in range(1200):
        assert process.poll() is None, process.communicate()[1]
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


def _wait_until_refused(port: int) -> None:
    """Wait until the listener is closed: the drain has begun."""
    import time

    for _ in range(2400):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except ConnectionRefusedError:
            return
        time.sleep(0.05)
    raise AssertionError("the listener never closed")


def _finish(process: subprocess.Popen) -> str:
    try:
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return err


@pytest.mark.parametrize("command,path,signum", [
    (["serve", "--no-lab"], "/health", signal.SIGINT),
    (["lab"], "/lab/", signal.SIGTERM),
    (["lab"], "/lab/", signal.SIGINT),
])
def test_the_first_signal_drains_a_server_and_it_exits_0(command, path, signum):
    port = _free_port()
    process = _cli(*command, "--port", str(port))
    _wait_until_answering(process, f"http://127.0.0.1:{port}{path}")
    process.send_signal(signum)
    err = _finish(process)
    assert process.returncode == 0, err
    assert "shut down" in err and "Traceback" not in err


def test_a_second_signal_during_a_drain_exits_at_once_in_one_line():
    port = _free_port()
    process = _cli("serve", "--no-lab", "--port", str(port), "--shutdown-timeout", "300")
    _wait_until_answering(process, f"http://127.0.0.1:{port}/health")
    first_chunk = threading.Event()

    def stream() -> None:  # a long reply in flight: the drain waits for it
        body = {"model": "k3-trained-default", "prompt": "def f(x):", "max_tokens": 3000, "stream": True,
                "ignore_eos": True}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                for _ in response:
                    first_chunk.set()
        except OSError:
            pass  # the server went away: that is the point
        first_chunk.set()

    threading.Thread(target=stream, daemon=True).start()
    assert first_chunk.wait(120), "the stream never started"
    process.send_signal(signal.SIGINT)  # drain: the listener closes, the stream goes on (up to 300 s)
    _wait_until_refused(port)
    process.send_signal(signal.SIGINT)  # and the impatient second Ctrl-C
    err = _finish(process)
    assert process.returncode == 130, err
    assert err.splitlines()[-1] == "k3serve: interrupted again: exiting now (SIGINT)"
    assert "Traceback" not in err and len(err.splitlines()) == 2, err  # the "serving" line and this one


def test_sigterm_stops_a_command_in_one_line_and_exit_143():
    import os
    import select

    process = _cli("generate", "--prompt", "def main():", "--max-tokens", "4000", "--ignore-eos")
    ready, _, _ = select.select([process.stdout], [], [], 120)  # generation has started: text comes out
    assert ready and os.read(process.stdout.fileno(), 1), "generate printed nothing"
    process.send_signal(signal.SIGTERM)
    err = _finish(process)
    assert process.returncode == 143, err
    assert err.strip().splitlines()[-1] == "k3serve: error: terminated (SIGTERM)" and "Traceback" not in err


# the child: Ctrl-C arrives while the command module (numpy, the model code) is being imported
_CTRL_C_WHILE_IMPORTING = """
import os, runpy, signal, sys

class CtrlCOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == "k3serve.cli.main":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCOnImport())
sys.argv = ["k3serve", "info"]
runpy.run_module("k3serve.cli", run_name="__main__")
"""


def test_ctrl_c_while_the_command_is_importing_is_one_line_and_exit_130():
    result = subprocess.run([sys.executable, "-c", _CTRL_C_WHILE_IMPORTING], capture_output=True, text=True,
                            timeout=120, preexec_fn=_default_signals)
    assert result.returncode == 130, result.stderr
    assert result.stderr == "k3serve: interrupted: exiting now (SIGINT)\n"
