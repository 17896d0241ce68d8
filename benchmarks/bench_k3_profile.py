"""Where a K3 decode step spends its time: wall and CPU per token, and a CPU-time profile by function.

Default model: the widened trained K3 of bench_stream.py / bench_peers.py (experts 16x in units, 32x in the
latent; 1.5 GB, built once). CPU time (process_time) is reported beside wall time because the shared machine's
other jobs inflate wall time; with one thread (NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1) CPU time is the work.

    python benchmarks/bench_k3_profile.py [--model DIR | --model embedded] [--prompt-len 32] [--steps 16] [--top 12]

The profiled steps are also split into compiled kernels, C calls and Python frames (benchmarks/profile_split.py):
Python's share of a decode step, and the calls per step.

Prints the machine, the profile table, one summary line and a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()

    import numba

    from bench_peers import bytes_per_token, widened_checkpoint
    from profile_split import by_own_time, line, split
    from k3serve.host import describe_host
    from k3serve.loading import load_model
    from k3serve.model.interface import ForwardItem

    if args.model == Path("embedded"):
        from k3serve.loading import default_model_dir
        args.model = Path(default_model_dir())
    checkpoint = args.model or widened_checkpoint(16, 32)
    model = load_model(checkpoint).model
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt_len)
    warm = model.new_cache()
    model.forward([ForwardItem(prompt[:4], warm)])
    model.forward([ForwardItem(prompt[4:5], warm)])
    cache = model.new_cache()
    wall, cpu = time.perf_counter(), time.process_time()
    model.forward([ForwardItem(prompt, cache)])
    prefill = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(args.steps):
        model.forward([ForwardItem(prompt[i % len(prompt):][:1], cache)])  # --steps may exceed the prompt
    decode = {"wall_ms_per_token": (time.perf_counter() - wall) / args.steps * 1e3,
              "cpu_ms_per_token": (time.process_time() - cpu) / args.steps * 1e3}
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    for i in range(args.steps):
        model.forward([ForwardItem(prompt[i % len(prompt):][:1], cache)])  # --steps may exceed the prompt
    profiler.disable()
    stats = pstats.Stats(profiler)
    parts = split(stats.stats, args.steps)  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in stats.stats.values())  # tottime
    rows = by_own_time(stats.stats)  # type: ignore[attr-defined]
    table = [{"function": name, "cpu_ms_per_token": round(t / args.steps * 1e3, 3), "share": round(t / total, 3)}
             for t, name in rows[:args.top]]
    moved = bytes_per_token(Path(checkpoint)) if args.model is None else None
    record = {"benchmark": "k3_profile", "machine": describe_host(), "model": str(checkpoint),
              "threads": {"numba": numba.get_num_threads(), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
              "prompt_len": args.prompt_len, "steps": args.steps, "prefill": prefill, "decode": decode,
              "bytes_per_token": moved, "profile_by_cpu": table,
              "profile_split": parts}
    out = io.StringIO()
    print(f"machine: {record['machine']} | numba threads {numba.get_num_threads()}", file=out)
    for row in table:
        print(f"  {row['function']:<60} {row['cpu_ms_per_token']:8.3f} ms/token  {row['share']:6.1%}", file=out)
    print(line(parts), file=out)
    print(out.getvalue(), end="")
    print(f"prefill {args.prompt_len} tokens: wall {prefill['wall_s']:.3f} s, CPU {prefill['cpu_s']:.3f} s | decode: "
          f"wall {decode['wall_ms_per_token']:.1f} ms/token, CPU {decode['cpu_ms_per_token']:.1f} ms/token")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
