"""A digest of a model's logits over a fixed mixed batch: compare two source trees bit for bit.

    PYTHONPATH=<tree>/src python benchmarks/logits_digest.py [--model DIR] [--precision int8]

Three sequences (prompts of 9, 1 and 17 random tokens, every prefill position's logits), then 6 greedy decode
steps of the three as one batch. Prints the greedy tokens and the SHA-256 of every logit's bytes: two trees with
the same digest give bit-identical logits (issue 33's overhead cut was checked this way against its base).
"""

from __future__ import annotations

import argparse
import hashlib

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.loading import default_model_dir, load_model
from k3serve.model.interface import ForwardItem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the embedded K3)")
    parser.add_argument("--precision", default=None, help="expert precision of a family checkpoint")
    args = parser.parse_args()
    options = {} if args.precision is None else {"expert_precision": args.precision}
    model = load_model(args.model or default_model_dir(), **options).model
    rng = np.random.default_rng(1)
    caches = [model.new_cache() for _ in range(3)]
    prompts = [rng.integers(3, model.config.vocab_size, n) for n in (9, 1, 17)]
    digest = hashlib.sha256()
    result = model.forward([ForwardItem(p, c, all_logits=True) for p, c in zip(prompts, caches)])
    tokens: list[list[int]] = []
    for _ in range(7):
        for logits in result.logits:
            digest.update(np.ascontiguousarray(logits, dtype=np.float32).tobytes())
        tokens.append([int(np.argmax(logits[-1])) for logits in result.logits])
        if len(tokens) == 7:
            break
        result = model.forward([ForwardItem(np.array([t]), c) for t, c in zip(tokens[-1], caches)])
    print(f"greedy tokens {tokens[1:]} | logits sha256 {digest.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
