"""errors.py: the one mapping from an exception to what the user sees (message, CLI exit code, HTTP status)."""

from __future__ import annotations

import errno

import pytest

from k3serve.errors import (ConfigError, ContextLengthError, K3Error, RequestError, TokenizerError, UsageError,
                            exit_code, http_status, unencodable_text_error, user_message)


@pytest.mark.parametrize("exc,code,status", [
    (UsageError("--port: bad"), 2, 400),
    (RequestError("max_tokens must be positive"), 2, 400),
    (TokenizerError("not UTF-8"), 2, 400),
    (ContextLengthError(10, 5, 12), 2, 400),
    (ConfigError("missing key"), 2, 500),  # the server's own model is broken: not the client's fault
    (K3Error("other"), 2, 500),
    (PermissionError(errno.EACCES, "Permission denied", "/x/out.npy"), 2, 500),
    (KeyboardInterrupt(), 130, 500),
    (ValueError("a bug"), None, 500),  # not ours: the CLI lets its traceback show
])
def test_each_error_has_one_exit_code_and_one_status(exc, code, status):
    assert exit_code(exc) == code
    assert http_status(exc) == status


def test_messages_are_one_line_and_name_what_the_user_typed():
    assert user_message(PermissionError(errno.EACCES, "Permission denied", "/x/out.npy")) == \
        "/x/out.npy: Permission denied"
    assert user_message(K3Error("first\n  second")) == "first second"
    assert user_message(KeyboardInterrupt()) == "interrupted"
    error = ContextLengthError(10, 5, 12)
    assert "and max_tokens asks for 5 more" in user_message(error)
    assert "and --max-tokens asks for 5 more" in user_message(error, cli=True)
    assert "at character 2 (U+DC80" in str(unencodable_text_error("ab\udc80c"))


def test_a_runtime_write_failure_is_one_error_line(tiny_dir, tmp_path, monkeypatch, capsys):
    import numpy as np

    from k3serve.cli.main import main

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "l.npy"))

    monkeypatch.setattr(np, "save", full_disk)
    assert main(["logits", "--model", str(tiny_dir), "--ids", "1,2", "--out", str(tmp_path / "l.npy")]) == 2
    err = capsys.readouterr().err
    assert err == f"k3serve: error: {tmp_path / 'l.npy'}: No space left on device\n"
