"""`k3serve cluster`: the server's options plus the cluster's, checked before Ray or any model starts.

This module imports no Ray at import time: the CLI builds its parser without the cluster extra installed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3serve.cli import args as cli_args
from k3serve.cluster.router import ROUTERS, RouterConfig
from k3serve.errors import CheckpointError, K3Error, UsageError

DEFAULT_REPLICAS = 2


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster (docs/CLUSTER.md)")
    g.add_argument("--replicas", type=cli_args.positive_int, default=None,
                   help=f"engine replicas (Ray actors, one CPU each; default {DEFAULT_REPLICAS})")
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
                   help="times Ray restarts a replica (or an expert owner) that died")
    ep = parser.add_argument_group("expert parallelism (docs/CLUSTER.md)")
    ep.add_argument("--expert-parallel", type=cli_args.positive_int, default=None, metavar="N",
                    help="split every MoE layer's experts over N owner actors (shards i/N), the trunk and the "
                         "engine on this process; --model is then a packed store (default: off)")
    ep.add_argument("--expert-shards", default=None, metavar="PATTERN",
                    help="each owner's shard folder, with {i} for its index, opened on the owner's machine "
                         "(`k3serve pack MODEL DIR --shard i/N`; default: packed from --model into the user cache)")
    ep.add_argument("--expert-ram-budget", type=cli_args.size, default=None,
                    help="each owner's RAM budget for its expert cache, e.g. 256M (default: its whole shard); "
                         "--ram-budget is the front's, for the trunk")


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


def run_cluster(args: argparse.Namespace, engine_config, speculative, tenants, listener, install_reload,
                serve=None) -> int:
    """Start (or join) Ray, the replicas and the HTTP front; serve until interrupted or SIGTERM (`serve(app)`: the
    server's drain, which lets in-flight requests finish); stop everything."""
    from k3serve.cluster.spec import ReplicaSpec
    from k3serve.cli.stream import stream_options

    if getattr(args, "trace_out", None) is not None:
        raise UsageError("--trace-out is per process: run `k3serve serve --trace-out` to record a routing trace")
    if getattr(args, "expert_top_p", None) is not None or getattr(args, "expert_top_p_min", None) is not None:
        raise UsageError("--expert-top-p is not carried to cluster replicas or expert owners yet: run `k3serve serve "
                         "--expert-top-p P` (docs/STREAMING.md)")
    if args.expert_parallel is not None:
        return run_expert_parallel(args, engine_config, speculative, tenants, listener, install_reload, serve)
    if args.expert_shards is not None or args.expert_ram_budget is not None:
        raise UsageError("--expert-shards and --expert-ram-budget go with --expert-parallel N")
    args.replicas = args.replicas or DEFAULT_REPLICAS
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
        _serve(app, listener, serve)
    finally:
        ray.shutdown()
    return 0


def _serve(app, listener, serve) -> None:
    if serve is not None:
        serve(app)
        return
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])


def local_shards(packed: Path, count: int, progress: bool = True) -> list[Path]:
    """Shards i/count of the packed store `packed`, written once into the user cache (one machine: a local Ray)."""
    from k3serve.default_model import cache_root
    from k3serve.weights.shard import ShardSpec, is_expert_shard, pack_shard
    from k3serve.weights.store import config_fingerprint, PackedStore

    store = PackedStore(packed)
    folder = cache_root() / "shards" / f"{packed.resolve().name}-{config_fingerprint(store.config)[:12]}-of-{count}"
    paths = [folder / f"shard-{i}" for i in range(count)]
    for i, path in enumerate(paths):
        if not is_expert_shard(path):
            if progress:
                print(f"k3serve: packing expert shard {i}/{count} of {packed} into {path} (once)", file=sys.stderr)
            pack_shard(packed, path, ShardSpec(i, count))
    return paths


def run_expert_parallel(args: argparse.Namespace, engine_config, speculative, tenants, listener,
                        install_reload, serve=None) -> int:
    """The engine and the trunk on this process, the experts on `--expert-parallel N` owner actors (Ray)."""
    from k3serve.config import load_config
    from k3serve.loading import default_model_dir
    from k3serve.units import parse_size
    from k3serve.cli.stream import stream_options
    from k3serve.loading.streaming import default_packed_dir
    from k3serve.stream.shard_source import ShardOptions
    from k3serve.weights.shard import check_shard_count
    from k3serve.weights.store import is_packed_store

    count = args.expert_parallel
    if args.replicas is not None:
        raise UsageError("--replicas does not combine with --expert-parallel: one engine runs on the front, its "
                         "experts on the owners")
    if args.expert_shards is not None and "{i}" not in args.expert_shards:
        raise UsageError(f"--expert-shards needs {{i}} where the owner's index goes, got {args.expert_shards!r}")
    if args.model is not None and not args.model.is_dir():
        raise CheckpointError(f"model folder {args.model} does not exist")
    check_shard_count(load_config(args.model or default_model_dir()).num_experts, count)
    if args.model is not None and not is_packed_store(args.model):
        raise UsageError(f"--expert-parallel reads the trunk from a packed store: run `k3serve pack {args.model} "
                         "PACKED` and pass --model PACKED")
    packed = args.model if args.model is not None else default_packed_dir()
    front = stream_options(args)
    owner_options = ShardOptions(
        ram_budget=parse_size(args.expert_ram_budget) if args.expert_ram_budget is not None else None,
        io=front.io if front else ShardOptions.io, queue_depth=front.queue_depth if front else ShardOptions.queue_depth,
        cache=front.cache if front else ShardOptions.cache)
    tokenizer = front_tokenizer(packed)
    shard_paths = ([args.expert_shards.format(i=i) for i in range(count)] if args.expert_shards is not None
                   else local_shards(packed, count))
    try:
        import ray
    except ImportError:
        raise UsageError("k3serve cluster needs Ray: pip install 'k3serve[cluster]'") from None
    from k3serve.cluster.runtime import start_ray

    start_ray(args.ray_address, args.num_cpus, count)
    try:
        from k3serve.cluster.expert_actors import load_expert_parallel
        from k3serve.engine.engine import LLMEngine
        from k3serve.serve.api import create_app

        ep = load_expert_parallel(packed, shard_paths, front, owner_options, max_restarts=args.max_restarts)
        drafters = None
        if speculative is not None:
            from k3serve.engine.speculative import DrafterFactory

            drafters = DrafterFactory(ep.loaded.model, None)
        engine = LLMEngine(ep.loaded.model, engine_config, stop_ids=ep.loaded.stop_ids, speculative=speculative,
                           drafters=drafters)
        name = args.served_model_name or ep.loaded.name
        tenants.on_reload = lambda config: engine.set_tenant_shares(config.shares())
        install_reload(tenants)
        app = create_app(engine, tokenizer, name, default_max_tokens=args.default_max_tokens, tenants=tenants)
        print(f"k3serve: serving '{name}' with its experts over {count} owners on "
              f"http://{args.host}:{args.port}/v1", file=sys.stderr)
        _serve(app, listener, serve)
    finally:
        ray.shutdown()
    return 0
