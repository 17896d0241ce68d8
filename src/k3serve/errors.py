"""Typed errors, and the one place that maps any error to what the user sees: a `k3serve: error:` line and an
exit code for the CLI (`exit_code`), a status code for HTTP (`http_status`). The CLI (`cli.main`) and the HTTP
layer (`serve/errors.py`) both go through these two functions."""

from __future__ import annotations

EXIT_OK = 0
EXIT_USER_ERROR = 2  # bad arguments, bad files, anything the user can fix (argparse's code too)
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it (a SIGTERM: 143)
SIGTERM = 15


class K3Error(Exception):
    """Base class of every error k3serve raises on purpose."""


class ConfigError(K3Error):
    """A config.json is missing a key, has a bad value, or describes an impossible model."""


class CheckpointError(K3Error):
    """A weight file is missing, truncated, corrupt, or does not match the config."""


class TokenizerError(K3Error):
    """A tokenizer file is missing or malformed, an id is out of range, or text is not encodable."""


class RequestError(K3Error):
    """A generation request has invalid parameters (bad sampling values, too long, unknown ids)."""


class UsageError(K3Error):
    """A command-line argument is invalid (a bad value, an unwritable output, flags that do not go together)."""


def unencodable_text_error(text: str) -> TokenizerError:
    """The error for text holding a lone surrogate (not encodable as UTF-8), naming its position in `text`."""
    position = next((i for i, ch in enumerate(text) if 0xD800 <= ord(ch) <= 0xDFFF), None)
    where = f" at character {position} (U+{ord(text[position]):04X}, a lone surrogate)" if position is not None else ""
    return TokenizerError(f"text is not encodable as UTF-8{where}")


def user_message(exc: BaseException, cli: bool = False) -> str:
    """The one-line text shown to the user for `exc` (without the `k3serve: error:` prefix); `cli` names limits by
    their command-line flags."""
    if cli and isinstance(exc, ContextLengthError):
        return exc.text("--max-tokens")
    if isinstance(exc, KeyboardInterrupt):
        return "terminated (SIGTERM)" if getattr(exc, "signum", None) == SIGTERM else "interrupted"
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, RecursionError):
        return "input nested too deeply"
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())  # one line, whatever the message held


def exit_code(exc: BaseException) -> int | None:
    """The CLI's exit code for `exc`, or None for an unexpected error (a bug: let its traceback show)."""
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C; a SIGTERM the CLI turned into one carries its `signum`
        signum = getattr(exc, "signum", None)
        return EXIT_INTERRUPTED if signum is None else 128 + signum
    if isinstance(exc, (K3Error, OSError)):  # OSError: unreadable input, unwritable output
        return EXIT_USER_ERROR
    return None


def http_status(exc: BaseException) -> int:
    """The HTTP status of a request that failed with `exc`: what the client sent is 400, the rest is ours."""
    if isinstance(exc, (RequestError, TokenizerError, UsageError, RecursionError, UnicodeError)):
        return 400
    return 500


class ContextLengthError(RequestError):
    """A prompt plus the tokens asked for does not fit the context. Every entry point (the engine, `generate`,
    `logits`, the HTTP server) raises this one message, so a user meets the same words wherever they ask."""

    def __init__(self, prompt_tokens: int, new_tokens: int, max_context: int) -> None:
        self.prompt_tokens, self.new_tokens, self.max_context = prompt_tokens, new_tokens, max_context
        super().__init__(self.text())

    def text(self, max_tokens_name: str = "max_tokens") -> str:
        """The message, naming the limit as the user spelled it (`max_tokens` over HTTP, `--max-tokens` in a shell)."""
        wanted = f" and {max_tokens_name} asks for {self.new_tokens} more" if self.new_tokens > 0 else ""
        return f"this model's context holds {self.max_context} tokens, but the prompt has {self.prompt_tokens}{wanted}"

    @classmethod
    def check(cls, prompt_tokens: int, new_tokens: int, max_context: int) -> None:
        """Raise unless prompt_tokens + new_tokens <= max_context."""
        if prompt_tokens + new_tokens > max_context:
            raise cls(prompt_tokens, new_tokens, max_context)
