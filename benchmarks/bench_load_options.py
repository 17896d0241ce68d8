"""A family model at real widths under two settings of the same k3serve, alternated in fresh processes: the trunk
as stored against `--trunk-precision q8_0`, or OpenBLAS's workers spinning (OpenBLAS's default, as before k3serve
set OPENBLAS_THREAD_TIMEOUT) against sleeping at once (k3serve's default now).

    python benchmarks/bench_load_options.py --compare trunk [--precision int8] [--rounds 3]
    python benchmarks/bench_load_options.py --compare blas-spin [--precision int8] [--trunk-precision q8_0]

The checkpoint is bench_peers' real-width fixture (benchmarks/family_fixture.py; default Qwen3-MoE at
Qwen3-30B-A3B's widths, 4 of its 48 layers, built by `bench_peers.py --targets qwen3_moe --sizes real` or
bench_peers.family_target). Each run is bench_peers' `--shapes-child` (load, pack every expert, warm up, prefill of
each --prompt-lens at batch 1, --decode-steps decode steps at each --batches size after a 64-token prompt per
sequence, peak RSS), 2 threads, k3serve's default wait policy; the arms alternate round by round; medians and the
ratio new / old per figure. One JSON record on the last line (--out writes it too). Figures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIGURES = ("prefill_512_tok_s", "decode_b1_tok_s", "decode_b8_tok_s", "peak_rss_mib")


def run(spec: dict, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, str(HERE / "bench_peers.py"), "--shapes-child", json.dumps(spec)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "child failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", choices=("trunk", "blas-spin"), required=True)
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the family's real-width fixture")
    parser.add_argument("--precision", default="int8", help="k3serve --expert-precision")
    parser.add_argument("--trunk-precision", default="q8_0", help="for --compare blas-spin")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import family_fixture
    from k3serve.host import defaults_environment, describe_host

    checkpoint = args.checkpoint or family_fixture.fixture_dir(args.family, "real")
    config = json.loads((checkpoint / "config.json").read_text())
    spec = {"threads": 2, "prompt_lens": [512], "batches": [1, 8], "decode_context": 64,
            "decode_steps": args.decode_steps, "vocab": config["vocab_size"], "family": args.family,
            "checkpoint": str(checkpoint), "engine": "k3serve", "precision": args.precision}
    base = defaults_environment(2)
    if args.compare == "trunk":
        arms = {"old": ({**spec, "trunk_precision": "native"}, base),
                "new": ({**spec, "trunk_precision": "q8_0"}, base)}
    else:  # OpenBLAS's compiled-in default is 2^28 cycles; an explicit value is kept by k3serve's __init__
        spinning = {**spec, "trunk_precision": args.trunk_precision}
        arms = {"old": (spinning, {**base, "OPENBLAS_THREAD_TIMEOUT": "28"}), "new": (spinning, base)}
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    started = time.time()
    run({**spec, "prompt_lens": [16], "decode_steps": 1, "trunk_precision": "native"}, base)  # numba's cache, pages
    for round_ in range(args.rounds):
        for name, (child, env) in arms.items():
            print(f"round {round_ + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            runs[name].append({**run(child, env), "load_avg_start": os.getloadavg()[0]})
    median = {name: {f: statistics.median(r[f] for r in rs) for f in FIGURES} for name, rs in runs.items()}
    ratio = {f: round(median["new"][f] / median["old"][f], 3) for f in FIGURES}
    for f in FIGURES:
        print(f"{f}: old {median['old'][f]:.1f}, new {median['new'][f]:.1f}, new/old {ratio[f]}x")
    record = {"benchmark": "load_options", "compare": args.compare, "machine": describe_host(),
              "checkpoint": str(checkpoint), "precision": args.precision, "rounds": args.rounds,
              "arms": {name: {"trunk_precision": child["trunk_precision"],
                              "OPENBLAS_THREAD_TIMEOUT": env.get("OPENBLAS_THREAD_TIMEOUT", "k3serve default (4)")}
                       for name, (child, env) in arms.items()},
              "median": median, "ratio_new_over_old": ratio, "wall_s": round(time.time() - started, 1),
              "runs": runs}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
