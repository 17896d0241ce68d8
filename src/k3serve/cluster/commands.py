"""`k3serve cluster`: the server's options plus the cluster's, checked before Ray or any model starts.

This module imports no Ray at import time: the CLI builds its parser without the cluster extra installed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3serve import cli_args
from k3serve.cluster.router import ROUTERS, RouterConfig
from k3serve.errors import CheckpointError, K3Error, UsageError


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster (docs/CLUSTER.md)")
    g.add_argument("--replicas", type=cli_args.positive_int, default=2, help="engine replicas (Ray actors, one CPU each)")
    g.add_argument("--ray-address", default=None,
                   help="HOST:PORT of a Ray cluster started with `ray start --head` (default: start a local Ray)")
    g.add_argument("--num-cpus", type=cli_args.positive_int, default=None,
                   help="CPUs of the local Ray (default: this machine's); ignored with --ray-address")
    g.add_argument("--router", choices=ROUTERS, default="cache-aware", help="how a request picks its replica")
    g.add_argument("--balance-abs-threshold", type=cli_args.non_negative_int,
                   default=RouterConfig.balance_abs_threshold,
                   help="cache-aware: load spread (requests) still counted as balanced")
    g.add_argument("--balance-rel-threshold", type=cli_args.float_range(1.0),
                   default=RouterConfig.balance_rel_threshold,
                   help="cache-aware: max/min load ratio still counted as balanced")
    g.add_argument("--max-restarts", type=cli_args.non_negative_int, default=3,
                   help="times Ray restarts a replica that died")


def front_tokenizer(model: Path | None):
    """The tokenizer the front needs for text (chat template, stop strings), read without loading any weights;
    a missing or damaged model folder fails here, before Ray starts."""
    from k3serve.loading import default_model_dir
    from k3serve.tokenizer import Tokenizer
    from k3serve.weights.checkpoint import Checkpoint
    from k3serve.weights.store import is_packed_store

    folder = model if model is not None else default_model_dir()
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")
    if not is_packed_store(folder):
        with Checkpoint(folder) as checkpoint:  # checks every tensor the config implies
            folder = checkpoint.tokenizer_dir or folder
    if not (folder / "tiktoken.model").exists():
        raise K3Error(f"{folder} has no tokenizer (tiktoken.model): the server needs one")
    return Tokenizer.from_dir(folder)


def run_cluster(args: argparse.Namespace, engine_config, speculative, tenants, listener, install_reload) -> int:
    """Start (or join) Ray, the replicas and the HTTP front; serve until interrupted; stop everything."""
    from k3serve.cluster.spec import ReplicaSpec
    from k3serve.stream.commands import stream_options

    if getattr(args, "trace_out", None) is not None:
        raise UsageError("--trace-out is per process: run `k3serve serve --trace-out` to record a routing trace")
    router = RouterConfig(policy=args.router, block_size=engine_config.block_size,
                          balance_abs_threshold=args.balance_abs_threshold,
                          balance_rel_threshold=args.balance_rel_threshold)
    spec = ReplicaSpec(model=args.model, stream=stream_options(args), engine=engine_config,
                       speculative=speculative, draft_model=args.draft_model)
    tokenizer = front_tokenizer(args.model)
    try:
        import ray
    except ImportError:
        raise UsageError("k3serve cluster needs Ray: pip install 'k3serve[cluster]'") from None
    import uvicorn

    from k3serve.cluster.runtime import start_ray

    start_ray(args.ray_address, args.num_cpus, args.replicas)
    try:
        from k3serve.cluster.backend import ClusterBackend
        from k3serve.serve.api import create_app

        backend = ClusterBackend(spec, args.replicas, router, max_restarts=args.max_restarts)
        name = args.served_model_name or backend.model_name
        tenants.on_reload = lambda config: backend.set_tenant_shares(config.shares())
        install_reload(tenants)
        app = create_app(backend, tokenizer, name, default_max_tokens=args.default_max_tokens, tenants=tenants)
        print(f"k3serve: serving '{name}' from {args.replicas} replicas ({args.router} router) on "
              f"http://{args.host}:{args.port}/v1", file=sys.stderr)
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])
    finally:
        ray.shutdown()
    return 0
