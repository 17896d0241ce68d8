"""Expert throughput on one drive vs the same store striped over two (`k3serve pack --stripe`), each drive an
emulated disk of the same speed: a loop device (ext4 on a file in /tmp) throttled by cgroup-v1 blkio.

    sudo .venv/bin/python benchmarks/bench_stripe.py --bps 100M --json out.json

What is timed: the engine's own expert path (`StreamingSource.experts`: the slots, the cache with policy none so
every request reads, the reader with `--queue-depth` workers per drive, the CRC-32 check) over decode-like steps:
each MoE layer asks for `--top-k` random experts (fixed seed), one layer after another, `--tokens` steps. Reads
are O_DIRECT, so every byte passes the block layer and its throttle (the page cache never serves them). Figure:
expert bytes read / seconds, median of `--repeats` runs, the one-drive and two-drive runs alternated, each a fresh
process in the throttled cgroup.

Fixture (built once under `--dir`): a random K3 checkpoint with the tiny oracle's trunk and `--experts` experts of
`--inner` x `--latent` per layer (0.84 MB blobs by default), packed `--stripe A` (one drive) and `--stripe A,B`.
The loop devices, mounts and the cgroup (its limits first) are removed afterwards, also on failure, Ctrl-C or a kill.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throttle import Throttle, parse_rate  # noqa: E402


# ------------------------------------------------------------------------------------------------ drives
def _run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


@contextmanager
def loop_drive(image: Path, mount: Path, size: int) -> Iterator[Path]:
    """An ext4 file system on a loop device backed by `image`, mounted at `mount`; all undone on exit."""
    with ExitStack() as undo:
        with open(image, "wb") as f:
            f.truncate(size)
        undo.callback(image.unlink, missing_ok=True)
        device = _run("losetup", "-f", "--show", str(image))
        undo.callback(subprocess.run, ["losetup", "-d", device], check=False)
        _run("mkfs.ext4", "-q", "-F", device)
        mount.mkdir(parents=True, exist_ok=True)
        _run("mount", device, str(mount))
        undo.callback(subprocess.run, ["umount", str(mount)], check=False)
        print(f"drive {device} ({size >> 20} MiB) at {mount}", file=sys.stderr)
        yield mount


# ------------------------------------------------------------------------------------------------ fixture
def build_checkpoint(folder: Path, experts: int, inner: int, latent: int, top_k: int) -> Path:
    from k3serve.config import tiny_config
    from k3serve.weights.synthetic import write_random_checkpoint

    checkpoint = folder / f"checkpoint-e{experts}-i{inner}-l{latent}"
    if not (checkpoint / "config.json").exists():
        config = dataclasses.replace(tiny_config(), num_experts=experts, num_experts_per_token=top_k,
                                     moe_intermediate_size=inner, latent_size=latent)
        print(f"writing the fixture checkpoint {checkpoint} (once)...", file=sys.stderr)
        staging = checkpoint.with_name(checkpoint.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        write_random_checkpoint(config, staging, seed=0)
        staging.rename(checkpoint)
    return checkpoint


# ------------------------------------------------------------------------------------------------ one run
def measure(store_path: Path, tokens: int, top_k: int, queue_depth: int, seed: int) -> dict:
    """Runs inside the throttled cgroup: the expert path over `tokens` decode-like steps."""
    import numpy as np

    from k3serve.stream.options import StreamOptions
    from k3serve.stream.source import StreamingSource
    from k3serve.weights.store import PackedStore

    store = PackedStore(store_path)
    source = StreamingSource(store, StreamOptions(ram_budget=None, io="direct", cache="none",
                                                  queue_depth=queue_depth, prefetch="none"))
    rng = np.random.default_rng(seed)
    layers = list(store.config.moe_layer_ids)
    ne = store.config.num_experts
    steps = [[rng.choice(ne, top_k, replace=False).tolist() for _ in layers] for _ in range(tokens)]
    before = source.expert_io.counters.bytes_read
    started = time.perf_counter()
    for step in steps:
        source.begin_step(1)
        for layer, ids in zip(layers, step):
            loaded = source.experts(layer, ids)
            for expert in ids:
                loaded[expert]
    seconds = time.perf_counter() - started
    nbytes = source.expert_io.counters.bytes_read - before
    drives = source.expert_io.drive_counters() if hasattr(source.expert_io, "drive_counters") \
        else [source.expert_io.counters]
    source.close()
    return {"store": str(store_path), "drives": store.num_stripes, "seconds": seconds, "expert_bytes": nbytes,
            "mb_per_s": nbytes / seconds / 1e6, "bytes_per_drive": [c.bytes_read for c in drives],
            "reads_per_drive": [c.num_reads for c in drives]}


def run_throttled(throttle: Throttle, store: Path, args: argparse.Namespace, seed: int) -> dict:
    command = [sys.executable, __file__, "--measure", str(store), "--tokens", str(args.tokens), "--top-k",
               str(args.top_k), "--queue-depth", str(args.queue_depth), "--seed", str(seed)]
    out = subprocess.run(throttle.wrap(command), check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/k3bench-stripe"), help="fixture and drive images")
    parser.add_argument("--bps", default="100M", help="each drive's read rate (default 100M bytes/s)")
    parser.add_argument("--experts", type=int, default=16, help="experts per layer (default 16)")
    parser.add_argument("--inner", type=int, default=1024, help="expert intermediate size (default 1024)")
    parser.add_argument("--latent", type=int, default=512, help="expert latent size (default 512)")
    parser.add_argument("--top-k", type=int, default=4, help="experts each layer asks for per step (default 4)")
    parser.add_argument("--tokens", type=int, default=12, help="decode-like steps per run (default 12)")
    parser.add_argument("--queue-depth", type=int, default=4, help="reader workers per drive (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each store, alternated (default 3)")
    parser.add_argument("--drive-size", default="512M", help="each loop drive's size (default 512M)")
    parser.add_argument("--json", type=Path, default=None, help="write every run and the summary as JSON")
    parser.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.tokens, args.top_k, args.queue_depth, args.seed)))
        return 0
    if os.geteuid() != 0:
        parser.error("needs root (loop devices, mounts and the blkio cgroup)")
    # a kill (SIGTERM) unwinds like Ctrl-C does, so the mounts and loop devices are removed either way
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from k3serve.weights.pack import pack_checkpoint

    args.dir.mkdir(parents=True, exist_ok=True)
    checkpoint = build_checkpoint(args.dir, args.experts, args.inner, args.latent, args.top_k)
    bps = parse_rate(args.bps)
    size = parse_rate(args.drive_size)
    runs: list[dict] = []
    with ExitStack() as stack:
        drives = [stack.enter_context(loop_drive(args.dir / f"drive{k}.img", args.dir / f"mnt{k}", size))
                  for k in range(2)]
        stores = {1: args.dir / "store-1drive", 2: args.dir / "store-2drives"}
        for count, store in stores.items():
            shutil.rmtree(store, ignore_errors=True)
            stack.callback(shutil.rmtree, store, ignore_errors=True)  # its stripes go with the drives
            pack_checkpoint(checkpoint, store, stripe_dirs=drives[:count])
        throttle = Throttle(drives, bps, None, name="k3stripe")
        stack.callback(lambda: throttle.blkio.exists() and throttle.blkio.rmdir())  # after the limits are lifted
        stack.enter_context(throttle)
        print(f"throttle: devices {throttle.device}, each {args.bps} B/s read", file=sys.stderr)
        for repeat in range(args.repeats):
            for count, store in stores.items():
                record = run_throttled(throttle, store, args, seed=repeat)
                runs.append(record)
                print(f"run {repeat + 1}: {count} drive(s): {record['mb_per_s']:.1f} MB/s "
                      f"({record['expert_bytes'] / 1e6:.1f} MB in {record['seconds']:.2f} s; per drive "
                      f"{[round(b / 1e6, 1) for b in record['bytes_per_drive']]} MB)", file=sys.stderr)
    one = statistics.median(r["mb_per_s"] for r in runs if r["drives"] == 1)
    two = statistics.median(r["mb_per_s"] for r in runs if r["drives"] == 2)
    summary = {"bps_per_drive": bps, "one_drive_mb_per_s": one, "two_drives_mb_per_s": two, "ratio": two / one,
               "queue_depth_per_drive": args.queue_depth, "top_k": args.top_k, "tokens": args.tokens,
               "repeats": args.repeats}
    print(f"expert throughput: one drive {one:.1f} MB/s, two drives {two:.1f} MB/s: {two / one:.2f}x "
          f"(each drive {args.bps} B/s, O_DIRECT, median of {args.repeats})")
    print(json.dumps(summary))
    if args.json is not None:
        args.json.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
