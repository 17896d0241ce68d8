"""Starting or joining Ray, with the checks that must fail before anything starts.

Without an address a local Ray starts in this process's session (tests, CI, one machine); with one, the front
joins the cluster started by `ray start --head` (docs/CLUSTER.md). An address that does not answer, or a cluster
with fewer CPUs than the replicas ask for, is a `UsageError` (`k3serve: error:`, exit 2).
"""

from __future__ import annotations

import logging
import os
import socket

from k3serve.errors import UsageError

logger = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 128 << 20  # outputs are small; Ray's store needs only a little (its minimum is ~75 MiB)
CONNECT_TIMEOUT_SECONDS = 3.0

# Debug toggles for a shared, small machine: no usage-stats prompt, no memory monitor killing workers at Ray's
# default 95% threshold (other processes' memory is not ours to count), no log deduplication hiding a replica.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_memory_monitor_refresh_ms": "0", "RAY_DEDUP_LOGS": "0"}


def check_address(address: str) -> None:
    """Raise `UsageError` unless `host:port` accepts a TCP connection (ray.init would wait a long time)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--ray-address must be HOST:PORT (the head's GCS address from `ray start --head`), "
                         f"got {address!r}")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_SECONDS):
            pass
    except OSError as exc:
        raise UsageError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}; start it with "
                         "`ray start --head` (docs/CLUSTER.md), or leave out --ray-address for a local Ray") from None


def start_ray(address: str | None, num_cpus: int | None, replicas: int, cpus_per_replica: float = 1.0) -> None:
    """Join the cluster at `address`, or start a local Ray with `num_cpus` (default: this machine's); then check
    that it has the CPUs for `replicas` actors. Shuts Ray down again before raising."""
    if address is not None:
        check_address(address)
    else:
        available = num_cpus if num_cpus is not None else (os.cpu_count() or 1)
        if replicas * cpus_per_replica > available:
            raise UsageError(f"--replicas {replicas} needs {replicas * cpus_per_replica:g} CPUs (one thread per "
                             f"replica) but the local Ray has {available}; lower --replicas or join a cluster "
                             "with --ray-address")
    for name, value in RAY_ENV.items():
        os.environ.setdefault(name, value)
    import ray

    if address is not None:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus if num_cpus is not None else os.cpu_count(), include_dashboard=False,
                 object_store_memory=OBJECT_STORE_BYTES, logging_level=logging.WARNING, log_to_driver=False)
    cpus = ray.cluster_resources().get("CPU", 0.0)
    if replicas * cpus_per_replica > cpus:
        ray.shutdown()
        raise UsageError(f"--replicas {replicas} needs {replicas * cpus_per_replica:g} CPUs but the Ray cluster has "
                         f"{cpus:g}; lower --replicas or add machines (`ray start --address=...`)")
