"""Per-token cost of constrained decoding with llguidance, xgrammar and outlines-core on our tokenizer.

For a JSON schema (a tool call: a name from an enum and typed arguments), each library builds its matcher from the
tokenizer's vocabulary (bytes per token id), then walks the token ids of a valid document: at every token it
computes the mask of allowed next tokens and consumes the token. Reported: the one-off build time (tokenizer +
grammar compile) and the median per-token time of mask + advance over --rounds walks, each library in turn
within a round (alternated), on the embedded model's tokenizer (default) or --tokenizer DIR.
Prints one summary line and a JSON record on the last line.

    python benchmarks/bench_grammar.py [--rounds 5] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "search_web", "send_email"]},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                           "units": {"enum": ["metric", "imperial"]}},
            "required": ["city", "days", "units"], "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"], "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "get_weather", "arguments": {"city": "Paris, 11th arrondissement", "days": 14,
                                                            "units": "metric"}}, separators=(",", ":"))


def _llguidance(tokenizer, ids):
    import llguidance
    import llguidance.numpy

    from k3serve.engine.constraints import grammar_tokenizer as llg_tokenizer

    started = time.perf_counter()
    lltok = llg_tokenizer(tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    build = time.perf_counter() - started
    mask = llguidance.numpy.allocate_token_bitmask(1, lltok.vocab_size)

    def walk() -> float:
        matcher.reset()
        started = time.perf_counter()
        for token in ids:
            llguidance.numpy.fill_next_token_bitmask(matcher, mask)
            assert matcher.consume_token(token), matcher.get_error()
        return (time.perf_counter() - started) / len(ids)
    return build, walk


def _xgrammar(tokenizer, ids):
    import xgrammar

    started = time.perf_counter()
    vocab = [tokenizer.id_to_bytes(i) for i in range(tokenizer.vocab_size)]
    info = xgrammar.TokenizerInfo(vocab, vocab_size=tokenizer.vocab_size, stop_token_ids=[tokenizer.eos_ids[0]])
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                   separators=(",", ":"))
    matcher = xgrammar.GrammarMatcher(compiled)
    build = time.perf_counter() - started
    mask = xgrammar.allocate_token_bitmask(1, tokenizer.vocab_size)

    def walk() -> float:
        matcher.reset()
        started = time.perf_counter()
        for token in ids:
            matcher.fill_next_token_bitmask(mask)
            assert matcher.accept_token(token)
        return (time.perf_counter() - started) / len(ids)
    return build, walk


def _outlines(tokenizer, ids):
    import outlines_core

    started = time.perf_counter()
    table: dict[bytes, list[int]] = {}
    for i in range(tokenizer.vocab_size):
        if i != tokenizer.eos_ids[0] and not tokenizer.is_special(i):
            table.setdefault(tokenizer.id_to_bytes(i), []).append(i)
    vocabulary = outlines_core.Vocabulary(tokenizer.eos_ids[0], table)
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, vocabulary)
    guide = outlines_core.Guide(index)
    build = time.perf_counter() - started
    mask = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)

    def walk() -> float:
        guide.reset()
        started = time.perf_counter()
        for token in ids:
            guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
            guide.advance(token)
        return (time.perf_counter() - started) / len(ids)
    return build, walk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokenizer", default=None, help="a model folder with a tokenizer (default: the embedded model)")
    args = parser.parse_args()
    from k3serve.loading import load_model

    tokenizer = load_model(args.tokenizer).tokenizer
    ids = tokenizer.encode(DOCUMENT)
    libraries = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines}
    builds, walks, errors = {}, {}, {}
    for name, make in libraries.items():
        try:
            builds[name], walks[name] = make(tokenizer, ids)
        except Exception as exc:  # noqa: BLE001 - a library that cannot run here is reported, not fatal
            errors[name] = f"{type(exc).__name__}: {exc}"
    per_token: dict[str, list[float]] = {name: [] for name in walks}
    for _ in range(args.rounds):
        for name, walk in walks.items():
            per_token[name].append(walk())
    medians = {name: statistics.median(times) for name, times in per_token.items()}
    record = {"benchmark": "grammar", "cpu_count": os.cpu_count(), "vocab_size": tokenizer.vocab_size,
              "document_tokens": len(ids), "build_seconds": builds, "per_token_seconds_median": medians,
              "per_token_seconds": per_token, "errors": errors}
    print("grammar mask + advance per token: " + ", ".join(
        f"{name} {medians[name] * 1e6:.1f} us (build {builds[name] * 1e3:.0f} ms)" for name in medians)
        + (f"; failed: {', '.join(errors)}" if errors else ""))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
