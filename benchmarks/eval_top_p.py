"""What `--expert-top-p` costs in quality: held-out loss of the embedded trained model, and logit error of the
synthetic families against their full routing, with the experts each (token, MoE layer) kept.

Embedded model (K3 architecture, 64 experts top-4, trained): `--windows` windows of 257 tokens spread evenly over
the held-out code and the held-out prose of `build_corpus()` (each split's documents joined by newlines, encoded by
the model's tokenizer, BOS first); teacher-forced loss in nats per token, one forward per window.
Families (`k3serve.model.families.synthetic`, random tiny checkpoints, seed 0): one 48-token prompt, relative RMS
error of the logits against P = 1 and the share of positions whose argmax is unchanged.

    PYTHONPATH=src .venv/bin/python benchmarks/eval_top_p.py [--top-p 1,0.9,0.8,0.7] [--min 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.loading import load_model
from k3serve.model.families.synthetic import SYNTHETIC_FAMILIES, write_random_family
from k3serve.model.routing import ExpertTopP
from k3serve.training.corpus import build_corpus

WINDOW = 257


def windows(ids: list[int], count: int) -> list[list[int]]:
    starts = np.linspace(0, len(ids) - WINDOW, count).astype(np.int64)
    return [ids[s:s + WINDOW] for s in starts]


def nll(model, window: list[int]) -> tuple[float, int]:
    logits = model.logits(window[:-1]).astype(np.float64)  # [W-1, V]
    logits -= logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(window) - 1), window[1:]].sum()), len(window) - 1


def embedded_rows(top_ps: list[float], min_kept: int, count: int) -> list[dict]:
    corpus = build_corpus()
    tokenizer = load_model().tokenizer
    splits = {kind: windows([tokenizer.bos_id] + tokenizer.encode("\n".join(docs)), count)
              for kind, docs in (("code", corpus.heldout_code), ("prose", corpus.heldout_prose))}
    rows = []
    for top_p in top_ps:
        model = load_model(expert_top_p=ExpertTopP(top_p, min_kept)).model
        row = {"top_p": top_p, "min_kept": min_kept}
        started = time.perf_counter()
        for kind, split in splits.items():
            total, n = 0.0, 0
            for window in split:
                loss, tokens = nll(model, window)
                total, n = total + loss, n + tokens
            row[f"{kind}_loss"] = total / n
        row["experts_kept_mean"] = model.kept_experts.mean
        row["experts_kept_histogram"] = model.kept_experts.histogram()
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        print(f"embedded P={top_p:<4} min {min_kept}: code {row['code_loss']:.4f}, prose {row['prose_loss']:.4f} "
              f"nats/token; kept {row['experts_kept_mean']:.2f} of 4 {row['experts_kept_histogram']}", flush=True)
    return rows


def family_rows(top_ps: list[float], min_kept: int) -> list[dict]:
    rows = []
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, 150, 48)]
    with tempfile.TemporaryDirectory() as tmp:
        for family in SYNTHETIC_FAMILIES:
            folder = write_random_family(family, Path(tmp) / family, seed=0)
            full = load_model(folder).model.logits(prompt).astype(np.float64)
            for top_p in top_ps:
                model = load_model(folder, expert_top_p=ExpertTopP(top_p, min_kept)).model
                logits = model.logits(prompt).astype(np.float64)
                error = float(np.sqrt(np.mean((logits - full) ** 2)) / np.sqrt(np.mean(full ** 2)))
                same = float(np.mean(logits.argmax(axis=1) == full.argmax(axis=1)))
                top_k = model.kept_experts.counts.shape[0] - 1
                rows.append({"family": family, "top_p": top_p, "min_kept": min_kept, "relative_rms_error": error,
                             "argmax_same": same, "experts_kept_mean": model.kept_experts.mean, "top_k": top_k})
                print(f"{family:<12} P={top_p:<4}: logit error {error:.2e}, argmax same {same:.1%}, kept "
                      f"{model.kept_experts.mean:.2f} of {top_k}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--top-p", default="1,0.9,0.8,0.7")
    parser.add_argument("--min", type=int, default=ExpertTopP().min_kept, help="--expert-top-p-min")
    parser.add_argument("--windows", type=int, default=16, help="windows of each held-out split")
    parser.add_argument("--skip-families", action="store_true")
    parser.add_argument("--skip-embedded", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    top_ps = [float(x) for x in args.top_p.split(",")]
    record = {"embedded": [] if args.skip_embedded else embedded_rows(top_ps, args.min, args.windows)}
    if not args.skip_families:
        record["families"] = family_rows(top_ps, args.min)
    for row in record["embedded"][1:]:
        base = record["embedded"][0]
        print(f"P={row['top_p']}: code {row['code_loss'] - base['code_loss']:+.4f}, prose "
              f"{row['prose_loss'] - base['prose_loss']:+.4f} nats/token vs P={base['top_p']}; kept "
              f"{row['experts_kept_mean']:.2f}")
    print(json.dumps({"top_p": top_ps, "min_kept": args.min,
                      "kept": [r["experts_kept_mean"] for r in record["embedded"] + record.get("families", [])]}))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
