"""`k3serve cluster` refuses bad input before Ray or any model starts; the runtime without the extra has no Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _http_server import free_port

from k3serve.cli.main import main


@pytest.mark.parametrize("args, message", [
    (["--ray-address", "127.0.0.1:1"], "cannot reach the Ray cluster at 127.0.0.1:1"),
    (["--ray-address", "no-port"], "--ray-address must be HOST:PORT"),
    (["--replicas", "3", "--num-cpus", "2"], "--replicas 3 needs 3 CPUs"),
    (["--model", "/nonexistent/model"], "/nonexistent/model does not exist"),
    (["--trace-out", "/tmp/k3-cluster-trace.bin"], "--trace-out is per process"),
    (["--expert-top-p", "0.7"], "--expert-top-p is not carried to cluster replicas"),
    (["--expert-parallel", "3"], "3 shards do not divide the model's 64 experts"),
    (["--expert-parallel", "2", "--replicas", "2"], "--replicas does not combine with --expert-parallel"),
    (["--expert-parallel", "2", "--expert-shards", "/data/shard"], "--expert-shards needs {i}"),
    (["--expert-ram-budget", "64M"], "go with --expert-parallel N"),
])
def test_bad_input_is_one_error_line_and_exit_2(args, message, capsys):
    assert main(["cluster", "--port", str(free_port()), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3serve: error: ") and message in err, err


def test_an_unknown_router_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["cluster", "--router", "random"])
    assert exit_info.value.code == 2 and "--router" in capsys.readouterr().err


def test_the_runtime_without_the_extra_imports_no_ray():
    code = ("import sys, k3serve.cli.main, k3serve.serve.api, k3serve.cli.cluster, k3serve.cluster.router; "
            "k3serve.cli.main.build_parser(); print('ray' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
