"""Command-line pieces of streaming: the flags shared by every command that loads a model, and the `pack`,
`sim cache` and `coactivation` subcommands (wired into `k3serve.cli`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import numpy as np

from k3serve.atomic_file import atomic_output, staged_folder, write_text
from k3serve.cli import args as cli_args
from k3serve.errors import K3Error, UsageError
from k3serve.units import format_size, parse_size
from k3serve.stream.cache import POLICIES
from k3serve.stream.io import IO_MODES
from k3serve.model.routing import ExpertTopP
from k3serve.stream.options import PREFETCH_MODES, StreamOptions

_STREAM_FLAGS = ("ram_budget", "io", "queue_depth", "cache", "cache_profile", "prefetch", "prefetch_max",
                 "pin_trunk", "trace_out", "trunk_dtype")


def add_stream_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("streaming (any of these but --trace-out reads the model from a packed store; "
                                  "--trace-out alone also records a resident checkpoint)")
    g.add_argument("--ram-budget", type=cli_args.size, default=None,
                   help=f"cap on all weight memory, e.g. 8G, 512M; {cli_args.SIZE_UNITS} (default: none)")
    g.add_argument("--io", choices=IO_MODES, default=None, help="mmap (naive), pread or direct (O_DIRECT); "
                                                                  "default pread")
    g.add_argument("--queue-depth", type=cli_args.int_range(1, 1024), default=None,
                   help="reads in flight (pread/direct; default 16)")
    g.add_argument("--cache", choices=POLICIES, default=None, help="expert cache policy (default lru)")
    g.add_argument("--cache-profile", type=Path, default=None,
                   help="routing trace (of this model) whose hot set --cache pinned holds (default: none)")
    g.add_argument("--prefetch", choices=PREFETCH_MODES, default=None,
                   help=f"next-layer router prefetch (default: {StreamOptions().prefetch})")
    g.add_argument("--prefetch-max", type=cli_args.non_negative_int, default=None,
                   help="guesses per layer (default: top-k)")
    g.add_argument("--pin-trunk", type=cli_args.size, default=None,
                   help="cap on the budget given to pinned trunk layers (e.g. 0, 2G); default: as much as fits")
    g.add_argument("--trace-out", type=cli_args.output_file, default=None,
                   help="record every (token, layer, expert) request to this file (default: none)")
    g.add_argument("--trunk-dtype", choices=("float32", "bf16"), default=None,
                   help="hold the trunk matrices as their stored bf16 (views of the read buffers: the memory floor, "
                        "docs/STREAMING.md) or widened to float32 (default: bf16)")


def add_routing_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("routing (any model with routed experts, resident or streamed)")
    g.add_argument("--expert-top-p", type=cli_args.float_range(0.0, 1.0, low_open=True), default=None,
                   help="keep each token's heaviest routed experts until their share of its routing weight reaches "
                        "P, the kept weights renormalized as the router does (docs/STREAMING.md; default 1: all)")
    g.add_argument("--expert-top-p-min", type=cli_args.int_range(1), default=None,
                   help=f"keep at least this many experts per token under --expert-top-p (default "
                        f"{ExpertTopP().min_kept})")


def expert_top_p(args: argparse.Namespace) -> ExpertTopP | None:
    top_p, min_kept = getattr(args, "expert_top_p", None), getattr(args, "expert_top_p_min", None)
    if top_p is None:
        if min_kept is not None:
            raise UsageError("--expert-top-p-min goes with --expert-top-p P")
        return None
    return ExpertTopP(top_p, min_kept if min_kept is not None else ExpertTopP().min_kept)


def stream_options(args: argparse.Namespace) -> StreamOptions | None:
    if all(getattr(args, name, None) is None for name in _STREAM_FLAGS):
        return None
    defaults = StreamOptions()
    return StreamOptions(
        ram_budget=parse_size(args.ram_budget) if args.ram_budget is not None else None,
        io=args.io or defaults.io,
        queue_depth=args.queue_depth if args.queue_depth is not None else defaults.queue_depth,
        cache=args.cache or defaults.cache,
        prefetch=args.prefetch or defaults.prefetch,
        prefetch_max=args.prefetch_max,
        pin_trunk_bytes=parse_size(args.pin_trunk) if args.pin_trunk is not None else None,
        cache_profile=args.cache_profile,
        trace_out=args.trace_out,
        trunk_dtype=args.trunk_dtype or defaults.trunk_dtype,
    )


def load_for_run(args: argparse.Namespace, **kwargs):
    """load_model with the streaming flags; --trace-out alone on a plain checkpoint traces the resident model."""
    from k3serve.loading import load_model
    from k3serve.weights.store import is_packed_store

    options = stream_options(args)
    kwargs.setdefault("expert_top_p", expert_top_p(args))
    only_trace = options is not None and all(getattr(args, n, None) is None for n in _STREAM_FLAGS if n != "trace_out")
    if only_trace and args.model is not None and not is_packed_store(args.model):
        loaded = load_model(args.model, **kwargs)
        if loaded.architecture.record_routing is None:
            raise UsageError(f"{args.model}: --trace-out records K3 models only (routing traces are K3's format)")
        loaded.architecture.record_routing(loaded.model, options.trace_out)
        return loaded
    if options is not None and args.model is not None and not is_packed_store(args.model):
        given = ", ".join("--" + name.replace("_", "-") for name in _STREAM_FLAGS
                          if name != "trace_out" and getattr(args, name, None) is not None)
        raise UsageError(f"{args.model} is not a packed store; {given} read{'s' if ',' not in given else ''} a "
                         f"packed store (--trace-out alone also records a checkpoint): run `k3serve pack "
                         f"{args.model} PACKED_DIR` and pass --model PACKED_DIR")
    return load_model(args.model, stream=options, **kwargs)


def add_subcommands(sub) -> dict:
    pack = sub.add_parser("pack", help="rewrite a checkpoint into a trunk file + aligned, checksummed expert store")
    pack.add_argument("src", type=cli_args.model_path, help="safetensors checkpoint folder, or a GGUF file")
    pack.add_argument("out", type=cli_args.output_dir, help="output folder (not the source folder)")
    pack.add_argument("--layout", choices=("natural", "frequency", "coactivation"), default="natural",
                      help="order of the experts in the store")
    pack.add_argument("--trace", type=Path, default=None,
                      help="routing trace of this model (for frequency / coactivation; default: none)")
    pack.add_argument("--shard", default=None, metavar="i/N",
                      help="write only shard i of N of the experts (expert parallelism, docs/CLUSTER.md); the "
                           "source may be a checkpoint or a packed store (default: the whole store)")
    pack.add_argument("--expert-precision", choices=("native", "bf16", "int8", "mxfp4"), default="native",
                      help="a family checkpoint's routed experts in the store: the stored values, int8 or MXFP4 "
                           "(K3 experts are MXFP4 already; default native)")
    pack.add_argument("--trunk-precision", choices=("bf16", "q8_0", "mxfp4"), default="bf16",
                      help="the store's trunk matrices: as stored (bf16, lossless), or Q8_0 (8.5 bits per weight; "
                           "K3 and family checkpoint folders) or MXFP4 (4.25; K3), multiplied straight from those "
                           "bytes (lossy: docs/STREAMING.md; default bf16)")
    pack.add_argument("--stripe", type=_stripe_dirs, default=None, metavar="DIR1,DIR2,...",
                      help="lay trunk.bin and experts.bin over these folders, one per drive, in chunks (RAID 0 "
                           "fashion; the streaming reader keeps a queue per drive); each folder must exist "
                           "(default: both files in the output folder)")

    sim = sub.add_parser("sim", help="simulators")
    sim_sub = sim.add_subparsers(dest="sim_command", required=True)
    cache = sim_sub.add_parser("cache", help="replay a routing trace against every cache policy and Belady")
    cache.add_argument("trace", type=Path, help="routing trace (written by --trace-out)")
    cache.add_argument("--capacity", required=True, type=_capacities,
                       help="comma-separated expert-cache capacities in experts (or sizes like 64M)")
    cache.add_argument("--policies", default=",".join(SIM_POLICIES), type=_policies,
                       help="comma-separated policies to replay")
    cache.add_argument("--json", type=cli_args.output_file, default=None,
                       help="also write the results as JSON to this file (default: none)")
    from k3serve.cli.sim import add_sim_commands
    add_sim_commands(sim_sub)  # k3, calibrate, probe-disk, probe-cpu (the full-scale simulator)

    co = sub.add_parser("coactivation", help="per-layer co-activation maps of a trace, as .npy and heatmap .png")
    co.add_argument("trace", type=Path, help="routing trace (written by --trace-out)")
    co.add_argument("--out", type=cli_args.output_dir, required=True, help="folder for the maps")

    stats = sub.add_parser("routing-stats", help="expert popularity skew, reuse between tokens and next-layer "
                                                  "predictability of a model on text")
    stats.add_argument("--model", type=cli_args.model_path, default=None,
                       help="checkpoint folder (default: the embedded model)")
    group = stats.add_mutually_exclusive_group()
    group.add_argument("--text", type=Path, action="append", default=None,
                       help="text file to route (repeatable; each file is cut into --window-token windows)")
    group.add_argument("--heldout", choices=("code", "prose"), default=None,
                       help="the training corpus's held-out split of that kind (rebuilt from this machine; "
                            "default: code)")
    stats.add_argument("--tokens", type=cli_args.int_range(2), default=8192, help="at most this many tokens in all")
    stats.add_argument("--window", type=cli_args.int_range(2), default=512, help="tokens per independent sequence")
    stats.add_argument("--trace-out", type=cli_args.output_file, default=None,
                       help="also write the routing trace (default: none)")
    stats.add_argument("--json", type=cli_args.output_file, default=None,
                       help="also write the figures as JSON (default: none)")
    return {"pack": cmd_pack, "sim": cmd_sim, "coactivation": cmd_coactivation, "routing-stats": cmd_routing_stats}


SIM_POLICIES = ("none", "lru", "lfu", "s3fifo", "pinned", "belady")


def _capacities(text: str) -> list[str]:
    """--capacity: comma-separated positive expert counts or sizes (sizes become counts once the trace is read)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("needs at least one capacity")
    for part in parts:
        if part.isdigit():
            if int(part) < 1:
                raise argparse.ArgumentTypeError(f"capacities are at least 1 expert, got {part!r}")
        elif part.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"capacities are at least 1 expert, got {part!r}")
        else:
            cli_args.size(part)
    return parts


def _policies(text: str) -> list[str]:
    policies = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [p for p in policies if p not in SIM_POLICIES]
    if not policies or unknown:
        raise argparse.ArgumentTypeError(f"unknown polic{'ies' if len(unknown) > 1 else 'y'} "
                                         f"{', '.join(map(repr, unknown)) or repr(text)}; choose from "
                                         f"{', '.join(SIM_POLICIES)}")
    return policies


def _stripe_dirs(text: str) -> list[Path]:
    dirs = [Path(part) for part in text.split(",") if part.strip()]
    if not dirs:
        raise argparse.ArgumentTypeError(f"expected folders separated by commas, got {text!r}")
    return dirs


def cmd_pack(args: argparse.Namespace) -> int:
    from k3serve.loading.registry import of_path
    from k3serve.stream.trace import check_trace_model, read_trace
    from k3serve.weights.checkpoint import Checkpoint
    from k3serve.weights.family_store import is_family_store
    from k3serve.weights.gguf_file import GGUFFile, is_gguf_file
    from k3serve.weights.store import is_packed_store

    if args.out.resolve() == args.src.resolve():
        raise UsageError(f"pack would write into its source checkpoint {args.src}: give another output folder")
    if args.out.is_dir() and any(args.out.iterdir()):
        what = "a packed store" if is_packed_store(args.out) or is_family_store(args.out) else "files"
        raise UsageError(f"{args.out} already holds {what}: pack writes into a new or empty folder (remove it first, "
                         "or give another)")
    if is_family_store(args.src):
        raise UsageError(f"{args.src} is a packed family store already; pack its source checkpoint folder")
    architecture = of_path(args.src)
    from_gguf = is_gguf_file(args.src)
    if args.shard is not None and not architecture.expert_shards:
        raise UsageError(f"{args.src} is a family checkpoint: --shard (expert parallelism) is built for K3 "
                         "stores; pack it whole")
    if args.trunk_precision != "bf16" and args.shard is not None:
        raise UsageError(f"--trunk-precision {args.trunk_precision} quantizes a store's trunk; a shard holds "
                         "experts only")
    if args.trunk_precision not in ("bf16", "q8_0") and not architecture.routing_traces:
        raise UsageError(f"--trunk-precision {args.trunk_precision}: a family store holds its trunk as stored "
                         "(bf16) or as Q8_0 blocks (q8_0)")
    if not architecture.routing_traces:
        return _pack_family(args, architecture)
    if args.expert_precision not in ("native", "mxfp4"):
        raise UsageError(f"K3 experts ship as MXFP4; --expert-precision {args.expert_precision!r} applies to the "
                         "other families")
    if args.stripe is not None:
        if args.shard is not None:
            raise UsageError("--stripe lays out a whole store; a --shard is one node's experts: leave out one")
        for folder in args.stripe:
            if folder.resolve() == args.out.resolve():
                raise UsageError(f"--stripe {folder} is the output folder: give each drive's own folder")
    if args.shard is not None:
        if from_gguf:
            raise UsageError(f"{args.src} is a GGUF file: --shard (expert parallelism) reads safetensors checkpoint "
                             "folders; pack the file whole")
        return _pack_shard(args)
    token_sets = None
    if args.trace:  # checked against the source model before anything is written
        trace = read_trace(args.trace)
        with (Checkpoint.from_gguf(GGUFFile(args.src)) if from_gguf else Checkpoint(args.src)) as checkpoint:
            check_trace_model(trace, checkpoint.config, args.trace, "--trace")
        token_sets = trace.token_sets()
    with staged_folder(args.out) as staging:
        striping = {"stripe_dirs": args.stripe} if args.stripe is not None else {}
        store = architecture.pack(args.src, staging, args.expert_precision, layout=args.layout,
                                  token_sets=token_sets, trunk_precision=args.trunk_precision, **striping)
        summary = (f"layout {store.layout}, trunk {store.trunk_precision}, {store.num_experts_total} experts of "
                   f"{format_size(store.expert_blob_size)} "
                   f"(stride {format_size(store.expert_stride)}), expert store "
                   f"{format_size(store.expert_store_bytes)}, trunk {format_size(store.trunk_store_bytes)}")
        if args.stripe is not None:
            summary += (f", striped over {store.num_stripes} drives in chunks of "
                        f"{format_size(store.stripe_chunk_bytes)} (experts) and "
                        f"{format_size(store.trunk_stripe_chunk_bytes)} (trunk) "
                        f"({', '.join(str(f) for f in store.stripe_folders)})")
    print(f"packed {args.src} -> {args.out}: {summary}", file=sys.stderr)
    return 0


def _pack_shard(args: argparse.Namespace) -> int:
    from k3serve.weights.shard import ShardSpec, pack_shard

    if args.trace or args.layout != "natural":
        raise UsageError("--shard writes the shard's experts in natural order: leave out --layout and --trace")
    spec = ShardSpec.parse(args.shard)
    with staged_folder(args.out) as staging:
        shard = pack_shard(args.src, staging, spec)
        expert_bytes = shard.expert_path.stat().st_size
    print(f"packed shard {spec} of {args.src} -> {args.out}: experts {shard.owned.start}..{shard.owned.stop - 1} of "
          f"{len(shard.experts)} MoE layers, {shard.num_experts_total} blobs, {format_size(expert_bytes)}",
          file=sys.stderr)
    return 0


def _pack_family(args: argparse.Namespace, architecture) -> int:
    """`pack` of a family checkpoint: trunk resident at run time, experts at --expert-precision in the store."""
    if args.stripe is not None:
        raise UsageError(f"{args.src} is a family checkpoint: --stripe (several drives) is built for K3 stores; "
                         "pack it into one folder")
    if args.layout != "natural" or args.trace is not None:
        raise UsageError(f"{args.src} is a family checkpoint: its store keeps the experts in id order (--layout "
                         "natural, no --trace); the trace-driven layouts are built for K3 stores")
    with staged_folder(args.out) as staging:
        store = architecture.pack(args.src, staging, args.expert_precision, trunk_precision=args.trunk_precision)
        expert_bytes, trunk_bytes = store.expert_path.stat().st_size, store.trunk_path.stat().st_size
    print(f"packed {args.src} -> {args.out}: {store.model_type}, {store.num_experts_total} experts "
          f"({store.precision}, {store.kind} blobs of {format_size(store.expert_blob_size)}, stride "
          f"{format_size(store.expert_stride)}), expert store {format_size(expert_bytes)}, "
          f"trunk {format_size(trunk_bytes)}", file=sys.stderr)
    return 0


def cmd_sim(args: argparse.Namespace) -> int:
    from k3serve.sim.cache_replay import replay_all
    from k3serve.cli.sim import SIM_COMMANDS

    if args.sim_command in SIM_COMMANDS:
        return SIM_COMMANDS[args.sim_command](args)
    from k3serve.stream.trace import prefill_only, read_trace

    trace = read_trace(args.trace)
    if prefill_only(trace):
        print(f"k3serve: warning: {args.trace} holds no decode step (every step routes many tokens at once, as "
              "`routing-stats` records its windows): each request is the union of a whole window's experts, so these "
              "figures say little about a decode cache; record a generation with --trace-out instead",
              file=sys.stderr)
    expert_bytes = int(trace.meta.get("expert_bytes", 1))
    capacities = [int(part) if part.isdigit() else max(1, parse_size(part) // expert_bytes) for part in args.capacity]
    policies = args.policies
    requests = trace.requests()
    tokens = trace.num_tokens
    top_k = int(trace.meta.get("top_k", 1))
    results = replay_all(requests, capacities, tokens, expert_bytes, policies, working_slots=top_k)
    print(f"trace {args.trace}: {tokens} tokens, {len(requests)} layer requests, "
          f"{sum(len(r[2]) for r in requests)} expert requests, expert blob {format_size(expert_bytes)}")
    print(f"{'capacity':>9} {'policy':>8} {'retention':>10} {'read/token':>12} {'vs belady':>10}")
    best = {r.capacity: r for r in results if r.policy == "belady"}
    for r in results:
        ratio = r.bytes_per_token / best[r.capacity].bytes_per_token if r.capacity in best and \
            best[r.capacity].bytes_per_token else float("nan")
        print(f"{r.capacity:>9} {r.policy:>8} {100 * r.retention:>9.1f}% {format_size(r.bytes_per_token):>12} "
              f"{ratio:>9.2f}x")
    if args.json:
        write_text(args.json, json.dumps([{**r.__dict__, "retention": r.retention,
                                          "bytes_per_token": r.bytes_per_token} for r in results], indent=1))
    return 0


def cmd_coactivation(args: argparse.Namespace) -> int:
    from k3serve.cli.heatmap import heatmap_rgb, write_png
    from k3serve.stream.trace import read_trace
    from k3serve.weights.layout import adjacency_score, coactivation_matrix, coactivation_order

    trace = read_trace(args.trace)
    num_experts = int(trace.meta["num_experts"])
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for layer, sets in sorted(trace.token_sets().items()):
        matrix = coactivation_matrix(sets, num_experts)
        # each output whole or absent (atomic_file.py): a full disk or Ctrl-C leaves no torn .npy or .png
        with atomic_output(args.out / f"layer_{layer:03d}.npy") as staging, open(staging, "wb") as file:
            np.save(file, matrix)
        with atomic_output(args.out / f"layer_{layer:03d}.png") as staging:
            write_png(staging, heatmap_rgb(matrix, cell=max(1, 512 // num_experts)))
        order = coactivation_order(matrix)
        summary[layer] = {"tokens": len(sets), "natural_adjacency": adjacency_score(range(num_experts), matrix),
                          "chain_adjacency": adjacency_score(order, matrix), "chain_order": order}
    write_text(args.out / "summary.json", json.dumps(summary, indent=1))
    print(f"wrote {len(summary)} layers to {args.out} (layer_LLL.npy counts, layer_LLL.png heatmaps, summary.json)",
          file=sys.stderr)
    return 0


def routing_windows(tokenizer, texts: list[str], window: int, max_tokens: int) -> list[list[int]]:
    """Cut each text's token ids into windows of `window` tokens (a shorter tail kept if > 1), up to max_tokens."""
    if window < 2 or max_tokens < 2:
        raise K3Error("--window and --tokens must be at least 2")
    out: list[list[int]] = []
    total = 0
    for text in texts:
        ids = tokenizer.encode(text)
        for start in range(0, len(ids), window):
            piece = ids[start:start + window][:max_tokens - total]
            if len(piece) < 2:
                break
            out.append(piece)
            total += len(piece)
            if total >= max_tokens:
                return out
    return out


def _routing_progress(done: int, total: int) -> None:
    print(f"[{100 * done / total:5.1f}%] routed {done:,} of {total:,} tokens", file=sys.stderr, flush=True)


def cmd_routing_stats(args: argparse.Namespace) -> int:
    from k3serve.loading import load_model
    from k3serve.lab.routing_stats import measure_routing
    from k3serve.stream.trace import TraceWriter, trace_meta

    loaded = load_model(args.model)
    if loaded.tokenizer is None:
        raise K3Error(f"{args.model} has no tokenizer; routing-stats needs text")
    if args.text:
        texts = []
        for path in args.text:
            try:
                texts.append(path.read_text())
            except (OSError, UnicodeDecodeError) as exc:
                raise K3Error(f"cannot read {path}: {exc}") from exc
        source = ", ".join(str(p) for p in args.text)
    else:
        from k3serve.training.corpus import build_corpus

        kind = args.heldout or "code"
        corpus = build_corpus()
        texts = corpus.heldout_code if kind == "code" else corpus.heldout_prose
        source = f"held-out {kind} ({'stdlib' if kind == 'code' else corpus.prose_source})"
        if kind == "prose":  # many short documents: route them as one stream of windows
            texts = ["".join(texts)]
    windows = routing_windows(loaded.tokenizer, texts, args.window, args.tokens)
    if not windows:
        raise K3Error("no text to route (empty input)")
    with contextlib.ExitStack() as outputs:  # the trace is written beside its name and renamed when whole
        writer = None
        if args.trace_out:
            staging = outputs.enter_context(atomic_output(args.trace_out))
            writer = TraceWriter(staging, trace_meta(loaded.model.config))
            outputs.callback(writer.close)
        report = measure_routing(loaded.model, windows, writer, progress=_routing_progress)
    print(f"routing of {args.model or 'the embedded model'} on {source}: {report.num_tokens} tokens in "
          f"{len(windows)} windows, {report.num_experts} experts top-{report.top_k}")
    print(report.table())
    if args.json:
        write_text(args.json, json.dumps({"source": source, "num_tokens": report.num_tokens,
                                         "num_experts": report.num_experts, "top_k": report.top_k,
                                         "layers": [l.__dict__ for l in report.layers]}, indent=1) + "\n")
    return 0
