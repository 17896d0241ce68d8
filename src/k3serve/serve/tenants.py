"""Tenants for the server: the tenants file, API keys, quotas, and live reload.

A tenants file is TOML, one table per tenant; every field but `keys` is optional:

    [tenants.alice]
    keys = ["sha256:<hex digest of the API key>"]   # `k3serve tenants hash-key` prints one
    weight = 1.0              # share of service under fair scheduling
    priority = 0              # class under priority scheduling (larger is more important)
    requests_per_minute = 60
    tokens_per_minute = 100000   # prompt + max_tokens x n of each request, over a sliding minute
    max_concurrent = 8        # requests in flight
    kv_share = 0.5            # cap on its share of KV blocks and state slots
    max_context = 4096        # prompt + max_tokens
    admin = false             # true: its keys may read /metrics (every tenant's name and traffic)

Plain keys are never stored or logged: a request's bearer token is hashed and looked up. A bad file (malformed
TOML, a duplicate key hash, a zero or negative quota, an unknown field) raises `TenantsError` naming the tenant and
the field; at start the server then does not start, at reload the old configuration stays.

Quotas are sliding one-minute windows per tenant. A request is charged its estimated tokens when admitted (prompt
plus max_tokens for each completion, as OpenAI estimates) and the estimate is corrected to the tokens actually used
when it ends. A request refused with a 400 is never charged: the context is checked before the quotas, and a
refusal after admission (the engine's) refunds its request and tokens.

Without a tenants file the server is open: there are no limits, and every client is one tenant, `anonymous`, for
scheduling, quotas and metric labels, whatever bearer token it sends. Client-chosen strings never become state or
metric labels (8,000 random keys once made 8,000 tenants: 106 MiB and a 25.6 MiB /metrics). The token, hashed, only
scopes the prefix cache (`cache_scope`), whose entries are bounded by the cache itself, so two keys never share
cached state.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from k3serve.engine.fairness import TenantShare
from k3serve.errors import ConfigError, K3Error

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as the tomli package
    import tomli as tomllib

logger = logging.getLogger(__name__)

HASH_PREFIX = "sha256:"
WINDOW_SECONDS = 60.0
OPEN_TENANT = "anonymous"  # every client of an open server (no tenants file)
FIELDS = ("keys", "weight", "priority", "requests_per_minute", "tokens_per_minute", "max_concurrent", "kv_share",
          "max_context", "admin")


class TenantsError(ConfigError):
    """The tenants file is malformed or invalid (names the tenant and the field)."""


class AuthenticationError(K3Error):
    """A missing or unknown API key (HTTP 401)."""


class QuotaExceeded(K3Error):
    """A request over a tenant's rate or concurrency quota (HTTP 429, retry after `retry_after` seconds)."""

    def __init__(self, message: str, reason: str, retry_after: int, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.reason, self.retry_after, self.headers = reason, retry_after, headers


class CapExceeded(K3Error):
    """A request that can never fit one of its tenant's caps (HTTP 400); `cap` names the field."""

    def __init__(self, message: str, cap: str) -> None:
        super().__init__(message)
        self.cap = cap


def hash_key(key: str) -> str:
    """The stored form of an API key: 'sha256:' + the hex SHA-256 digest of its UTF-8 bytes."""
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class TenantConfig:
    name: str
    keys: tuple[str, ...]
    weight: float = 1.0
    priority: int = 0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    kv_share: float = 1.0
    max_context: int | None = None
    admin: bool = False

    def __post_init__(self) -> None:
        def bad(field_name: str, why: str) -> TenantsError:
            return TenantsError(f"tenant '{self.name}': field '{field_name}' {why}")

        if not isinstance(self.keys, tuple) or not self.keys:
            raise bad("keys", "must be a non-empty list of 'sha256:<64 hex digits>' key hashes")
        for key in self.keys:
            digest = key[len(HASH_PREFIX):] if isinstance(key, str) and key.startswith(HASH_PREFIX) else ""
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise bad("keys", "must hold 'sha256:<64 lowercase hex digits>' hashes (k3serve tenants hash-key), "
                                  "never plain keys")
        if len(set(self.keys)) != len(self.keys):
            raise bad("keys", "lists the same key hash twice")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) \
                or not math.isfinite(self.weight) or self.weight <= 0:
            raise bad("weight", f"must be a positive number, got {self.weight!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise bad("priority", f"must be an integer, got {self.priority!r}")
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent", "max_context"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise bad(name, f"must be a positive integer, got {value!r}")
        if isinstance(self.kv_share, bool) or not isinstance(self.kv_share, (int, float)) \
                or not 0 < self.kv_share <= 1:
            raise bad("kv_share", f"must be in (0, 1], got {self.kv_share!r}")
        if not isinstance(self.admin, bool):
            raise bad("admin", f"must be true or false, got {self.admin!r}")

    @property
    def share(self) -> TenantShare:
        return TenantShare(weight=float(self.weight), priority=self.priority, kv_share=float(self.kv_share))


@dataclass(frozen=True)
class TenantsConfig:
    tenants: tuple[TenantConfig, ...]

    def __post_init__(self) -> None:
        owners: dict[str, str] = {}
        for tenant in self.tenants:
            for key in tenant.keys:
                if key in owners:
                    raise TenantsError(f"tenant '{tenant.name}': field 'keys': the key hash {key[:15]}... is also "
                                       f"a key of tenant '{owners[key]}'")
                owners[key] = tenant.name

    @property
    def by_key_hash(self) -> dict[str, TenantConfig]:
        return {key: tenant for tenant in self.tenants for key in tenant.keys}

    def get(self, name: str) -> TenantConfig | None:
        return next((t for t in self.tenants if t.name == name), None)

    def shares(self) -> dict[str, TenantShare]:
        return {tenant.name: tenant.share for tenant in self.tenants}


def parse_tenants(text: str, source: str = "tenants file") -> TenantsConfig:
    """Parse and validate a tenants file's text. Raises `TenantsError` naming the tenant and field."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantsError(f"{source} is not valid TOML: {exc}") from None
    unknown = set(data) - {"tenants"}
    if unknown:
        raise TenantsError(f"{source}: unknown top-level key(s) {sorted(unknown)}; expected [tenants.<name>] tables")
    tables = data.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise TenantsError(f"{source} defines no tenant: add a [tenants.<name>] table with keys = [...]")
    tenants = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise TenantsError(f"{source}: tenant '{name}' must be a table ([tenants.{name}])")
        for field_name in table:
            if field_name not in FIELDS:
                raise TenantsError(f"{source}: tenant '{name}': unknown field '{field_name}' "
                                   f"(known: {', '.join(FIELDS)})")
        if "keys" not in table:
            raise TenantsError(f"{source}: tenant '{name}': field 'keys' is missing")
        keys = table["keys"]
        if not isinstance(keys, list):
            raise TenantsError(f"{source}: tenant '{name}': field 'keys' must be a list of key hashes")
        values = {k: v for k, v in table.items() if k != "keys"}
        try:
            tenants.append(TenantConfig(name=name, keys=tuple(keys), **values))
        except TenantsError as exc:
            raise TenantsError(f"{source}: {exc}") from None
    try:
        return TenantsConfig(tuple(tenants))
    except TenantsError as exc:
        raise TenantsError(f"{source}: {exc}") from None


def load_tenants(path: Path) -> TenantsConfig:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TenantsError(f"cannot read the tenants file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TenantsError(f"the tenants file {path} is not UTF-8 text") from None
    return parse_tenants(text, f"tenants file {path}")


class _Window:
    """Amounts charged over the last `WINDOW_SECONDS`: events (time, amount), oldest first."""

    def __init__(self) -> None:
        self.events: deque[list[float]] = deque()

    def total(self, now: float) -> float:
        while self.events and self.events[0][0] <= now - WINDOW_SECONDS:
            self.events.popleft()
        return sum(amount for _, amount in self.events)

    def seconds_until_room(self, now: float, needed: float, limit: float) -> float:
        """How long until the window's total plus `needed` fits `limit` (oldest events expire first)."""
        total = self.total(now)
        wait = 0.0
        for when, amount in self.events:
            if total + needed <= limit:
                break
            total -= amount
            wait = when + WINDOW_SECONDS - now
        return max(wait, 0.0)


@dataclass
class _TenantState:
    requests: _Window = field(default_factory=_Window)
    tokens: _Window = field(default_factory=_Window)
    in_flight: int = 0


class Lease:
    """One admitted HTTP request's hold on its tenant's quotas: `finish(tokens_used)` releases it once."""

    def __init__(self, registry: TenantRegistry, tenant: str, token_event: list[float] | None,
                 headers: dict[str, str], request_event: list[float] | None = None) -> None:
        self.registry, self.tenant, self._token_event, self.headers = registry, tenant, token_event, headers
        self._request_event = request_event
        self._done = False

    def finish(self, tokens_used: int | None = None) -> None:
        self.registry._release(self, tokens_used)

    def refund(self) -> None:
        """Release a request refused before it ran (over the context, refused by the engine): neither its
        request nor its tokens count against the quotas."""
        self.registry._release(self, 0, refund=True)

    @property
    def done(self) -> bool:
        return self._done


class TenantRegistry:
    """The live tenants configuration and each tenant's quota state; thread-safe. Without a config (open mode)
    every request is accepted as the one tenant `OPEN_TENANT`: per-tenant state exists only for configured
    tenants (and that one), never for a client-supplied string."""

    def __init__(self, config: TenantsConfig | None = None, path: Path | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_reload: Callable[[TenantsConfig], None] | None = None) -> None:
        self._lock = threading.Lock()
        self.config, self.path, self._clock, self.on_reload = config, path, clock, on_reload
        self._by_hash = config.by_key_hash if config is not None else {}
        self._state: dict[str, _TenantState] = {}

    @classmethod
    def from_file(cls, path: Path, **kwargs) -> TenantRegistry:
        return cls(load_tenants(path), Path(path), **kwargs)

    @property
    def open(self) -> bool:
        return self.config is None

    def shares(self) -> dict[str, TenantShare]:
        return self.config.shares() if self.config is not None else {}

    def reload(self) -> bool:
        """Read the file again. All or nothing: the new tenants take effect (for new requests; in-flight ones
        carry on) only once `on_reload` has applied their shares to the engines; a bad file, or shares an engine
        refuses, are logged with the reason and the old configuration stays. Either way the log says which:
        "tenants reloaded" or "tenants reload refused". Returns whether the new file was taken."""
        if self.path is None:
            return False
        try:
            config = load_tenants(self.path)
        except TenantsError as exc:
            logger.error("tenants reload refused, keeping the previous configuration: %s", exc)
            return False
        if self.on_reload is not None:
            try:
                self.on_reload(config)
            except Exception as exc:  # noqa: BLE001 - whatever the engines said, the reload must end in one line
                logger.error("tenants reload refused, keeping the previous configuration: the engines did not take "
                             "the new shares (%s: %s)", type(exc).__name__, exc)
                return False
        with self._lock:
            self.config, self._by_hash = config, config.by_key_hash
        logger.warning("tenants reloaded from %s: %d tenant(s)", self.path, len(config.tenants))
        return True

    # ---- per request ----------------------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> str:
        """The tenant name for an `Authorization` header value: a configured tenant, or `OPEN_TENANT` in open
        mode. Raises `AuthenticationError` (closed mode)."""
        token = _bearer_token(authorization)
        if self.config is None:
            return OPEN_TENANT
        if not token:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        tenant = self._by_hash.get(hash_key(token))
        if tenant is None:
            raise AuthenticationError("incorrect API key provided")
        return tenant.name

    def cache_scope(self, authorization: str | None) -> str | None:
        """What keeps one client's prefix-cache entries from another's beyond the tenant name: in open mode the
        bearer token's hash ('' without one), since every open client is the same tenant; None when tenants are
        configured (the tenant name separates them)."""
        if self.config is not None:
            return None
        token = _bearer_token(authorization)
        return hashlib.sha256(token.encode()).hexdigest()[:32] if token else ""

    def may_read_metrics(self, name: str) -> bool:
        """Whether a tenant may read /metrics: anyone in open mode, else only a tenant with `admin = true`."""
        tenant = self.tenant(name)
        return self.config is None or (tenant is not None and tenant.admin)

    def tenant(self, name: str) -> TenantConfig | None:
        return self.config.get(name) if self.config is not None else None

    def check_caps(self, name: str, prompt_lengths: list[int], max_tokens: int, n: int,
                   share_capacity: Callable[[float], tuple[int, int]]) -> None:
        """Raise `CapExceeded` if the request can never fit one of the tenant's caps: its context, its tokens per
        minute, or (per prompt) its share of cached positions and sequences."""
        tenant = self.tenant(name)
        if tenant is None:
            return
        longest = max(prompt_lengths)
        if tenant.max_context is not None and longest + max_tokens > tenant.max_context:
            raise CapExceeded(f"tenant '{name}' has max_context = {tenant.max_context} tokens, but the prompt has "
                              f"{longest} and max_tokens asks for {max_tokens} more", "max_context")
        tokens = estimate_tokens(prompt_lengths, max_tokens, n)
        if tenant.tokens_per_minute is not None and tokens > tenant.tokens_per_minute:
            raise CapExceeded(f"tenant '{name}' has tokens_per_minute = {tenant.tokens_per_minute}, but this "
                              f"request needs {tokens} (prompt + max_tokens x n)", "tokens_per_minute")
        if tenant.kv_share < 1:
            max_seqs, max_positions = share_capacity(tenant.kv_share)
            if longest + max_tokens > max_positions:
                raise CapExceeded(f"tenant '{name}' has kv_share = {tenant.kv_share}, {max_positions} cached "
                                  f"positions, but this request needs {longest + max_tokens}", "kv_share")
            if n > max_seqs:
                raise CapExceeded(f"tenant '{name}' has kv_share = {tenant.kv_share}, {max_seqs} sequences at "
                                  f"once, but n = {n}", "kv_share")

    def admit(self, name: str, tokens: int) -> Lease:
        """Charge one request of `tokens` estimated tokens to the tenant's quotas, or raise `QuotaExceeded`."""
        with self._lock:
            tenant = self.config.get(name) if self.config is not None else None
            state = self._state.setdefault(name, _TenantState())
            if tenant is None:
                state.in_flight += 1
                return Lease(self, name, None, {})
            now = self._clock()
            rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
            used_requests, used_tokens = state.requests.total(now), state.tokens.total(now)
            reason, wait = None, 0.0
            if tenant.max_concurrent is not None and state.in_flight >= tenant.max_concurrent:
                reason, wait = "max_concurrent", 1.0
            elif rpm is not None and used_requests + 1 > rpm:
                reason, wait = "requests_per_minute", state.requests.seconds_until_room(now, 1, rpm)
            elif tpm is not None and used_tokens + tokens > tpm:
                reason, wait = "tokens_per_minute", state.tokens.seconds_until_room(now, tokens, tpm)
            if reason is None:
                request_event = [now, 1.0]
                state.requests.events.append(request_event)
                token_event = [now, float(tokens)]
                state.tokens.events.append(token_event)
                state.in_flight += 1
                used_requests, used_tokens = used_requests + 1, used_tokens + tokens
            headers = _rate_headers(rpm, tpm, used_requests, used_tokens)
            if reason is not None:
                retry_after = max(1, math.ceil(wait))
                headers["retry-after"] = str(retry_after)
                raise QuotaExceeded(f"tenant '{name}' is over its {reason} quota; retry after {retry_after} s",
                                    reason, retry_after, headers)
            return Lease(self, name, token_event, headers, request_event)

    def _release(self, lease: Lease, tokens_used: int | None, refund: bool = False) -> None:
        with self._lock:
            if lease._done:
                return
            lease._done = True
            state = self._state.get(lease.tenant)
            if state is not None:
                state.in_flight -= 1
            if lease._token_event is not None and tokens_used is not None:
                lease._token_event[1] = float(min(tokens_used, lease._token_event[1]))
            if refund and lease._request_event is not None:
                lease._request_event[1] = 0.0

    def in_flight(self, name: str) -> int:
        with self._lock:
            state = self._state.get(name)
            return state.in_flight if state is not None else 0


def _bearer_token(authorization: str | None) -> str:
    auth = authorization or ""
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ""


def estimate_tokens(prompt_lengths: list[int], max_tokens: int, n: int) -> int:
    """A request's charge against tokens_per_minute before it runs: every prompt plus max_tokens per completion."""
    return sum(prompt_lengths) + max_tokens * n * len(prompt_lengths)


def _rate_headers(rpm: int | None, tpm: int | None, used_requests: float, used_tokens: float) -> dict[str, str]:
    headers = {}
    if rpm is not None:
        headers["x-ratelimit-limit-requests"] = str(rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, int(rpm - used_requests)))
    if tpm is not None:
        headers["x-ratelimit-limit-tokens"] = str(tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, int(tpm - used_tokens)))
    return headers
