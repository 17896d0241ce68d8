"""Does a model copy from its context? Held-out revision documents (k3serve.training.corpus.copy_documents, made
from held-out stdlib code): the prompt is a function, the request for it again and its first line; greedy decoding
should reproduce the rest. Prints the mean share of the remaining tokens reproduced before the first mistake and
how many functions came out whole.

    .venv/bin/python benchmarks/eval_copy.py [--model DIR] [--count 20] [--expert-top-p P]
"""

from __future__ import annotations

import argparse
import json

from k3serve.loading import load_model
from k3serve.model.routing import ExpertTopP
from k3serve.training.corpus import build_corpus, copy_probe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    parser.add_argument("--expert-top-p", type=float, default=1.0, help="keep experts up to this routing weight")
    parser.add_argument("--expert-top-p-min", type=int, default=ExpertTopP().min_kept)
    parser.add_argument("--count", type=int, default=20, help="unchanged copies to try")
    args = parser.parse_args()
    loaded = load_model(args.model, expert_top_p=ExpertTopP(args.expert_top_p, args.expert_top_p_min))
    tokenizer = loaded.tokenizer
    shares = []
    for prompt, rest in copy_probe(build_corpus().heldout_code, args.count):
        want = tokenizer.encode(rest)
        got = loaded.model.greedy([tokenizer.bos_id] + tokenizer.encode(prompt), len(want))
        right = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        shares.append(right / len(want))
    record = {"functions": len(shares), "mean_prefix_share": sum(shares) / len(shares),
              "whole_copies": sum(s == 1.0 for s in shares)}
    print(f"copying: {record['mean_prefix_share']:.1%} of each function reproduced before the first mistake "
          f"(mean of {record['functions']}); {record['whole_copies']} copied whole")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
