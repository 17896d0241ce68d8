"""bf16 against float32 trunk in RAM, compute only (no budget: every weight resident), on the proportioned fixture
that benchmarks/bench_memory_floor.py builds: a 64-token prefill and per-token decode, medians of 3 alternated runs.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_trunk_dtype.py --hidden 1024 --root /tmp/k3serve-floor

Prints one summary line and a JSON record.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

from k3serve.engine.generate import generate
from k3serve.engine.sampling import SamplingParams
from k3serve.loading import load_model
from k3serve.stream.options import StreamOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--root", type=Path, default=Path("/tmp/k3serve-floor"))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("floor", Path(__file__).with_name("bench_memory_floor.py"))
    floor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(floor)
    _, packed = floor.build_fixture(args.root, args.hidden)
    models = {d: load_model(packed, stream=StreamOptions(trunk_dtype=d)).model for d in ("bf16", "float32")}
    prompt = floor.prompt(64)
    new = 9
    times: dict[str, dict[str, list[float]]] = {d: {"prefill_s": [], "decode_s_per_token": []} for d in models}
    for _ in range(args.runs):
        for dtype, model in models.items():
            started = time.perf_counter()
            model.logits(prompt)
            times[dtype]["prefill_s"].append(time.perf_counter() - started)
            started = time.perf_counter()
            generate(model, prompt[:4], SamplingParams(max_tokens=new, ignore_eos=True))
            times[dtype]["decode_s_per_token"].append((time.perf_counter() - started) / new)
    record = {d: {k: statistics.median(v) for k, v in t.items()} for d, t in times.items()}
    record["hidden"] = args.hidden
    print(f"hidden {args.hidden}: 64-token prefill bf16 {record['bf16']['prefill_s'] * 1e3:.0f} ms, float32 "
          f"{record['float32']['prefill_s'] * 1e3:.0f} ms; decode bf16 {record['bf16']['decode_s_per_token'] * 1e3:.1f} "
          f"ms/token, float32 {record['float32']['decode_s_per_token'] * 1e3:.1f} ms/token")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
