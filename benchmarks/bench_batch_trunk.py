"""The shared trunk read per batch step (issue 34 item 4, third bullet): trunk bytes read per decode step and per
generated token at batch 1, 2, 4, 8, with every trunk layer and the lm_head streamed.

The embedded model packed (first use packs it into the user cache), streamed with a bf16 trunk at its minimum budget
(`minimum_budget_bytes`: nothing pinned, the lm_head read in row chunks, embedding rows on demand) plus
`--extra-slots` expert slots, LRU, no prefetch. B requests of one short prompt each run through the serving engine;
after the prefill step, each decode step generates one token per sequence. Byte counts are the streaming source's
(exact): per step, the trunk's bytes split into the embedding rows (one row per token, so B rows a step) and the rest
(the layers and the lm_head), which one batched forward reads once whatever B.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_batch_trunk.py [--batches 1,2,4,8] [--steps 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.loading import default_packed_dir, load_model
from k3serve.stream.budget import minimum_budget_bytes
from k3serve.stream.options import StreamOptions
from k3serve.weights import names
from k3serve.weights.store import PackedStore


def measure(store_path, batch: int, steps: int, extra_slots: int = 0) -> dict:
    """Trunk bytes of `steps` decode steps at `batch` sequences (after one prefill step), on a fresh source."""
    store = PackedStore(store_path)
    budget = minimum_budget_bytes(store, trunk_dtype="bf16") + extra_slots * store.expert_stride
    model = load_model(store_path, stream=StreamOptions(ram_budget=budget, trunk_dtype="bf16", cache="lru",
                                                        prefetch="none")).model
    source = model.source
    try:
        plan = source.plan
        if plan.pinned_layers or plan.head_pinned:
            raise RuntimeError(f"the trunk must stream: {plan.lines()[0]}")
        embed = store.globals.tensor(names.EMBED)
        row_bytes = embed.nbytes // embed.shape[0]
        engine = LLMEngine(model, EngineConfig(max_seqs=max(8, batch), num_blocks=256, block_size=16), stop_ids=())
        for i in range(batch):
            engine.add_request([5 + i, 9, 13, 200], SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        engine.step()  # the prefill of every prompt (and each sequence's first token)
        per_step = []
        for _ in range(steps):
            before = source.stats().stream
            outputs = engine.step()
            after = source.stats().stream
            tokens = sum(1 for o in outputs if not o.finished or o.outputs[0].token_ids)
            per_step.append({"trunk_bytes": after.trunk_bytes_read - before.trunk_bytes_read,
                             "expert_bytes": after.expert_bytes_read - before.expert_bytes_read,
                             "tokens": tokens})
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        source.close()
    trunk = [s["trunk_bytes"] for s in per_step]
    return {"batch": batch, "steps": steps, "budget_bytes": budget, "row_bytes": row_bytes,
            "trunk_bytes_per_step": trunk, "expert_bytes_per_step": [s["expert_bytes"] for s in per_step],
            "trunk_bytes_per_step_less_embedding_rows": [t - batch * row_bytes for t in trunk],
            "trunk_bytes_per_token": sum(trunk) / (steps * batch),
            "expert_bytes_per_token": sum(s["expert_bytes"] for s in per_step) / (steps * batch),
            "plan": plan.lines()[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--extra-slots", type=int, default=0, help="expert slots above the minimum's top-k")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    load_model(stream=StreamOptions())  # packs the embedded model on first use
    rows = [measure(default_packed_dir(), int(b), args.steps, args.extra_slots) for b in args.batches.split(",")]
    for r in rows:
        print(f"batch {r['batch']}: trunk {r['trunk_bytes_per_step'][-1] / 1024:8.1f} KiB/step "
              f"({r['trunk_bytes_per_step_less_embedding_rows'][-1] / 1024:.1f} KiB layers + lm_head, "
              f"{r['batch']} x {r['row_bytes']} B embedding rows), {r['trunk_bytes_per_token'] / 1024:8.1f} KiB/token; "
              f"experts {r['expert_bytes_per_token'] / 1024:8.1f} KiB/token")
    print(json.dumps({"trunk_bytes_per_token": {r["batch"]: round(r["trunk_bytes_per_token"]) for r in rows}}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
