"""`k3serve sim k3 | cluster | calibrate | probe-disk | probe-cpu`: the full-scale simulator's command line (wired into
`k3serve sim` beside `sim cache`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k3serve.atomic_file import write_text
from k3serve.units import format_size, parse_size

RAM_LADDER = ("8G", "16G", "32G", "64G", "128G")


def add_sim_commands(sim_sub) -> None:
    from k3serve.cli import args as cli_args

    d = " (default: %(default)s)"
    k3 = sim_sub.add_parser("k3", help="simulate the full K3 (2.78T) through k3serve's streaming code on a machine")
    k3.add_argument("--ram", default="32G", help="RAM budget for weights, e.g. 8G, or 'unlimited'; "
                    + cli_args.SIZE_UNITS + d)
    k3.add_argument("--machine", default="laptop",
                    help="a preset (c-engine, c-engine-v1, laptop, this-machine) or a machine file (.json/.toml)" + d)
    k3.add_argument("--engine", choices=("k3serve", "c-engine"), default="k3serve", help="engine profile" + d)
    k3.add_argument("--policy", default="lfu", help="expert cache policy: none, lru, lfu, s3fifo, pinned" + d)
    k3.add_argument("--prefetch", choices=("none", "next-layer"), default="none",
                    help="prefetch mode, the engine's default unless given" + d)
    k3.add_argument("--prefetch-max", type=cli_args.non_negative_int, default=None,
                    help="guesses per layer (default: top-k)")
    k3.add_argument("--layout", choices=("natural", "frequency", "coactivation"), default="natural",
                    help="expert order on disk" + d)
    k3.add_argument("--pin-trunk", type=cli_args.size, default=None,
                    help="cap on pinned trunk bytes, moves the trunk/cache split (default: as much as fits)")
    k3.add_argument("--queue-depth", type=cli_args.int_range(1, 1024), default=16, help="I/O queue depth" + d)
    k3.add_argument("--drives", type=cli_args.int_range(1, 64), default=1,
                    help="the store striped over this many drives, each the machine's disk (pack --stripe)" + d)
    k3.add_argument("--trunk-dtype", choices=("float32", "bf16", "q8_0", "mxfp4"), default="bf16",
                    help="how k3serve holds the trunk in RAM (the engine's --trunk-dtype; q8_0 / mxfp4: a store "
                         "packed with --trunk-precision, 34 / 17 bytes per 32 weights)" + d)
    k3.add_argument("--batch", type=cli_args.positive_int, default=1, help="sequences decoded together" + d)
    k3.add_argument("--speculative", type=cli_args.non_negative_int, default=0,
                    help="draft tokens per step, 0 = off" + d)
    k3.add_argument("--acceptance", type=cli_args.float_range(0.0, 0.999), default=0.7,
                    help="per-draft-token acceptance when speculating" + d)
    k3.add_argument("--tokens", type=cli_args.positive_int, default=4, help="decode steps measured" + d)
    k3.add_argument("--warmup", type=cli_args.non_negative_int, default=1, help="decode steps before measuring" + d)
    k3.add_argument("--routing", choices=("skewed", "flat"), default="skewed", help="synthetic routing" + d)
    k3.add_argument("--routing-trace", type=Path, default=None,
                    help="fit the skewed routing from this trace, from routing-stats --trace-out (default: none)")
    k3.add_argument("--recall", type=cli_args.float_range(0.0, 1.0), default=None,
                    help="next-layer guess recall (default: the measured 65%%)")
    k3.add_argument("--c-pinned", type=cli_args.non_negative_int, default=None,
                    help="c-engine: pinned layers (default: none given)")
    k3.add_argument("--c-cache", type=cli_args.size, default=None, help="c-engine: expert cache size (default: none given)")
    k3.add_argument("--seed", type=cli_args.seed, default=0, help="routing seed" + d)
    kept = k3.add_mutually_exclusive_group()
    kept.add_argument("--expert-top-p", type=float, choices=(0.9, 0.8, 0.7), default=None,
                      help="keep experts as --expert-top-p P (min 2) kept them on the embedded model, scaled to 16 "
                           "(docs/STREAMING.md) (default: all 16)")
    kept.add_argument("--experts-kept", type=cli_args.float_range(1.0, 16.0), default=None,
                      help="keep this mean number of the 16 experts per token and layer (colibri's K3_TOPP=0.7: "
                           "8.1) (default: all 16)")
    k3.add_argument("--speculative-io-aware", action="store_true",
                    help="choose k <= --speculative from the measured bytes per window position against "
                         "--acceptance, as the engine's --speculative-io-aware does")
    k3.add_argument("--prompt-tokens", type=cli_args.non_negative_int, default=0,
                    help="prefill a prompt of this many tokens first and report its expert bytes per token" + d)
    k3.add_argument("--prefill-chunk", type=cli_args.positive_int, default=None,
                    help="prompt positions per prefill step (1: token at a time; default: the whole prompt)")
    k3.add_argument("--price-per-hour", type=cli_args.float_range(0.0), default=None,
                    help="$ per machine-hour for the cost line (default: $1, an assumption; docs/SIMULATOR.md)")
    k3.add_argument("--timeline", action="store_true", help="print the per-layer timeline")
    k3.add_argument("--sweep", choices=("ram",), default=None, help="run the memory ladder 8..128G (default: off)")
    k3.add_argument("--plot", type=cli_args.output_file, default=None,
                    help="with --sweep ram: write the ladder as SVG (default: none)")
    k3.add_argument("--json", type=cli_args.output_file, default=None, help="write the figures as JSON (default: none)")

    cl = sim_sub.add_parser("cluster", help="simulate the full K3 with expert parallelism over N boxes (a table: one "
                                            "row per nodes x RAM x front RAM x network)")
    cl.add_argument("--nodes", default="8", help="expert owner boxes, comma-separated; each must divide 896" + d)
    cl.add_argument("--ram", default="8G", help="each owner's RAM for its expert cache, comma-separated" + d)
    cl.add_argument("--front-ram", default="16G",
                    help="the front box's RAM (trunk, globals), comma-separated, or 'unlimited'" + d)
    cl.add_argument("--network", default="10gbe",
                    help="link presets (10gbe, 25gbe, 100gbe), comma-separated, or 'machine' (its [network])" + d)
    cl.add_argument("--machine", default="laptop",
                    help="every box: a preset (c-engine, c-engine-v1, laptop, this-machine) or a machine file" + d)
    cl.add_argument("--node-policy", default="lru", help="owners' cache policy: none, lru, lfu, s3fifo" + d)
    cl.add_argument("--trunk-dtype", choices=("float32", "bf16"), default="bf16", help="the front's trunk" + d)
    cl.add_argument("--batch", type=cli_args.positive_int, default=1, help="sequences decoded together" + d)
    cl.add_argument("--tokens", type=cli_args.positive_int, default=4, help="decode steps measured" + d)
    cl.add_argument("--warmup", type=cli_args.non_negative_int, default=12,
                    help="decode steps before measuring (the owners' caches fill)" + d)
    cl.add_argument("--routing", choices=("skewed", "flat"), default="skewed", help="synthetic routing" + d)
    cl.add_argument("--seed", type=cli_args.seed, default=0, help="routing seed" + d)
    cl.add_argument("--plot", type=cli_args.output_file, default=None,
                    help="write s/token by nodes as SVG (default: none)")
    cl.add_argument("--json", type=cli_args.output_file, default=None, help="write every row as JSON (default: none)")

    ro = sim_sub.add_parser("router", help="the cluster's router over N modelled replicas: cache-aware against "
                                           "round-robin prefix hit rate on a shared-prefix workload (a table: one "
                                           "row per replicas x questions per group x checkpoints x policy)")
    ro.add_argument("--replicas", default="2,4", help="replicas, comma-separated" + d)
    ro.add_argument("--per-group", default="4,8", help="questions per prefix group, comma-separated" + d)
    ro.add_argument("--checkpoints", default="8,16",
                    help="KDA state checkpoint slots per replica (the prefix cache), comma-separated" + d)
    ro.add_argument("--policy", default="slru", help="prefix-cache replacement, comma-separated: lru, slru" + d)
    ro.add_argument("--groups", type=cli_args.positive_int, default=16, help="prefix groups (one tenant each)" + d)
    ro.add_argument("--system-tokens", type=cli_args.positive_int, default=128, help="shared prefix length" + d)
    ro.add_argument("--question-tokens", type=cli_args.positive_int, default=32, help="question length" + d)
    ro.add_argument("--reply-tokens", type=cli_args.non_negative_int, default=24, help="reply length" + d)
    ro.add_argument("--clients", type=cli_args.positive_int, default=8, help="closed-loop clients" + d)
    ro.add_argument("--baseline", choices=("round-robin", "least-load", "power-of-two"), default="round-robin",
                    help="the router cache-aware is compared with" + d)
    ro.add_argument("--no-prefix-wait", action="store_true",
                    help="model the engine with --prefix-wait-tokens 0 (no in-flight prefix sharing)")
    ro.add_argument("--seeds", type=cli_args.int_range(1, 100), default=5,
                    help="workload orders (seeds seed..seed+N-1); the ratio is their median" + d)
    ro.add_argument("--seed", type=cli_args.seed, default=0, help="first workload seed" + d)
    ro.add_argument("--json", type=cli_args.output_file, default=None, help="write every row as JSON (default: none)")

    cal = sim_sub.add_parser("calibrate", help="the C engine's published K3 figures beside the simulator's")
    cal.add_argument("--routing", choices=("flat", "skewed"), default="flat", help="synthetic routing" + d)
    cal.add_argument("--device", choices=("as-recorded", "preset"), default="as-recorded",
                     help="trunk reads at the rate each run recorded, or the preset's curve for every run" + d)
    cal.add_argument("--json", type=cli_args.output_file, default=None, help="write the table as JSON (default: none)")

    disk = sim_sub.add_parser("probe-disk", help="O_DIRECT throughput by request size and queue depth")
    disk.add_argument("path", type=Path, help="a large existing file on the disk to measure")
    disk.add_argument("--sizes", default="4K,64K,1M,4M,16M", help="request sizes" + d)
    disk.add_argument("--queue-depths", default="1,4,16", help="concurrent requests" + d)
    disk.add_argument("--seconds", type=cli_args.float_range(0.01, 10.0), default=0.3,
                      help="per point; keep it short, the disk is shared" + d)
    disk.add_argument("--out", type=cli_args.output_file, default=None,
                      help="write the disk table as JSON (default: none)")

    cpu = sim_sub.add_parser("probe-cpu", help="the engine's kernels in bytes/s and FLOP/s")
    cpu.add_argument("--out", type=cli_args.output_file, default=None,
                     help="write the compute table as JSON (default: none)")


def _ram(text: str) -> int | None:
    return None if text.lower() in ("unlimited", "none") else parse_size(text)


def _sim_config(args: argparse.Namespace, ram: int | None):
    from k3serve.config import full_k3_config
    from k3serve.sim.full import SimConfig
    from k3serve.sim.presets import resolve_machine
    from k3serve.sim.routing import fit_routing
    from k3serve.stream.trace import read_trace

    routing_model = None
    if args.routing_trace is not None:
        c = full_k3_config()
        fit = fit_routing(read_trace(args.routing_trace), c.num_experts, c.num_experts_per_token, args.recall,
                          seed=args.seed)
        print("\n".join(fit.lines()), file=sys.stderr)
        routing_model = fit.model
    return SimConfig(
        machine=resolve_machine(args.machine), ram_bytes=ram, engine=args.engine, policy=args.policy,
        prefetch=args.prefetch, prefetch_max=args.prefetch_max, layout=args.layout,
        pin_trunk_bytes=parse_size(args.pin_trunk) if args.pin_trunk else None, queue_depth=args.queue_depth,
        trunk_dtype=args.trunk_dtype, batch=args.batch, speculative=args.speculative, acceptance=args.acceptance,
        tokens=args.tokens, warmup=args.warmup, routing=args.routing, routing_model=routing_model, seed=args.seed,
        pinned_layers=args.c_pinned, cache_bytes=parse_size(args.c_cache) if args.c_cache else None,
        experts_kept=_experts_kept(args), prompt_tokens=args.prompt_tokens,
        speculative_io_aware=args.speculative_io_aware, prefill_chunk=args.prefill_chunk,
        drives=args.drives, **({} if args.price_per_hour is None else {"price_per_hour": args.price_per_hour}))


def _experts_kept(args: argparse.Namespace) -> tuple[float, ...]:
    from k3serve.config import full_k3_config
    from k3serve.sim.routing import MEASURED_KEPT, kept_from_histogram, kept_from_mean

    top_k = full_k3_config().num_experts_per_token
    if args.experts_kept is not None:
        return kept_from_mean(args.experts_kept, top_k)
    if args.expert_top_p is not None:
        measured_top_k, histogram = MEASURED_KEPT[args.expert_top_p]
        return kept_from_histogram(histogram, measured_top_k, top_k)
    return ()


def cmd_sim_k3(args: argparse.Namespace) -> int:
    from k3serve.sim.full import simulate
    from k3serve.sim.plot import line_chart
    from k3serve.stream.budget import BudgetError

    if args.sweep == "ram":
        records, points = [], []
        for size in RAM_LADDER:
            try:
                r = simulate(_sim_config(args, parse_size(size)))
            except BudgetError as exc:
                print(f"{size:>6}: does not run: {exc}")
                records.append({"ram": size, "error": str(exc)})
                continue
            print(f"{size:>6}: {r.s_per_token:8.3f} s/token, {format_size(r.bytes_per_token)}/token, "
                  f"{r.reads_per_token:.0f} reads, I/O {r.io_seconds_per_token:.2f} s, compute "
                  f"{r.compute_seconds_per_token:.2f} s")
            records.append({"ram": size, **r.to_dict()})
            points.append((parse_size(size) / 2**30, r.s_per_token))
        if args.plot is not None and points:
            write_text(args.plot, line_chart(f"full K3 on {args.machine}: s/token by RAM", "RAM (GiB)", "s/token",
                                            {f"{args.engine} {args.policy}": points}))
        if args.json:
            write_text(args.json, json.dumps(records, indent=1))
        return 0
    r = simulate(_sim_config(args, _ram(args.ram)))
    print("\n".join(r.lines()))
    if args.timeline:
        print("\n".join(r.timeline_lines()))
    if args.json:
        write_text(args.json, json.dumps(r.to_dict(), indent=1))
    return 0


def _limit(r) -> str:
    """What the largest share of a cluster token's time goes to."""
    f = r.front
    parts = {"front trunk reads": f.io_seconds_per_token, "front compute": f.compute_seconds_per_token,
             "owners' expert reads and compute": r.owner_wait_seconds_per_token - r.network_seconds_per_token,
             "network and call latency": r.network_seconds_per_token}
    return max(parts, key=parts.get)


def cmd_sim_cluster(args: argparse.Namespace) -> int:
    from k3serve.sim.cluster import ClusterConfig, simulate_cluster
    from k3serve.sim.full import SimConfig
    from k3serve.sim.plot import line_chart
    from k3serve.sim.presets import resolve_machine, resolve_network
    from k3serve.stream.budget import BudgetError

    def listed(text: str) -> list[str]:
        return [part.strip() for part in text.split(",") if part.strip()]

    machine = resolve_machine(args.machine)
    nodes = [_whole_number(n, "--nodes") for n in listed(args.nodes)]
    networks = {name: (None if name == "machine" else resolve_network(name)) for name in listed(args.network)}
    print(f"{'nodes':>5} {'RAM':>5} {'front':>6} {'network':>8} {'s/token':>8} {'trunk read':>10} "
          f"{'expert read/node':>16} {'retention':>9} {'network/token':>13} {'owners wait':>11} "
          f"{'net s':>6}  limit")
    records, series = [], {}
    for front_ram in listed(args.front_ram):
        for ram in listed(args.ram):
            for name, link in networks.items():
                for n in nodes:
                    front = SimConfig(machine=machine, ram_bytes=_ram(front_ram), prefetch="none",
                                      trunk_dtype=args.trunk_dtype, batch=args.batch, tokens=args.tokens,
                                      warmup=args.warmup, routing=args.routing, seed=args.seed)
                    cell = {"num_nodes": n, "ram": ram, "front_ram": front_ram, "link": name}
                    try:
                        r = simulate_cluster(ClusterConfig(front, n, _ram(ram), link, node_policy=args.node_policy))
                    except BudgetError as exc:
                        print(f"{n:>5} {ram:>5} {front_ram:>6} {name:>8}  does not run: {exc}")
                        records.append({**cell, "error": str(exc)})
                        continue
                    node_bytes = max(x.expert_bytes_per_token for x in r.nodes)
                    retention = sum(x.retention for x in r.nodes) / len(r.nodes)
                    print(f"{n:>5} {ram:>5} {front_ram:>6} {name:>8} {r.s_per_token:>8.3f} "
                          f"{format_size(r.front.trunk_bytes_per_token):>10} {format_size(node_bytes):>16} "
                          f"{retention:>9.2f} {format_size(r.network_bytes_per_token):>13} "
                          f"{r.owner_wait_seconds_per_token:>10.3f}s {r.network_seconds_per_token:>6.3f}  {_limit(r)}")
                    record = {**cell, "limit": _limit(r), **r.to_dict()}
                    del record["front"]["timeline"]  # per layer: --json of `sim k3` has it for one configuration
                    records.append(record)
                    series.setdefault(f"{ram}/node, front {front_ram}, {name}", []).append((n, r.s_per_token))
    if args.plot is not None and series:
        first_link = next(iter(networks))
        write_text(args.plot, line_chart(f"full K3, expert parallelism on {args.machine} boxes: s/token by owners",
                                        "expert owner boxes", "s/token", series,
                                        dashed=[n for n in series if not n.endswith(f", {first_link}")]))
    if args.json:
        write_text(args.json, json.dumps(records, indent=1))
    return 0


def _whole_number(text: str, flag: str) -> int:
    from k3serve.errors import UsageError

    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{flag} takes whole numbers, comma-separated, got {text!r}") from None


def cmd_sim_router(args: argparse.Namespace) -> int:
    import statistics

    from k3serve.errors import ConfigError, UsageError
    from k3serve.sim.router import RouterSimConfig, ratio_row

    def numbers(text: str, flag: str) -> list[int]:
        values = [_whole_number(part.strip(), flag) for part in text.split(",") if part.strip()]
        if not values or min(values) < 1:
            raise UsageError(f"{flag} takes positive whole numbers, comma-separated, got {text!r}")
        return values

    policies = [part.strip() for part in args.policy.split(",") if part.strip()]
    configs = []
    try:
        for replicas in numbers(args.replicas, "--replicas"):
            for per_group in numbers(args.per_group, "--per-group"):
                for checkpoints in numbers(args.checkpoints, "--checkpoints"):
                    for policy in policies:
                        configs.append(RouterSimConfig(
                            replicas=replicas, checkpoints=checkpoints, policy=policy, groups=args.groups,
                            per_group=per_group, system_tokens=args.system_tokens,
                            question_tokens=args.question_tokens, reply_tokens=args.reply_tokens,
                            clients=args.clients, prefix_wait=not args.no_prefix_wait, seed=args.seed))
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    print(f"shared-prefix workload: {args.groups} groups, {args.system_tokens}-token system prompts, "
          f"{args.question_tokens}-token questions, {args.reply_tokens}-token replies, {args.clients} clients; "
          f"median over {args.seeds} workload seeds (simulated: docs/CLUSTER.md)")
    print(f"{'replicas':>8} {'per group':>9} {'checkpoints':>11} {'policy':>6} {'cache-aware':>11} "
          f"{args.baseline:>12} {'ratio':>6}  (lowest-highest seed)")
    rows = []
    for config in configs:
        row = ratio_row(config, args.baseline, args.seeds)
        rows.append(row.as_dict())
        ratios = row.ratios
        print(f"{config.replicas:>8} {config.per_group:>9} {config.checkpoints:>11} {config.policy:>6} "
              f"{statistics.median(row.cache_aware):>11.3f} {statistics.median(row.other):>12.3f} "
              f"{statistics.median(ratios):>5.2f}x  ({min(ratios):.2f}-{max(ratios):.2f})")
    if args.json:
        write_text(args.json, json.dumps({"simulated": "k3serve sim router", "args": {
            k: v for k, v in vars(args).items() if k not in ("json", "func")}, "rows": rows}, indent=1, default=str))
    return 0


def cmd_sim_calibrate(args: argparse.Namespace) -> int:
    from k3serve.sim.calibrate import calibration, cold_token_figures, table_lines

    def progress(done: int, total: int, label: str) -> None:
        print(f"[{100 * done / total:5.1f}%] simulated {done} of {total} published runs ({label})", file=sys.stderr,
              flush=True)

    reads, gb = cold_token_figures()
    print(f"cold token: {reads:.0f} expert reads, {gb:.2f} GB (C engine: 1,472 and 25.83 GB)", flush=True)
    rows = calibration(args.routing, args.device, progress=progress)
    print("\n".join(table_lines(rows)))
    if args.json:
        write_text(args.json, json.dumps({"cold_reads": reads, "cold_gb": gb,
                                         "rows": [r.__dict__ | {"error": r.error} for r in rows]}, indent=1))
    return 0


def cmd_sim_probe_disk(args: argparse.Namespace) -> int:
    from k3serve.sim.probe import probe_disk

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    qds = [int(q) for q in args.queue_depths.split(",")]
    disk = probe_disk(args.path, sizes, qds, args.seconds)
    print(f"{'size':>10} " + " ".join(f"{'QD' + str(q):>10}" for q in qds) + "   (MB/s, O_DIRECT)")
    for s, row in zip(disk.sizes, disk.throughput):
        print(f"{format_size(s):>10} " + " ".join(f"{v / 1e6:>10.0f}" for v in row))
    if args.out:
        write_text(args.out, json.dumps({"sizes": list(disk.sizes), "queue_depths": list(disk.queue_depths),
                                        "throughput": [list(r) for r in disk.throughput],
                                        "path": str(args.path)}, indent=1))
    return 0


def cmd_sim_probe_cpu(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from k3serve.sim.probe import probe_cpu

    compute, raw = probe_cpu()
    for key, value in asdict(compute).items():
        print(f"{key:<28} {value:.4g}")
    if args.out:
        write_text(args.out, json.dumps({"compute": asdict(compute), "raw": raw}, indent=1))
    return 0


SIM_COMMANDS = {"k3": cmd_sim_k3, "cluster": cmd_sim_cluster, "router": cmd_sim_router, "calibrate": cmd_sim_calibrate,
                "probe-disk": cmd_sim_probe_disk, "probe-cpu": cmd_sim_probe_cpu}
