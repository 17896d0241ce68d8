"""Typed errors. User-facing failures raise one of these; the CLI and the HTTP layer map them to messages and
exit codes or status codes in one place each."""

from __future__ import annotations


class K3Error(Exception):
    """Base class of every error k3serve raises on purpose."""


class ConfigError(K3Error):
    """A config.json is missing a key, has a bad value, or describes an impossible model."""


class CheckpointError(K3Error):
    """A weight file is missing, truncated, corrupt, or does not match the config."""


class TokenizerError(K3Error):
    """A tokenizer file is missing or malformed, or an id is out of range."""


class RequestError(K3Error):
    """A generation request has invalid parameters (bad sampling values, too long, unknown ids)."""
