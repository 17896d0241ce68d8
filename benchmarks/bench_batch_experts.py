"""Decode batches chosen by shared experts (--batch-by-experts) against the default order, under a RAM budget.

The embedded model is packed (once, into the user cache) and served by the engine from a streaming source capped
at --ram-budget. C requests (--concurrency, default 16 and 32) with distinct 16-token prompts arrive together and
decode --max-tokens greedy tokens each, at most --batch decodes per forward (EngineConfig.max_decode_seqs, 8), so
more sequences are ready than a step takes. Two arms on the same trace:
  - fcfs: the first 8 ready decodes in running order (the oldest run to completion first);
  - experts: the 8 whose previous step's experts overlap most (engine/expert_batching.py), a decode that fcfs
    would run passed over at most --max-wait steps in a row.
Figures per arm: the union of expert bytes the steps asked for per generated token (sum over steps and MoE layers
of |distinct experts| x expert blob size, exact), the expert bytes read from the store per generated token (exact;
depends on the cache), tokens/s and per-request latency p99 (arrival to last token; medians of --repeats runs,
alternated), and the prediction's quality (|previous step's experts & next step's| / |next|, per sequence).

Prints the machine, one summary line per (C, arm), and a JSON record on the last line.

    python benchmarks/bench_batch_experts.py [--ram-budget 16M] [--max-tokens 16] [--repeats 3]
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
from k3serve.engine.expert_batching import Candidate, choose_by_experts, union_size
from k3serve.engine.sampling import SamplingParams
from k3serve.host import describe_host
from k3serve.loading import load_model
from k3serve.stream.options import StreamOptions
from k3serve.units import parse_size


def make_prompts(kind: str, concurrency: int, length: int) -> list[list[int]]:
    """`concurrency` prompts of `length` tokens: windows of held-out code or prose (the model's own tokenizer, at
    evenly spread offsets), or random token ids."""
    loaded = load_model(None)
    if kind == "random":
        rng = np.random.default_rng(concurrency)
        return [[int(t) for t in rng.integers(3, loaded.model.config.vocab_size, length)] for _ in range(concurrency)]
    from k3serve.training.corpus import build_corpus

    corpus = build_corpus()
    if kind == "mixed":  # code and prose alternately
        code, prose = make_prompts("code", concurrency, length), make_prompts("prose", concurrency, length)
        return [code[i] if i % 2 == 0 else prose[i] for i in range(concurrency)]
    texts = corpus.heldout_code if kind == "code" else corpus.heldout_prose
    ids = [t for text in texts for t in loaded.tokenizer.encode(text)]
    step = (len(ids) - length) // concurrency
    return [ids[i * step:i * step + length] for i in range(concurrency)]


def run(prompts: list[list[int]], by_experts: bool, budget: int, max_tokens: int, batch: int, max_wait: int
        ) -> dict[str, float]:
    loaded = load_model(None, stream=StreamOptions(ram_budget=budget, io="pread", cache="lfu"))
    model = loaded.model
    config = EngineConfig(max_seqs=len(prompts), max_batch_tokens=2048, max_decode_seqs=batch,
                          batch_by_experts=by_experts, batch_by_experts_max_wait=max_wait)
    engine = LLMEngine(model, config, stop_ids=())
    streams: dict[int, list[np.ndarray]] = {}  # seq_id -> the routing of its last token at each forward [L, TOPK]
    if by_experts:
        record = engine._record_predictions

        def recording(decision):
            record(decision)
            for scheduled in decision.scheduled:
                if scheduled.seq.predicted_experts is not None:
                    streams.setdefault(scheduled.seq.seq_id, []).append(scheduled.seq.predicted_experts)

        engine._record_predictions = recording
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    before = model.source.stats().stream
    started = time.perf_counter()
    generated, latencies, outputs = 0, [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
                latencies.append(time.perf_counter() - started)
                outputs.append((out.request_id, tuple(out.outputs[0].token_ids)))
    seconds = time.perf_counter() - started
    stats = model.source.stats().stream.minus(before)
    blob = model.source.store.expert_blob_size
    model.source.close()
    quality = engine.prediction_quality
    return {"generated_tokens": generated, "steps": stats.steps,
            "union_expert_bytes_per_token": stats.expert_requests * blob / generated,
            "expert_bytes_read_per_token": stats.expert_bytes_read / generated,
            "tok_per_s": generated / seconds, "latency_p99_s": float(np.percentile(latencies, 99)),
            "prediction_overlap": quality.overlap if by_experts else None,
            "outputs": hash(tuple(sorted(outputs))), "streams": [streams[k] for k in sorted(streams)]}


def replay(streams: list[list[np.ndarray]], batch: int, max_wait: int, rule: str) -> tuple[int, int]:
    """(expert pairs the decode steps ask for, decode steps) when each sequence's routing is `streams[s]` (its
    prefill's last token, then each decode's token; greedy outputs, so the same whatever the batching) and each
    step runs `batch` of the ready sequences by `rule`: fcfs (the first in order), previous (the engine's rule:
    the previous step's experts as the prediction) or oracle (the same greedy with the true next step's experts:
    the ceiling of any predictor)."""
    nxt = [1] * len(streams)  # each sequence's next decode: streams[s][nxt[s]] is the routing it will have
    passed = [0] * len(streams)
    pairs = steps = 0
    while True:
        ready = [s for s in range(len(streams)) if nxt[s] < len(streams[s])]
        if not ready:
            return pairs, steps
        if rule == "fcfs" or len(ready) <= batch:
            chosen = ready[:batch]
        else:
            offset = 0 if rule == "previous" else 1
            candidates = [Candidate(streams[s][nxt[s] - 1 + offset], (), passed[s] >= max_wait) for s in ready]
            picked = set(choose_by_experts(candidates, batch))
            for i, s in enumerate(ready):
                passed[s] = 0 if i in picked else passed[s] + (i < batch)
            chosen = [ready[i] for i in sorted(picked)]
        pairs += union_size([streams[s][nxt[s]] for s in chosen])
        steps += 1
        for s in chosen:
            nxt[s] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ram-budget", default="16M")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--batch", type=int, default=8, help="decodes per forward (max_decode_seqs)")
    parser.add_argument("--max-wait", type=int, default=4, help="--batch-by-experts-max-wait")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", choices=("code", "prose", "mixed", "random"), default="code",
                        help="held-out code or prose windows, the two alternately (mixed), or random token ids")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    args = parser.parse_args()
    budget = parse_size(args.ram_budget)
    print(describe_host())
    record = {"ram_budget": budget, "max_tokens": args.max_tokens, "batch": args.batch, "max_wait": args.max_wait,
              "repeats": args.repeats, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "rows": []}
    for concurrency in args.concurrency:
        prompts = make_prompts(args.prompts, concurrency, args.prompt_tokens)
        run(prompts, False, budget, 2, args.batch, args.max_wait)  # warm-up (compiles, page cache), not counted
        runs: dict[str, list[dict[str, float]]] = {"fcfs": [], "experts": []}
        for _ in range(args.repeats):  # alternated, so drift on a shared machine hits both arms alike
            for arm in runs:
                runs[arm].append(run(prompts, arm == "experts", budget, args.max_tokens, args.batch,
                                     args.max_wait))
        same = runs["fcfs"][0]["outputs"] == runs["experts"][0]["outputs"]
        streams = runs["experts"][0]["streams"]
        generated = runs["experts"][0]["generated_tokens"]
        blob = load_model(None, stream=StreamOptions(ram_budget=budget)).model.source.store.expert_blob_size
        for rule in ("fcfs", "previous", "oracle"):
            pairs, steps = replay(streams, args.batch, args.max_wait, rule)
            row = {"concurrency": concurrency, "replay": rule, "decode_union_expert_bytes_per_token":
                   pairs * blob / (generated - concurrency), "decode_steps": steps}
            record["rows"].append(row)
            print(f"C={concurrency:3d} replay {rule:8s} decode union expert "
                  f"{row['decode_union_expert_bytes_per_token'] / 1024:9.1f} KiB/tok  steps {steps:5d}")
        for arm, results in runs.items():
            row = {"concurrency": concurrency, "arm": arm, "same_outputs_as_fcfs": same}
            for key in results[0]:
                if key not in ("outputs", "streams"):
                    values = [r[key] for r in results]
                    row[key] = None if values[0] is None else statistics.median(values)
            record["rows"].append(row)
            print(f"C={concurrency:3d} {arm:8s} union expert {row['union_expert_bytes_per_token'] / 1024:9.1f} KiB/tok"
                  f"  read {row['expert_bytes_read_per_token'] / 1024:9.1f} KiB/tok  steps {row['steps']:5.0f}"
                  f"  {row['tok_per_s']:6.2f} tok/s  p99 {row['latency_p99_s']:6.2f} s"
                  f"  overlap {row['prediction_overlap'] or 0:.3f}  same outputs {same}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
