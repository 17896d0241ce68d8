"""What the README and docs/ say about the command line, checked against the command line itself: the flags of the
README's command summary, the embedded model's size, and the messages docs/RELIABILITY.md quotes."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import k3serve
from k3serve.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _commands_block() -> list[str]:
    """The README's `## Commands` code block, one command per entry (continuation lines joined)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands: list[str] = []
    for line in block.splitlines():
        line = line.split("#", 1)[0].rstrip()
        if line.startswith("k3serve "):
            commands.append(line)
        elif line.strip() and commands:
            commands[-1] += " " + line.strip()
    return commands


def _subparser(words: list[str]) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in words:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers or word not in subparsers[0].choices:
            break
        parser = subparsers[0].choices[word]
    return parser


def _unbracketed(line: str) -> str:
    """The line without its [optional] parts (nested brackets included)."""
    while True:
        stripped = re.sub(r"\[[^\[\]]*\]", "", line)
        if stripped == line:
            return line
        line = stripped


def test_the_readme_command_summary_shows_real_flags_and_which_are_required():
    commands = _commands_block()
    assert len(commands) >= 10
    forms: dict[str, int] = {}
    for line in commands:
        forms[line.split()[1]] = forms.get(line.split()[1], 0) + 1
    for line in commands:
        words = line.split()[1:]
        parser = _subparser([w for w in words if not w.startswith("-")][:2])
        # a command shown in several forms (`cluster --replicas N`, `cluster --expert-parallel N`) names each form's
        # mode by its first flag: that one may be optional
        mode_flag = next((w for w in words if w.startswith("--")), None) if forms[words[0]] > 1 else None
        options = {flag: action for action in parser._actions for flag in action.option_strings}
        shown = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line))
        unknown = shown - set(options) - {"--param"}  # `lab run MODULE --param k=v` is shown on the `lab` line
        assert not unknown, f"README shows {sorted(unknown)} that `{' '.join(words[:2])}` does not take: {line}"
        outside = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", _unbracketed(line))) & set(options)
        for flag in outside - {mode_flag}:  # unbracketed: the command needs it (or one of a required group)
            action = options[flag]
            in_required_group = any(action in group._group_actions and group.required
                                    for group in parser._mutually_exclusive_groups)
            assert action.required or in_required_group, f"README shows {flag} as required, it is optional: {line}"


def test_the_embedded_models_size_in_the_docs_is_its_files_size():
    folder = Path(k3serve.__file__).parent / "assets" / "default_model"
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    said = (ROOT / "docs" / "MODEL.md").read_text()
    assert f"its files hold {total:,} bytes = {total / 1e6:.1f} MB = {total / 2**20:.1f} MiB" in " ".join(said.split())
    assert f"{total / 1e6:.1f} MB = {total / 2**20:.1f} MiB of files" in (ROOT / "README.md").read_text()


def test_reliability_quotes_the_real_truncated_store_message(tiny_store, tmp_path, capsys):
    import os
    import shutil

    store = tmp_path / "store"
    shutil.copytree(tiny_store.path, store)
    experts = store / "experts.bin"
    os.truncate(experts, experts.stat().st_size // 2)
    assert main(["logits", "--model", str(store), "--ids", "1", "--out", str(tmp_path / "l.npy")]) == 2
    message = capsys.readouterr().err.strip().removeprefix("k3serve: error: ").replace(str(store), "DIR")
    assert f'"{message}"' in (ROOT / "docs" / "RELIABILITY.md").read_text()
