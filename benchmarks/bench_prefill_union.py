"""Bytes shared across positions under streaming: a prompt's expert bytes per token when prefill reads, per layer,
the union of a chunk's experts once (what `K3Model.forward` asks the source for), against token-at-a-time.

The embedded model packed (first use packs it into the user cache), streamed under a RAM budget of the minimum plus
`--extra-slots` expert slots, LRU, no prefetch; one fresh source per chunk size; the prompt is `--prompt-tokens`
tokens of the held-out code of `build_corpus()`. Expert bytes are the I/O engine's count of bytes read.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_prefill_union.py [--prompt-tokens 512] [--chunks 1,16,64,512]
"""

from __future__ import annotations

import argparse
import json

from k3serve.loading import default_packed_dir, load_model
from k3serve.model.interface import ForwardItem
from k3serve.stream.budget import minimum_budget_bytes
from k3serve.stream.options import StreamOptions
from k3serve.training.corpus import build_corpus
from k3serve.weights.store import PackedStore


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--chunks", default="1,16,64,512")
    parser.add_argument("--extra-slots", type=int, default=16, help="expert slots above the minimum's top-k")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tokenizer = load_model(stream=StreamOptions()).tokenizer  # packs the embedded model on first use
    store = PackedStore(default_packed_dir())
    budget = minimum_budget_bytes(store) + args.extra_slots * store.expert_stride
    ids = ([tokenizer.bos_id] + tokenizer.encode("\n".join(build_corpus().heldout_code)))[:args.prompt_tokens]
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        model = load_model(stream=StreamOptions(ram_budget=budget, cache="lru", prefetch="none")).model
        cache = model.new_cache()
        for start in range(0, len(ids), chunk):
            model.forward([ForwardItem(ids[start:start + chunk], cache)])
        stats = model.source.stats().stream
        model.source.close()
        rows.append({"chunk": chunk, "prompt_tokens": len(ids), "steps": stats.steps,
                     "expert_bytes": stats.expert_bytes_read,
                     "expert_bytes_per_token": stats.expert_bytes_read / len(ids),
                     "expert_requests": stats.expert_requests, "budget_bytes": budget,
                     "expert_slots": model.source.plan.expert_slots})
    base = rows[0]["expert_bytes"]
    for r in rows:
        r["dedup_vs_first"] = base / r["expert_bytes"] if r["expert_bytes"] else float("inf")
        print(f"chunk {r['chunk']:>4}: {r['steps']:>4} steps, expert bytes/token "
              f"{r['expert_bytes_per_token'] / 1024:8.1f} KiB, {r['dedup_vs_first']:.2f}x fewer than chunk "
              f"{rows[0]['chunk']} "
              f"({r['expert_slots']} slots, budget {budget / 2**20:.1f} MiB)")
    print(json.dumps({"prompt_tokens": len(ids), "dedup": {r["chunk"]: round(r["dedup_vs_first"], 3) for r in rows}}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
