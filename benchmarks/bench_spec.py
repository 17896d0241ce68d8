"""Speculative decoding on the embedded (trained) model: speed and acceptance, rollback storage and time, and
disk bytes per token under a RAM budget.

    .venv/bin/python benchmarks/bench_spec.py [--tokens 64] [--repeats 3] [--model DIR] [--only-ngram]

Prints one summary line and a JSON record. Each speed figure is a ratio against plain greedy decoding measured in
the same run, A/B interleaved, median over repeats: `speedup` end to end (the prompt's prefill included, which
speculation does not change), `decode_speedup` from the first token on (the decode phase, the part speculation
speeds up). Prompts are held-out stdlib text (never trained on):
- input-grounded: a held-out code excerpt, then a comment asking for the same code with a small change, then the
  excerpt's first line: the model's greedy continuation quotes the excerpt as far as it has learned to copy;
- open-ended: the start of a held-out paragraph of English prose.
A replay drafter that proposes the known plain-greedy continuation (corrupted at a chosen rate) shows the
mechanism's speed at a given acceptance, independent of what this small model copies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.engine.generate import generate
from k3serve.lab.replay_drafter import ReplayDrafter, ReplayFactory
from k3serve.engine.sampling import SamplingParams
from k3serve.engine.speculative import SpeculativeConfig
from k3serve.loading import load_model
from k3serve.model.interface import ForwardItem
from k3serve.model.rollback import RollbackCache


def task_texts() -> tuple[str, str]:
    """(input-grounded prompt, open-ended prompt) from the held-out split of the training corpus."""
    from k3serve.training.corpus import build_corpus

    corpus = build_corpus()
    code = corpus.heldout_code[3]
    start = code.find("\ndef ")
    excerpt = "\n".join(code[start + 1:].splitlines()[:14]) + "\n"
    grounded = (f"{excerpt}\n\n# The same function again, with one comment added:\n{excerpt.splitlines()[0]}\n")
    prose = next(d for d in corpus.heldout_prose if len(d) > 200)
    return grounded, prose[:160]


def budget_bytes(tokens: int, prompt: list[int], model_dir: str | None = None) -> dict:
    """Disk bytes per decoded token (after the prefill) under a RAM budget (the minimum + a quarter of the
    experts), with and without n-gram speculation (a verify window reads each layer's experts once for all its
    positions)."""
    from k3serve.stream.options import StreamOptions
    from k3serve.weights.store import PackedStore
    from k3serve.stream.budget import minimum_budget_bytes
    from k3serve.loading.streaming import default_packed_dir

    if model_dir is None:
        packed = default_packed_dir()
    else:  # a candidate checkpoint: pack it once into a temporary folder
        import tempfile

        from k3serve.weights.pack import pack_checkpoint

        packed = Path(tempfile.mkdtemp(prefix="bench-spec-packed-"))
        pack_checkpoint(model_dir, packed)
    store = PackedStore(packed)
    budget = minimum_budget_bytes(store) + store.expert_store_bytes // 4
    out = {"budget_bytes": budget}
    for name, spec in (("plain", None), ("ngram", SpeculativeConfig(drafter="ngram"))):
        loaded = load_model(None if model_dir is None else str(packed),
                            stream=StreamOptions(ram_budget=budget, cache="lfu"))
        source = loaded.model.source
        marks = []  # stats when the first token (out of the prefill) is emitted: decode reads are counted after it
        tokens_out, report = generate(loaded.model, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True),
                                      speculative=spec,
                                      on_token=lambda _t: marks.append(source.stats().stream) if not marks else None)
        stats = source.stats().stream.minus(marks[0])
        source.close()
        out[name] = {"bytes_per_token": stats.bytes_read / (len(tokens_out) - 1), "tokens": tokens_out}
    assert out["plain"]["tokens"] == out["ngram"]["tokens"], "speculation changed greedy output under a budget"
    for name in ("plain", "ngram"):
        out[name].pop("tokens")
    return out


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    parser.add_argument("--only-ngram", action="store_true",
                        help="only the two n-gram cases (grounded, open-ended): a quick check of a candidate model")
    args = parser.parse_args()
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    V = model.config.vocab_size
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    grounded_text, open_text = task_texts()
    grounded = [tokenizer.bos_id] + tokenizer.encode(grounded_text)
    open_ended = [tokenizer.bos_id] + tokenizer.encode(open_text)
    model_name = f"embedded default ({loaded.path.name})" if args.model is None else args.model
    record: dict = {"model": model_name, "tokens": args.tokens, "cases": [],
                    "grounded_prompt_tokens": len(grounded), "open_prompt_tokens": len(open_ended)}

    def case(name, prompt, spec, factory=None):
        plain_times, spec_times, plain_decode, spec_decode, stats = [], [], [], [], None
        plain_tokens = None
        for _ in range(args.repeats):
            t, (plain_tokens, plain_report) = timed(lambda: generate(model, prompt, params))
            plain_times.append(t)
            plain_decode.append(plain_report.decode_seconds)
            t, (tokens, report) = timed(lambda: generate(model, prompt, params, speculative=spec, drafters=factory))
            spec_times.append(t)
            spec_decode.append(report.decode_seconds)
            assert tokens == plain_tokens, f"{name}: speculative greedy differs from plain greedy"
            stats = report.speculation
        speedup = statistics.median(plain_times) / statistics.median(spec_times)
        decode_speedup = statistics.median(plain_decode) / statistics.median(spec_decode)
        row = {"case": name, "drafter": spec.drafter, "rollback": spec.rollback, "speedup": round(speedup, 3),
               "decode_speedup": round(decode_speedup, 3),
               "plain_tok_s": round(args.tokens / statistics.median(plain_times), 2),
               "spec_tok_s": round(args.tokens / statistics.median(spec_times), 2),
               "acceptance": round(stats.acceptance_rate, 3), "drafted": stats.drafted, "accepted": stats.accepted,
               "tokens_per_window": round(stats.emitted / max(stats.windows, 1), 2)}
        record["cases"].append(row)
        print(f"{name:<44} {row['speedup']:>5.2f}x (decode {row['decode_speedup']:.2f}x)  plain "
              f"{row['plain_tok_s']:>6.1f} tok/s  spec "
              f"{row['spec_tok_s']:>6.1f} tok/s  acceptance {row['acceptance']:.0%} "
              f"({row['accepted']}/{row['drafted']}), {row['tokens_per_window']} tok/window")
        return plain_tokens

    ngram = SpeculativeConfig(drafter="ngram")  # the default: adaptive, up to DEFAULT_DRAFT_TOKENS["ngram"] drafts
    k = ngram.max_draft_tokens
    case(f"grounded prompt, n-gram (adaptive, k <= {k})", grounded, ngram)
    case(f"open-ended prompt, n-gram (adaptive, k <= {k})", open_ended, ngram)
    short = SpeculativeConfig(drafter="ngram", num_draft_tokens=4)  # --num-draft-tokens 4: the default until 12-05
    case("grounded prompt, n-gram (adaptive, k <= 4)", grounded, short)
    case("open-ended prompt, n-gram (adaptive, k <= 4)", open_ended, short)
    if args.only_ngram:
        print(json.dumps(record))
        return
    case("open-ended prompt, resident draft (all in RAM)", open_ended, SpeculativeConfig(drafter="resident"))
    target = model.greedy(grounded, args.tokens)
    for miss in (0.0, 0.1, 0.3):
        for rollback in ("projection", "snapshot"):
            spec = SpeculativeConfig(drafter="ngram", rollback=rollback, num_draft_tokens=4)
            case(f"replay drafts, {int(miss * 100)}% corrupted, {rollback}", grounded, spec,
                 ReplayFactory(model, ReplayDrafter(len(grounded), target, miss, V)))

    # rollback: storage per sequence and time to restore after a rejected window (T = 5, keep 2)
    window = np.asarray(target[:5], np.int64)
    for method in ("snapshot", "projection"):
        capture, restore, stored = [], [], 0
        for _ in range(20):
            cache = RollbackCache(model.new_cache(), method)
            model.forward([ForwardItem(np.asarray(grounded, np.int64), cache)])
            cache.begin_window()
            t, _ = timed(lambda: model.forward([ForwardItem(window, cache, all_logits=True)]))
            capture.append(t)
            stored = cache.recorded_bytes
            t, _ = timed(lambda: cache.commit(2))
            restore.append(t)
        row = {"method": method, "window": 5, "kept": 2, "recorded_bytes": stored,
               "verify_forward_ms": round(1e3 * statistics.median(capture), 3),
               "rollback_ms": round(1e3 * statistics.median(restore), 3)}
        record.setdefault("rollback", []).append(row)
        print(f"rollback {method:<10} T=5 keep 2: {stored / 1024:8.1f} KiB recorded, verify forward "
              f"{row['verify_forward_ms']:.2f} ms (includes recording), rollback {row['rollback_ms']:.3f} ms")
    record["under_budget"] = {}
    for label, prompt in (("grounded", grounded), ("open-ended", open_ended)):
        b = record["under_budget"][label] = budget_bytes(args.tokens, prompt, args.model)
        print(f"under a {b['budget_bytes'] / 2**20:.1f} MiB budget, {label}: "
              f"{b['plain']['bytes_per_token'] / 1024:.0f} KiB read per token plain, "
              f"{b['ngram']['bytes_per_token'] / 1024:.0f} KiB with n-gram speculation")
    best = max(r["speedup"] for r in record["cases"])
    print(f"summary: best {best:.2f}x; open-ended n-gram "
          f"{record['cases'][1]['speedup']:.2f}x; greedy output identical in every case")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
