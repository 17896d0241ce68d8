"""In-flight prefix sharing (`--prefix-wait-tokens`) on the embedded default model: bursts of requests that share
a system prompt and arrive together, as a batch job or a page of users opening a chat at once produce them.

Each round runs the same bursts on a fresh engine with the sharing on (`prefix_wait_tokens` 32, the default) and
off (0), alternating which goes first. A burst is --burst requests: one --system-len system prompt (per burst) and
a distinct 16-token question each, all queued before the first step; each reply is --max-tokens greedy tokens.
Bursts run one after another (--bursts), each with a new system prompt, so every burst starts cold.

Reported per configuration, medians over rounds: the prefix hit rate (cached prompt tokens / prompt tokens, the
engine's own counts), prompt tokens computed, wall time per burst, TTFT p50 / p99 (queued to first token) and
generated tokens per second; and the on/off ratios taken per round. Greedy outputs are checked to be equal.

    python benchmarks/bench_prefix_wait.py [--rounds 3] [--burst 8] [--bursts 4] [--system-len 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.lab.workloads import run_all
from k3serve.host import describe_host
from k3serve.loading import load_model


def run(model, stop_ids, wait: int, args: argparse.Namespace) -> dict:
    engine = LLMEngine(model, EngineConfig(prefix_wait_tokens=wait, max_batch_tokens=args.max_batch_tokens),
                       stop_ids=stop_ids)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    ttfts, tokens, walls, outputs = [], 0, [], []
    for _ in range(args.bursts):
        system = [int(t) for t in rng.integers(3, vocab, args.system_len)]
        ids = [engine.add_request(system + [int(t) for t in rng.integers(3, vocab, 16)], params)
               for _ in range(args.burst)]
        started = time.perf_counter()
        final = run_all(engine)
        walls.append(time.perf_counter() - started)
        for request_id in ids:
            out = final[request_id]
            ttfts.append(out.ttft_seconds)
            tokens += len(out.outputs[0].token_ids)
            outputs.append(out.outputs[0].token_ids)
    snap = engine.metrics.snapshot()
    hit, query = snap.get("prefix_cache_hit_tokens", 0.0), snap.get("prefix_cache_query_tokens", 0.0)
    return {"hit_rate": hit / query, "computed_prompt_tokens": query - hit, "burst_s": statistics.median(walls),
            "ttft_p50": float(np.percentile(ttfts, 50)), "ttft_p99": float(np.percentile(ttfts, 99)),
            "tokens_per_s": tokens / sum(walls), "waits": snap.get("prefix_waits", 0.0), "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=8, help="requests per burst, queued together")
    parser.add_argument("--bursts", type=int, default=4, help="bursts per run, one after another")
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-batch-tokens", type=int, default=EngineConfig.max_batch_tokens)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    loaded = load_model(None)
    model, stop_ids = loaded.model, loaded.tokenizer.eos_ids
    print(f"machine: {describe_host()}")
    results: dict[str, list[dict]] = {"on": [], "off": []}
    for round_index in range(args.rounds):
        order = (("on", EngineConfig.prefix_wait_tokens), ("off", 0))
        for name, wait in (order if round_index % 2 == 0 else order[::-1]):
            result = run(model, stop_ids, wait, args)
            results[name].append(result)
            print(f"round {round_index + 1} {name:3s}: hit rate {result['hit_rate']:.3f}  computed prompt tokens "
                  f"{result['computed_prompt_tokens']:.0f}  burst {result['burst_s'] * 1e3:.0f} ms  TTFT p50 "
                  f"{result['ttft_p50'] * 1e3:.0f} ms p99 {result['ttft_p99'] * 1e3:.0f} ms  "
                  f"{result['tokens_per_s']:.1f} tok/s  ({result['waits']:.0f} waited)", flush=True)
    for on, off in zip(results["on"], results["off"]):
        assert on["outputs"] == off["outputs"], "in-flight prefix sharing changed a greedy output"
    fields = ("hit_rate", "computed_prompt_tokens", "burst_s", "ttft_p50", "ttft_p99", "tokens_per_s", "waits")
    medians = {name: {f: statistics.median(r[f] for r in runs) for f in fields} for name, runs in results.items()}
    ratios = {f: statistics.median(on[f] / off[f] for on, off in zip(results["on"], results["off"]) if off[f])
              for f in ("computed_prompt_tokens", "burst_s", "ttft_p50", "ttft_p99", "tokens_per_s")}
    on, off = medians["on"], medians["off"]
    print(f"summary: hit rate {on['hit_rate']:.3f} with in-flight prefix sharing vs {off['hit_rate']:.3f} without; "
          f"prompt tokens computed {ratios['computed_prompt_tokens']:.2f}x, burst time {ratios['burst_s']:.2f}x, "
          f"TTFT p50 {ratios['ttft_p50']:.2f}x, p99 {ratios['ttft_p99']:.2f}x, tokens/s "
          f"{ratios['tokens_per_s']:.2f}x (on / off, per round, medians); greedy outputs identical")
    for runs in results.values():
        for r in runs:
            r.pop("outputs")
    print(json.dumps({"benchmark": "prefix_wait", "args": vars(args), "machine": describe_host(),
                      "medians": medians, "ratios": ratios, "runs": results}))


if __name__ == "__main__":
    main()
