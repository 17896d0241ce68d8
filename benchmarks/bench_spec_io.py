"""I/O-aware speculation on a streamed model: bytes read per generated token and tokens/s. Plain decode, the n-gram
drafter at a fixed k = 8 (`--no-adaptive-draft`), adaptive k with the assumed window cost (0.15), and adaptive k
with `--speculative-io-aware` (the cost measured from the bytes each window position adds), on the embedded model
packed and streamed under a RAM budget.

Prompts: `--count` held-out copy probes (`copy_probe`: a function, a request for it again and its first line, so
drafts from the prompt are often right) and as many open-ended ones (the first 12 lines of held-out code
documents); greedy, `--max-tokens` each. Bytes are the source's exact count over the decode phase (after the first
token); tokens/s is wall time on a shared machine. Modes alternate per prompt.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_spec_io.py [--extra-slots 16] [--count 4] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import statistics

from k3serve.engine.generate import generate
from k3serve.engine.sampling import SamplingParams
from k3serve.engine.speculative import DrafterFactory, SpeculativeConfig
from k3serve.loading import default_packed_dir, load_model
from k3serve.stream.budget import minimum_budget_bytes
from k3serve.stream.options import StreamOptions
from k3serve.training.corpus import build_corpus, copy_probe
from k3serve.weights.store import PackedStore

MODES = {"plain": None,
         "k=8": SpeculativeConfig(drafter="ngram", adaptive=False, num_draft_tokens=8),
         "fixed": SpeculativeConfig(drafter="ngram"),
         "io-aware": SpeculativeConfig(drafter="ngram", io_aware=True)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--extra-slots", type=int, default=16)
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    loaded = load_model(stream=StreamOptions())
    tokenizer = loaded.tokenizer
    store = PackedStore(default_packed_dir())
    budget = minimum_budget_bytes(store) + args.extra_slots * store.expert_stride
    corpus = build_corpus()
    grounded = [p + r.split("\n", 1)[0] for p, r in copy_probe(corpus.heldout_code, args.count)]
    open_ended = ["\n".join(doc.split("\n")[:12]) + "\n" for doc in corpus.heldout_code[:args.count]]
    prompts = [("grounded", p) for p in grounded] + [("open", p) for p in open_ended]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for kind, text in prompts:
        ids = [tokenizer.bos_id] + tokenizer.encode(text)
        for mode, spec in MODES.items():
            model = load_model(stream=StreamOptions(ram_budget=budget, cache="lru", prefetch="none")).model
            drafters = DrafterFactory(model) if spec is not None else None
            first: list = []

            def on_token(_token: int, source=model.source, first=first) -> None:
                if not first:  # the prompt's step is done: count the decode phase from here
                    first.append(source.stats().stream.bytes_read)

            tokens, report = generate(model, ids, params, speculative=spec, drafters=drafters, on_token=on_token)
            decode_bytes = model.source.stats().stream.bytes_read - first[0]
            model.source.close()
            s = report.speculation
            rows.append({"kind": kind, "mode": mode, "tokens": len(tokens) - 1, "bytes": decode_bytes,
                         "decode_seconds": report.decode_seconds,
                         "decode_tok_s": report.decode_tokens_per_second,
                         "acceptance": s.acceptance_rate if s else None,
                         "tokens_per_window": s.emitted / s.windows if s and s.windows else None})
    summary = {}
    for kind in ("grounded", "open"):
        for mode in MODES:
            sel = [r for r in rows if r["kind"] == kind and r["mode"] == mode]
            per_token = sum(r["bytes"] for r in sel) / sum(r["tokens"] for r in sel)
            summary[f"{kind}/{mode}"] = {"bytes_per_token": per_token,
                                         "median_decode_tok_s": statistics.median(r["decode_tok_s"] for r in sel),
                                         "acceptance": statistics.mean(r["acceptance"] for r in sel)
                                         if mode != "plain" else None}
            print(f"{kind:>8} {mode:>8}: {per_token / 2**20:7.2f} MiB read/token, median decode "
                  f"{summary[f'{kind}/{mode}']['median_decode_tok_s']:.1f} tok/s"
                  + (f", acceptance {summary[f'{kind}/{mode}']['acceptance']:.0%}" if mode != "plain" else ""))
    print(json.dumps({"budget_bytes": budget, "summary": summary}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"budget_bytes": budget, "rows": rows, "summary": summary}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
