"""O_DIRECT reads into never-touched anonymous memory against reads into memory already faulted in: the cost of
making RAM resident for the first time, one candidate for the C engine's slow trunk stream at its upper
memory-ladder rungs (docs/SIMULATOR.md, "Calibration").

    .venv/bin/python benchmarks/bench_fresh_pages.py FILE [--mib 1024] [--repeats 3] [--json out.json]

FILE: a large file on the disk to measure (at least --mib MiB). Prints one summary line: median GB/s of 16 MiB
O_DIRECT reads into fresh pages, into faulted pages, and of faulting alone (one write per 4 KiB page).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

CHUNK = 16 << 20


def read_into(path: Path, buffer: mmap.mmap, nbytes: int) -> float:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    view = memoryview(buffer)
    try:
        start = time.perf_counter()
        offset = 0
        while offset < nbytes:
            got = os.preadv(fd, [view[offset:offset + CHUNK]], offset)
            if got <= 0:
                raise RuntimeError(f"short read at {offset} of {path}")
            offset += got
        return time.perf_counter() - start
    finally:
        view.release()
        os.close(fd)


def fresh(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def main() -> int:
    from k3serve.host import describe_host

    parser = argparse.ArgumentParser()
    parser.add_argument("file", type=Path)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    nbytes = args.mib << 20
    if args.file.stat().st_size < nbytes:
        print(f"{args.file} is smaller than {args.mib} MiB", file=sys.stderr)
        return 2
    times: dict[str, list[float]] = {"fault": [], "fresh": [], "faulted": []}
    for _ in range(args.repeats):
        buf = fresh(nbytes)
        pages = np.frombuffer(buf, dtype=np.uint8)
        start = time.perf_counter()
        pages[::4096] = 1
        times["fault"].append(time.perf_counter() - start)
        del pages
        buf.close()
        buf = fresh(nbytes)
        times["fresh"].append(read_into(args.file, buf, nbytes))
        times["faulted"].append(read_into(args.file, buf, nbytes))
        buf.close()
    rate = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    print(f"fresh pages: O_DIRECT into fresh {rate['fresh']:.2f} GB/s, into faulted {rate['faulted']:.2f} GB/s "
          f"({100 * (rate['fresh'] / rate['faulted'] - 1):+.0f}%), faulting alone {rate['fault']:.2f} GB/s "
          f"(median of {args.repeats}, {args.mib} MiB)")
    if args.json:
        args.json.write_text(json.dumps({"host": describe_host(), "mib": args.mib, "seconds": times,
                                         "gb_per_s": rate}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
