"""Every bad command line ends as one `k3serve: error:` line naming the flag, exit code 2, no traceback, and
nothing written; every option has help that shows its default; `-v` goes before or after the subcommand."""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3serve.cli.main import build_parser, main
from k3serve.cli.args import HelpFormatter, walk_parsers

FILE = "@file"  # replaced by a path to an existing regular file
UNDER_FILE = "@file/x.out"  # a path whose parent is a file: never writable, even as root
MISSING = "@missing"  # a path that does not exist

# (argv, fragment the message must hold): every subcommand, each kind of bad value
BAD_ARGUMENTS = [
    (["generate", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "--prompt", "x", "--max-tokens", "many"], "--max-tokens"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["generate", "--prompt", "x", "--temperature", "nan"], "--temperature"),
    (["generate", "--prompt", "x", "--top-p", "0"], "--top-p"),
    (["generate", "--prompt", "x", "--top-p", "1.5"], "--top-p"),
    (["generate", "--prompt", "x", "--top-k", "-1"], "--top-k"),
    (["generate", "--prompt", "x", "--seed", "-3"], "--seed"),
    (["generate", "--prompt-ids", ""], "--prompt-ids"),
    (["generate", "--prompt-ids", "1,a"], "--prompt-ids"),
    (["generate", "--prompt-ids", "1,-2"], "--prompt-ids"),
    (["generate", "--prompt", "x", "--prompt-ids", "1"], "--prompt-ids"),
    (["generate"], "--prompt"),
    (["generate", "--prompt", "x", "--num-draft-tokens", "0"], "--num-draft-tokens"),
    (["generate", "--prompt", "x", "--speculative", "bogus"], "--speculative"),
    (["generate", "--prompt", "x", "--draft-model", MISSING], "--draft-model"),
    (["generate", "--prompt", "x", "--speculative", "model"], "--draft-model"),
    (["generate", "--prompt", "x", "--queue-depth", "0"], "--queue-depth"),
    (["generate", "--prompt", "x", "--ram-budget", "lots"], "--ram-budget"),
    (["generate", "--prompt", "x", "--pin-trunk", "2X"], "--pin-trunk"),
    (["generate", "--prompt", "x", "--prefetch-max", "-1"], "--prefetch-max"),
    (["generate", "--prompt", "x", "--trace-out", UNDER_FILE], "--trace-out"),
    (["generate", "--prompt", "x", "--model", MISSING], "does not exist"),
    (["generate", "--prompt", "x", "--bogus"], "--bogus"),
    (["logits", "--ids", "", "--out", "x.npy"], "--ids"),
    (["logits", "--ids", "1,2", "--out", UNDER_FILE], "--out"),
    (["logits", "--ids", "1,2", "--out", "."], "--out"),
    (["logits", "--ids", "1,2", "--out", "x.npy", "--mode", "half"], "--mode"),
    (["make-tiny", FILE], "out"),
    (["make-tiny", UNDER_FILE], "out"),
    (["make-tiny", "t", "--seed", "-1"], "--seed"),
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--port", "0"], "--port"),
    (["serve", "--port", "http"], "--port"),
    (["serve", "--max-seqs", "0"], "--max-seqs"),
    (["serve", "--max-model-len", "-1"], "--max-model-len"),
    (["serve", "--max-batch-tokens", "0"], "--max-batch-tokens"),
    (["serve", "--block-size", "0"], "--block-size"),
    (["serve", "--kv-cache-mib", "0"], "--kv-cache-mib"),
    (["serve", "--draft-model", MISSING], "--draft-model"),
    (["serve", "--host", "no such host.invalid", "--port", "8123"], "--host"),
    (["pack", MISSING, "out", "--layout", "random"], "--layout"),
    (["pack", "@src", "@src"], "source"),
    (["pack", MISSING, FILE], "out"),
    (["sim", "cache", FILE, "--capacity", "0"], "--capacity"),
    (["sim", "cache", FILE, "--capacity", "-3"], "--capacity"),
    (["sim", "cache", FILE, "--capacity", "lots"], "--capacity"),
    (["sim", "cache", FILE, "--capacity", "4", "--policies", "foo"], "--policies"),
    (["sim", "cache", FILE, "--capacity", "4", "--json", UNDER_FILE], "--json"),
    (["sim", "cache", MISSING, "--capacity", "4"], "trace"),
    (["sim"], "sim_command"),
    (["coactivation", FILE, "--out", FILE], "--out"),
    (["coactivation", MISSING, "--out", "maps"], "trace"),
    (["routing-stats", "--tokens", "1"], "--tokens"),
    (["routing-stats", "--window", "0"], "--window"),
    (["routing-stats", "--json", UNDER_FILE], "--json"),
    (["routing-stats", "--heldout", "poetry"], "--heldout"),
    (["spec-storage", "--max-window", "0"], "--max-window"),
    (["info", "--model", MISSING], "no config.json"),
    (["lab", "--port", "70000"], "--port"),
    (["lab", "run", "anatomy", "--json", UNDER_FILE], "--json"),
    (["lab", "run", "no-such-module"], "no-such-module"),
    (["nonsense"], "nonsense"),
    ([], "command"),
]


def _resolve(argv: list[str], tmp_path: Path) -> list[str]:
    file = tmp_path / "a-file"
    file.write_text("not a trace\n")
    (tmp_path / "src").mkdir(exist_ok=True)
    names = {FILE: str(file), UNDER_FILE: str(file / "x.out"), MISSING: str(tmp_path / "missing"),
             "@src": str(tmp_path / "src")}
    return [names.get(a, a) for a in argv]


@pytest.mark.parametrize("argv,fragment", BAD_ARGUMENTS, ids=[" ".join(a[:3]) or "none" for a, _ in BAD_ARGUMENTS])
def test_every_bad_argument_is_one_error_line_with_exit_code_2(argv, fragment, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = _resolve(argv, tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own exit
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3serve: error: "), err
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err and not out
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, "an error wrote files"


def _all_options():
    for parser in walk_parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            yield parser, action


def test_every_option_has_help_that_shows_its_default():
    formatter = HelpFormatter("k3serve")
    missing_help, missing_default = [], []
    for parser, action in _all_options():
        name = f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
        if not action.help:
            missing_help.append(name)
            continue
        takes_value = action.nargs != 0 and action.option_strings
        exclusive = any(action in group._group_actions for group in parser._mutually_exclusive_groups)
        if takes_value and not action.required and not exclusive:
            text = formatter._get_help_string(action) % {**vars(action), "default": action.default}
            if "default" not in text.lower():
                missing_default.append(name)
    assert not missing_help, f"options without help: {missing_help}"
    assert not missing_default, f"options whose help does not show the default: {missing_default}"


def test_verbose_goes_before_or_after_the_subcommand():
    parser = build_parser()
    assert parser.parse_args(["-v", "info"]).verbose
    assert parser.parse_args(["info", "-v"]).verbose
    assert parser.parse_args(["sim", "cache", "t", "--capacity", "4", "--verbose"]).verbose
    assert not parser.parse_args(["info"]).verbose


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "k3serve.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def test_a_busy_port_exits_2_before_announcing_or_loading(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        started = time.time()
        result = subprocess.run([sys.executable, "-m", "k3serve.cli", "serve", "--port", str(port),
                                 "--model", str(tmp_path / "missing")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3serve: error: cannot listen on"), result.stderr
    assert "--port" in lines[0] and "serving" not in result.stderr
    assert time.time() - started < 30


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a test run in the background inherits SIGINT ignored


def test_ctrl_c_during_generate_is_one_line_and_exit_130():
    process = _cli("generate", "--prompt", "def main():", "--max-tokens", "4000", "--ignore-eos",
                   preexec_fn=_default_sigint)
    try:
        # generation has started: text comes out. The window only guards against a hang: on a fresh clone the
        # process compiles K3's kernels first (~45 s cold on 2 cores, 2026-12-07; ~100 s with every kernel).
        ready, _, _ = select.select([process.stdout], [], [], 240)
        assert ready and os.read(process.stdout.fileno(), 1), "generate printed nothing"
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1] == "k3serve: error: interrupted" and "Traceback" not in err


def test_pack_refuses_its_source_as_output_and_another_models_trace(tiny_dir, tmp_path, capsys):
    before = sorted(p.name for p in tiny_dir.iterdir())
    assert main(["pack", str(tiny_dir), str(tiny_dir)]) == 2
    assert "source checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in tiny_dir.iterdir()) == before, "pack wrote into its source"

    other = tmp_path / "other.trace"  # a trace of a model with another expert count
    meta = {"num_layers": 13, "num_experts": 64, "top_k": 4, "moe_layers": [3], "hidden_size": 64,
            "vocab_size": 256, "expert_bytes": 1}
    other.write_text("# k3serve-trace 1 " + json.dumps(meta) + "\n0 0 3 1 2 3 4\n")
    out = tmp_path / "packed"
    assert main(["pack", str(tiny_dir), str(out), "--layout", "frequency", "--trace", str(other)]) == 2
    err = capsys.readouterr().err
    assert "--trace" in err and "another model" in err and "num_experts" in err
    assert not out.exists(), "pack wrote before checking the trace"


def test_a_lone_surrogate_prompt_names_its_position(capsys):
    assert main(["generate", "--prompt", "abc d\udcffe", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "at character 5" in err and err.count("\n") == 1


def test_a_prompt_that_does_not_fit_names_the_flag(capsys):
    assert main(["generate", "--prompt-ids", "1,2,3", "--max-tokens", "1000000"]) == 2
    err = capsys.readouterr().err
    assert "--max-tokens asks for 1000000 more" in err and err.count("\n") == 1
