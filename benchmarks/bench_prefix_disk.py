"""TTFT of a returning long conversation whose prefix left RAM: restored from the prefix cache's disk tier against
recomputed (issue 35, item 1).

The embedded model is packed (once, into the user cache) and streamed under --ram-budget. Each run builds a fresh
engine with --state-checkpoints 2 (RAM) and, for the disk arm, a disk tier in a fresh folder under --dir:
  1. turn 1: a --prompt-tokens prompt (random ids), --reply-tokens greedy tokens;
  2. two short unrelated requests, whose checkpoints push turn 1's out of RAM (to the disk tier, in the disk arm;
     the recompute arm keeps the attention blocks cached but has no recurrent state to resume from);
  3. turn 2: turn 1's prompt and reply plus --new-tokens more, one token generated. Its TTFT is the figure.
The arms alternate (disk, recompute, disk, ...) and the medians are reported. The disk tier reads with O_DIRECT
(the page cache is bypassed where the file system allows it; the record says which).

Prints the machine, one summary line, and a JSON record on the last line.

    python benchmarks/bench_prefix_disk.py [--ram-budget 4M] [--prompt-tokens 4000] [--runs 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.host import describe_host
from k3serve.lab.workloads import run_all
from k3serve.loading import load_model
from k3serve.stream.options import StreamOptions
from k3serve.units import parse_size


def _finish(engine: LLMEngine, request_id: str):
    """Step the engine until nothing is left; the final output of `request_id`."""
    return run_all(engine)[request_id]


def run_once(loaded, use_disk: bool, args: argparse.Namespace, folder: str) -> dict:
    model = loaded.model
    config = EngineConfig(max_seqs=8, max_batch_tokens=2048, max_model_len=4096, kv_cache_bytes=64 << 20,
                          num_state_checkpoints=2, prefix_cache_dir=folder if use_disk else None,
                          prefix_cache_disk_bytes=1 << 30 if use_disk else 0)
    engine = LLMEngine(model, config, stop_ids=(), model_identity=loaded.identity if use_disk else None)
    rng = np.random.default_rng(7)
    vocab = model.config.vocab_size
    prompt = [int(t) for t in rng.integers(3, vocab, args.prompt_tokens)]
    greedy = SamplingParams(max_tokens=args.reply_tokens, ignore_eos=True)
    first = _finish(engine, engine.add_request(prompt, greedy))
    reply = first.outputs[0].token_ids
    for _ in range(2):
        _finish(engine, engine.add_request([int(t) for t in rng.integers(3, vocab, 24)], greedy))
    turn = prompt + reply + [int(t) for t in rng.integers(3, vocab, args.new_tokens)]
    before = model.source.stats().stream
    started = time.perf_counter()
    out = _finish(engine, engine.add_request(turn, SamplingParams(max_tokens=1, ignore_eos=True)))
    seconds = time.perf_counter() - started
    read = model.source.stats().stream.minus(before)
    disk = engine.scheduler.prefix_cache.disk
    return {"ttft_s": out.ttft_seconds if out.ttft_seconds is not None else seconds,
            "cached_tokens": out.num_cached_tokens, "turn_tokens": len(turn), "weights_bytes_read": read.bytes_read,
            "disk_tier_read_bytes": engine.metrics.counter("prefix_cache_disk_read_bytes", "").value,
            "o_direct": bool(disk.direct) if disk is not None else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ram-budget", default="4M")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the disk tier's folders go (default: the temp folder)")
    args = parser.parse_args()
    budget = parse_size(args.ram_budget)
    loaded = load_model(None, stream=StreamOptions(ram_budget=budget))
    results: dict[str, list[dict]] = {"disk": [], "recompute": []}
    for _ in range(args.runs):
        for arm in ("disk", "recompute"):
            with tempfile.TemporaryDirectory(dir=args.dir) as folder:
                results[arm].append(run_once(loaded, arm == "disk", args, folder))
    loaded.model.source.close()
    disk = statistics.median(r["ttft_s"] for r in results["disk"])
    recompute = statistics.median(r["ttft_s"] for r in results["recompute"])
    record = {"benchmark": "prefix_disk", "machine": describe_host(), "ram_budget_bytes": budget,
              "prompt_tokens": args.prompt_tokens, "runs": results, "median_ttft_disk_s": disk,
              "median_ttft_recompute_s": recompute, "speedup": recompute / disk}
    print(f"machine: {record['machine']}")
    print(f"returning {results['disk'][0]['turn_tokens']}-token turn: TTFT {disk * 1000:.1f} ms restored from disk "
          f"({results['disk'][0]['cached_tokens']} cached, {results['disk'][0]['disk_tier_read_bytes'] / 2**20:.2f}"
          f" MiB read, O_DIRECT {results['disk'][0]['o_direct']}) vs {recompute * 1000:.1f} ms recomputed "
          f"({results['recompute'][0]['cached_tokens']} cached): {recompute / disk:.1f}x | budget {args.ram_budget}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
