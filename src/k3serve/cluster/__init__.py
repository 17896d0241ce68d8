"""Serving over several machines with Ray (the `cluster` extra): engine replicas behind a cache-aware router.
Only `replica.py`, `backend.py`, `expert_actors.py` and `runtime.py` import Ray, and only when a cluster starts."""
