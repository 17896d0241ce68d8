"""Reading a Hugging Face `config.json` without guessing.

A checkpoint's config is looked up key by key. A key that the family needs and the file lacks is a `ConfigError`
naming the key, the family and the file. Two kinds of tolerance are allowed, each spelled out where it is used:
- spellings: the same setting under another name (`num_experts` / `num_local_experts`), because transformers'
  `save_pretrained` writes some attributes under its own names and released checkpoints use the original ones;
- documented absences: a key that released checkpoints omit because the reference implementation assumes a value
  (DeepSeek-V3 has no `rope_interleave`; transformers takes True). `optional(key, value)` names that value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from k3serve.errors import ConfigError

_MISSING = object()


class HFConfig:
    """One config.json, with lookups that fail loudly."""

    def __init__(self, raw: Mapping[str, Any], family: str, source: str) -> None:
        self.raw = dict(raw)
        self.family = family
        self.source = source

    @classmethod
    def read(cls, folder: str | Path, family: str = "") -> HFConfig:
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist: a checkpoint folder needs a config.json") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: cannot parse: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: must hold a JSON object")
        return cls(raw, family, str(path))

    def with_family(self, family: str) -> HFConfig:
        return HFConfig(self.raw, family, self.source)

    def _where(self) -> str:
        return f"{self.source} ({self.family})" if self.family else self.source

    def has(self, *names: str) -> bool:
        return any(name in self.raw for name in names)

    def get(self, *names: str, default: Any = _MISSING) -> Any:
        """The value of the first of `names` present; without `default`, a missing key is a ConfigError."""
        for name in names:
            if name in self.raw:
                return self.raw[name]
        if default is not _MISSING:
            return default
        spelled = " or ".join(repr(n) for n in names)
        raise ConfigError(f"{self._where()}: missing key {spelled}")

    def optional(self, name: str, value_when_absent: Any) -> Any:
        """A key that released checkpoints may omit; `value_when_absent` is what the reference assumes."""
        return self.raw.get(name, value_when_absent)

    def integer(self, *names: str, minimum: int = 1) -> int:
        value = self.get(*names)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"{self._where()}: {names[0]!r} must be an integer >= {minimum}, got {value!r}")
        return value

    def optional_integer(self, *names: str) -> int | None:
        """An integer that may be null (e.g. q_lora_rank of a model without a query low-rank)."""
        value = self.get(*names)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{self._where()}: {names[0]!r} must be null or an integer >= 1, got {value!r}")
        return value

    def number(self, *names: str) -> float:
        value = self.get(*names)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{self._where()}: {names[0]!r} must be a number, got {value!r}")
        return float(value)

    def boolean(self, *names: str) -> bool:
        value = self.get(*names)
        if not isinstance(value, bool):
            raise ConfigError(f"{self._where()}: {names[0]!r} must be true or false, got {value!r}")
        return value

    def require_value(self, name: str, allowed: tuple[Any, ...], value_when_absent: Any = _MISSING) -> Any:
        """A setting this implementation supports only in some values (e.g. hidden_act must be 'silu')."""
        value = self.get(name) if value_when_absent is _MISSING else self.optional(name, value_when_absent)
        if value not in allowed:
            raise ConfigError(
                f"{self._where()}: {name}={value!r} is not supported (supported: {', '.join(map(repr, allowed))})"
            )
        return value

    def special_ids(self) -> tuple[int | None, tuple[int, ...]]:
        """(bos id or None, eos ids). Both may be absent or null in tiny test configs."""
        bos = self.raw.get("bos_token_id")
        eos = self.raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if bos is not None and not isinstance(bos, int):
            raise ConfigError(f"{self._where()}: bos_token_id must be an integer or null, got {bos!r}")
        if not all(isinstance(e, int) for e in eos_ids):
            raise ConfigError(f"{self._where()}: eos_token_id must be an integer, a list of them, or null")
        return bos, tuple(int(e) for e in eos_ids)

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self._where()}: {message}")
