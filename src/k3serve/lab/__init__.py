"""The lab: every mechanism of k3serve as a module with parameters and a measured (or computed) before/after.

- `registry.py`: what a module declares (`LabModule`, `Param`), parameter validation, and the registry that finds
  every module in `lab/modules/` (one file each: adding a file adds a module).
- `fixtures.py`: what modules measure on (the model, held-out token windows, a recorded routing trace, packed
  stores), built once into the user cache and shared.
- `jobs.py`: the run queue: one run at a time, queue positions, cancellation, a result cache.
- `api.py`: the HTTP API and the static page (`k3serve lab`, or `/lab` under `k3serve serve`).
- `verdict.py`: each result's verdict sentence (won / lost / even, by how much, when it would flip).
- `overview.py`: the page's answers-first overview, from the stored runs (`web/stored_runs.json`, written by
  `k3serve lab run --all`) and this server's latest runs.
- `commands.py`: `k3serve lab` and `k3serve lab run MODULE --param k=v`.
"""
