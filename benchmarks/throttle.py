"""Run a command with its reads throttled by the cgroup-v1 blkio controller: an emulated slower disk.

    python benchmarks/throttle.py --path /tmp/k3bench-trained --bps 200M --iops 4000 -- python bench.py ...

The limits (`blkio.throttle.read_bps_device`, `blkio.throttle.read_iops_device`) apply to the whole block device
that holds `--path`, for every process in the cgroup `/sys/fs/cgroup/blkio/<name>`; the command is moved into it
before it starts (and, with `--memory`, into a memory cgroup of that size too, page cache included). Per-device
mode: `--path` given several times (or `Throttle([p1, p2], ...)`) throttles each device holding one of them to
the same limits, each on its own (two drives at 100 MB/s read 200 MB/s together). Needs root
and a cgroup-v1 blkio hierarchy. O_DIRECT reads and page-cache misses are both throttled at the block layer.

As a library: `Throttle(path, bps, iops)` is a context manager whose `wrap(command)` prefixes a command so that it
runs inside the cgroup; the limits are removed on exit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

BLKIO = Path("/sys/fs/cgroup/blkio")
MEMORY = Path("/sys/fs/cgroup/memory")


def block_device(path: str | Path) -> str:
    """'major:minor' of the whole disk holding `path` (throttling is per disk, not per partition)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    node = Path(f"/sys/dev/block/{major}:{minor}")
    if (node / "partition").exists():  # a partition: its parent directory is the disk
        major, minor = (node.resolve().parent / "dev").read_text().strip().split(":")
    return f"{major}:{minor}"


def parse_rate(text: str) -> int:
    from k3serve.units import parse_size

    return parse_size(text)


class Throttle:
    def __init__(self, path: str | Path | Sequence[str | Path], bps: int | None, iops: int | None,
                 memory: int | None = None, name: str = "k3throttle") -> None:
        """`path`: a file or folder on the device to throttle, or several (per-device mode: each device its own
        limits)."""
        if not BLKIO.exists():
            raise RuntimeError("no cgroup-v1 blkio hierarchy at /sys/fs/cgroup/blkio")
        paths = [path] if isinstance(path, (str, Path)) else list(path)
        self.devices = list(dict.fromkeys(block_device(p) for p in paths))
        self.device = ", ".join(self.devices)
        self.bps, self.iops, self.memory = bps, iops, memory
        self.blkio = BLKIO / name
        self.mem = MEMORY / name if memory is not None else None

    def _limit(self, bps: int, iops: int) -> None:
        for device in self.devices:  # one rule per write
            (self.blkio / "blkio.throttle.read_bps_device").write_text(f"{device} {bps}\n")
            (self.blkio / "blkio.throttle.read_iops_device").write_text(f"{device} {iops}\n")

    def __enter__(self) -> Throttle:
        self.blkio.mkdir(exist_ok=True)
        self._limit(self.bps or 0, self.iops or 0)
        if self.mem is not None:
            self.mem.mkdir(exist_ok=True)
            (self.mem / "memory.limit_in_bytes").write_text(str(self.memory))
        return self

    def wrap(self, command: list[str]) -> list[str]:
        procs = [str(self.blkio / "cgroup.procs")] + ([str(self.mem / "cgroup.procs")] if self.mem else [])
        join = "; ".join(f"echo $$ > {p}" for p in procs)
        return ["sh", "-c", f'{join} && exec "$@"', "sh", *command]

    def __exit__(self, *exc) -> None:
        self._limit(0, 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", action="append", default=None,
                        help="a file or folder on the disk to throttle; repeat it to throttle several disks, each to "
                             "the limits below (default: /tmp)")
    parser.add_argument("--bps", default=None, help="read bytes per second, e.g. 200M (default: unlimited)")
    parser.add_argument("--iops", type=int, default=None, help="read requests per second (default: unlimited)")
    parser.add_argument("--memory", default=None, help="also confine memory, page cache included (default: no)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command after --")
    with Throttle(args.path or ["/tmp"], parse_rate(args.bps) if args.bps else None, args.iops,
                  parse_rate(args.memory) if args.memory else None) as t:
        print(f"throttle: device {t.device}, read {args.bps or 'unlimited'} B/s, {args.iops or 'unlimited'} IOPS",
              file=sys.stderr)
        return subprocess.run(t.wrap(command)).returncode


if __name__ == "__main__":
    sys.exit(main())
