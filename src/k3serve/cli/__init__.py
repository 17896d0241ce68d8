"""The `k3serve` command line: every command's arguments and wiring (the top floor; nothing imports it).

`main.py` builds the parser and runs `generate`, `logits`, `serve`, `info`, `make-tiny`; the other modules add
their commands to it: `stream.py` (pack, routing-stats, sim cache, coactivation and the streaming flags),
`sim.py`, `cluster.py`, `lab.py`, `tenants.py`, `spec_storage.py`; `args.py` holds the parser and value types.
"""
