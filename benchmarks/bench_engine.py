"""The serving engine on the embedded default model (or --model DIR / --family NAME: any family, see
benchmarks/family_fixture.py): throughput under concurrency, TTFT with and without the
hybrid prefix cache, and KV memory waste of paged blocks against per-sequence reservation.

  throughput  generated tok/s with C requests in flight (C = 1, 4, 16, 64), each a 16-token prompt and
              --max-tokens greedy tokens; configurations alternate round by round; medians.
  ttft        shared prefix: one long system prompt + short distinct questions (>= 90% of each prompt shared),
              requests one after another (median over all of them, misses included; 'steady' = from the 3rd on:
              the 1st misses, the 2nd misses but checkpoints the branch point); multi-turn: a conversation whose
              every turn resends the history (median over turns 2+). Engine with the prefix cache vs without,
              alternating; medians.
  waste       unfilled positions / reserved positions, sampled every step: paged blocks (block_size 16) vs
              reserving max_model_len per sequence vs reserving prompt + max_tokens. Measured on the throughput
              run (real model) and on a long-sequence workload (prompts 128..1024, outputs 16..128) that drives the
              real scheduler and pools with a stand-in model writing zero rows (memory depends only on lengths).

Prints the machine, one summary line, and a JSON record on the last line.

    python benchmarks/bench_engine.py [--model DIR | --family NAME] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.lab.workloads import WasteMeter, ZeroRowsModel, run_all, shared_prefix_ttft
from family_fixture import add_model_args, model_path
from k3serve.loading import load_model
from k3serve.host import describe_host

CONCURRENCY = (1, 4, 16, 64)


def throughput(model, stop_ids, concurrency: int, max_tokens: int, rng, meter_sink: list | None) -> float:
    config = EngineConfig(max_seqs=64, max_batch_tokens=2048, enable_prefix_caching=False)
    engine = LLMEngine(model, config, stop_ids=stop_ids)
    vocab = model.config.vocab_size
    for _ in range(concurrency):
        engine.add_request([int(t) for t in rng.integers(3, vocab, 16)],
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    meter = WasteMeter(engine, config.max_model_len) if meter_sink is not None else None
    started = time.perf_counter()
    final = run_all(engine, meter)
    elapsed = time.perf_counter() - started
    if meter_sink is not None:
        meter_sink.append(meter)
    return sum(len(o.outputs[0].token_ids) for o in final.values()) / elapsed


def multi_turn_ttft(model, stop_ids, caching: bool, system_len: int, turns: int, rng) -> dict:
    engine = LLMEngine(model, EngineConfig(enable_prefix_caching=caching), stop_ids=stop_ids)
    vocab = model.config.vocab_size
    history = [int(t) for t in np.random.default_rng(8).integers(3, vocab, system_len)]
    ttfts = []
    for _ in range(turns):
        history = history + [int(t) for t in rng.integers(3, vocab, 16)]
        engine.add_request(history, SamplingParams(max_tokens=16, ignore_eos=True))
        (out,) = run_all(engine).values()
        ttfts.append(out.ttft_seconds)
        history = history + out.outputs[0].token_ids
    later = ttfts[1:]  # the first turn has nothing to reuse in either configuration
    return {"median_ttft_s": statistics.median(later), "ttfts": ttfts}


def long_sequence_waste(model, num_requests: int) -> dict:
    model_config = model.config
    config = EngineConfig(max_seqs=32, max_batch_tokens=4096, max_model_len=2048, enable_prefix_caching=False)
    engine = LLMEngine(ZeroRowsModel(model_config, layout=model.cache_layout), config)
    rng = np.random.default_rng(11)
    for _ in range(num_requests):
        engine.add_request([int(t) for t in rng.integers(3, model_config.vocab_size, int(rng.integers(128, 1025)))],
                           SamplingParams(max_tokens=int(rng.integers(16, 129)), ignore_eos=True))
    meter = WasteMeter(engine, config.max_model_len)
    run_all(engine, meter)
    return meter.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-len", type=int, default=480)
    parser.add_argument("--quick", action="store_true", help="2 rounds, 8 tokens, a 240-token system prompt")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.max_tokens, args.system_len = 2, 8, 240
    logging.basicConfig(level=logging.WARNING)
    path, label = model_path(args)
    loaded = load_model(path)
    model, stop_ids = loaded.model, loaded.stop_ids
    rng = np.random.default_rng(0)
    throughput(model, stop_ids, 2, 2, rng, None)  # warm-up: JIT compile, first-touch allocations

    rates: dict[int, list[float]] = {c: [] for c in CONCURRENCY}
    meters: list = []
    for _ in range(args.rounds):
        for c in CONCURRENCY:
            rates[c].append(throughput(model, stop_ids, c, args.max_tokens, rng, meters if c == 64 else None))
    tok_s = {c: statistics.median(v) for c, v in rates.items()}

    num_requests = 5 if args.quick else 8  # the first two miss (the 2nd finds the branch point), the rest hit
    turns = 3 if args.quick else 4
    shared = {True: [], False: []}
    multi = {True: [], False: []}
    for _ in range(args.rounds):
        for caching in (True, False):
            shared[caching].append(shared_prefix_ttft(model, stop_ids, caching, args.system_len, num_requests, rng))
            multi[caching].append(multi_turn_ttft(model, stop_ids, caching, args.system_len, turns, rng))

    def median_of(runs: list[dict]) -> float:
        return statistics.median(r["median_ttft_s"] for r in runs)

    ttft = {
        "shared_prefix": {"cache_s": median_of(shared[True]), "no_cache_s": median_of(shared[False]),
                          "cache_steady_s": statistics.median(r["steady_ttft_s"] for r in shared[True]),
                          "shared_fraction": round(shared[True][0]["shared_fraction"], 3),
                          "requests_per_round": num_requests},
        "multi_turn": {"cache_s": median_of(multi[True]), "no_cache_s": median_of(multi[False]),
                       "turns_per_round": turns},
    }
    for entry in ttft.values():
        entry["speedup"] = round(entry["no_cache_s"] / entry["cache_s"], 2)
    merged = WasteMeter(None, 0)
    for meter in meters:
        merged.merge(meter)
    waste = {"throughput_run_c64": merged.result(),
             "long_sequences": long_sequence_waste(model, 64 if args.quick else 256)}

    record = {
        "benchmark": "engine",
        "model": label,
        "machine": describe_host(),
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "gen_tok_per_s": {str(c): round(v, 1) for c, v in tok_s.items()},
        "c16_over_c1": round(tok_s[16] / tok_s[1], 2),
        "c64_over_c1": round(tok_s[64] / tok_s[1], 2),
        "ttft": ttft,
        "kv_waste": waste,
        "all_rounds": {"gen_tok_per_s": {str(c): [round(v, 1) for v in vs] for c, vs in rates.items()},
                       "shared_prefix_ttfts": {str(k): [r["ttfts"] for r in v] for k, v in shared.items()},
                       "multi_turn_ttfts": {str(k): [r["ttfts"] for r in v] for k, v in multi.items()}},
    }
    print(f"machine: {record['machine']}")
    print(f"gen tok/s c1 {tok_s[1]:.1f} | c4 {tok_s[4]:.1f} | c16 {tok_s[16]:.1f} | c64 {tok_s[64]:.1f} "
          f"(c16/c1 {record['c16_over_c1']}x) | TTFT shared prefix {ttft['shared_prefix']['cache_s'] * 1e3:.0f} vs "
          f"{ttft['shared_prefix']['no_cache_s'] * 1e3:.0f} ms ({ttft['shared_prefix']['speedup']}x), multi-turn "
          f"{ttft['multi_turn']['cache_s'] * 1e3:.0f} vs {ttft['multi_turn']['no_cache_s'] * 1e3:.0f} ms "
          f"({ttft['multi_turn']['speedup']}x) | KV waste paged {waste['long_sequences']['paged_pct']}% vs "
          f"max-len {waste['long_sequences']['reserve_max_len_pct']}% | medians of {args.rounds}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
