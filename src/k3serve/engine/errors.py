"""Internal engine errors. They never reach a client as such: user-facing failures stay in `k3serve.errors`
(`RequestError` for a bad request); these mark a pool that ran dry or a broken invariant."""

from __future__ import annotations

from k3serve.errors import K3Error


class PoolExhaustedError(K3Error):
    """A block or slot was requested from a pool with none free. The scheduler reserves ahead of every forward, so
    inside a step this is a bug; outside, it is the signal to preempt."""


class IntegrityError(K3Error):
    """A pool or cache broke one of its invariants (a leaked block, a wrong reference count, a stale index)."""
