"""Argument parsing for the `k3serve` command line: a parser whose every error is one `k3serve: error:` line with
exit code 2, a help formatter that shows every default, and the value types (ports, counts, sizes, output paths)
that check a value when it is parsed, so that an error names the flag the user typed and comes before any model
is loaded."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn

from k3serve.errors import EXIT_USER_ERROR, K3Error, UsageError


class HelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to an option's help unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text.lower() or action.required:
            return text
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS \
                or isinstance(action, argparse._StoreConstAction):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `k3serve: error: argument --port: ...` and exit code 2, no usage dump."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        hint = f" (see: {self.prog} --help)"
        sys.stderr.write(f"k3serve: error: {' '.join(message.split())}{hint}\n")
        sys.exit(EXIT_USER_ERROR)


def non_empty(text: str) -> str:
    """A name that must say something (not empty, not only spaces)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def model_path(text: str) -> Path:
    """A --model (or pack source) path: a `.gguf` name must be an existing file that starts with the GGUF magic
    (folders and stores are checked when they load)."""
    path = Path(text)
    if path.suffix.lower() == ".gguf":
        from k3serve.weights.gguf_file import check_gguf_path

        try:
            check_gguf_path(path)
        except K3Error as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return path


def add_verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """Accept `-v/--verbose` after any subcommand too (`k3serve generate -v ...`), not only before it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                sub.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                 help="log progress to stderr")
                add_verbose_everywhere(sub)


def walk_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parser and every subcommand's parser, depth first (for tests and help checks)."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += walk_parsers(sub)
    return found


# ---- value types: each raises ArgumentTypeError, which argparse prefixes with the flag the user typed ------------
def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_range(low: int, high: int | None = None, what: str = "") -> Callable[[str], int]:
    """An integer in [low, high] (high None: no upper bound)."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {what + ' ' if what else ''}{bound}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


positive_int = int_range(1)
non_negative_int = int_range(0)
port = int_range(1, 65535, "a TCP port")
seed = int_range(0, 2**63 - 1, "a seed")


def float_range(low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    """A finite number in [low, high] (or (low, high] with low_open)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
            left = "(" if low_open else "["
            right = "]" if math.isfinite(high) else ")"
            raise argparse.ArgumentTypeError(f"must be a number in {left}{low:g}, {high:g}{right}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


# said in the help of every size flag: K/M/G/T are binary, KB/MB/GB/TB decimal (units.py)
SIZE_UNITS = "G, M, K, T and GiB, MiB are binary (8G = 8 GiB); GB, MB are decimal (8GB = 8e9 bytes = 7.45 GiB)"


def size(text: str) -> str:
    """A byte size such as 8G, 512M or 1048576; kept as text (parsed again where it is used)."""
    from k3serve.units import parse_size

    try:
        parse_size(text)
    except K3Error as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def token_ids(text: str) -> list[int]:
    """Comma-separated non-negative token ids, at least one."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("needs at least one token id")
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"token ids are non-negative, got {min(ids)}")
    return ids


def _writable_parent(path: Path) -> None:
    """The nearest existing folder above `path` must be a folder we may write into."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {str(path)!r}: {str(parent)!r} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {str(path)!r}: {str(parent)!r} is not writable")


def output_file(text: str) -> Path:
    """A file we will write: not a folder, and its folder exists and is writable (no folder is made for it)."""
    if not text:
        raise argparse.ArgumentTypeError("needs a file name")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: not writable")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the folder {str(parent)!r} does not exist "
                                         "(create it first)")
    _writable_parent(path)
    return path


def output_dir(text: str) -> Path:
    """A folder we will write into: a folder if it exists, otherwise creatable."""
    if not text:
        raise argparse.ArgumentTypeError("needs a folder name")
    path = Path(text)
    if path.exists():
        if not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"cannot write into {text!r}: not writable")
        return path
    _writable_parent(path)
    return path


def bind_listener(host: str, port: int):
    """A socket bound to host:port (uvicorn listens on it). Busy port or bad host -> UsageError naming the flag."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise UsageError(f"--host {host!r}: {exc.strerror}") from None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as exc:
        listener.close()
        raise UsageError(f"cannot listen on {host}:{port} (--host/--port): {exc.strerror}") from None
    return listener
