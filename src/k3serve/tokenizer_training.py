"""Train a byte-level BPE vocabulary and write it in the K3 tokenizer format.

Training (Sennrich et al. 2016, byte-level as in GPT-2): split the corpus with the pre-tokenizer pattern, count
each distinct piece once with its frequency, start every piece as its UTF-8 bytes, then repeat: merge the adjacent
pair with the highest weighted count into a new token. Ties go to the pair whose (left bytes, right bytes) sorts
first, so the result depends only on the corpus, never on hash or insertion order.

Pair counts are kept incrementally: a merge only revisits the pieces that contain the merged pair (an inverted
index pair -> pieces), and a max-heap with lazy invalidation yields the next best pair.

CLI: `python -m k3serve.tokenizer_training --out DIR --vocab-size N [--max-bytes M]` trains on the Python
standard library's own source and writes DIR/tiktoken.model and DIR/tokenizer_config.json.
"""

from __future__ import annotations

import argparse
import base64
import functools
import heapq
import json
import logging
import platform
import sys
import sysconfig
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import regex

from k3serve.errors import TokenizerError
from k3serve.tokenizer import (
    CONFIG_FILE, DEFAULT_BOS_TOKEN, DEFAULT_EOS_TOKENS, DEFAULT_PATTERN, DEFAULT_SPECIAL_TOKENS, MODEL_FILE, Tokenizer,
)

logger = logging.getLogger(__name__)

# Folders of the stdlib that are not representative source: test suites, third-party packages, generated codec
# tables, caches.
_SKIPPED_STDLIB_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings",
                                  "__pycache__"})
DEFAULT_MAX_BYTES = 4_000_000


def count_pieces(texts: Iterable[str], pattern: str) -> Counter[bytes]:
    """Frequency of each distinct pre-tokenized piece (as UTF-8 bytes) over all texts."""
    try:
        split = regex.compile(pattern)
    except regex.error as exc:
        raise TokenizerError(f"bad split pattern: {exc}") from exc
    text_counts: Counter[str] = Counter()
    for text in texts:
        if split.groups == 0:
            text_counts.update(split.findall(text))
        else:
            text_counts.update(match.group() for match in split.finditer(text))
    piece_counts: Counter[bytes] = Counter()
    for piece, count in text_counts.items():
        if not piece:
            continue
        try:
            piece_counts[piece.encode("utf-8")] += count
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"training text is not encodable as UTF-8: {exc.reason}") from None
    return piece_counts


def _merge_word(word: list[int], left: int, right: int, merged: int) -> list[int]:
    """Replace each non-overlapping (left, right) in `word`, scanning left to right, by `merged`."""
    out: list[int] = []
    i = 0
    last = len(word) - 1
    while i <= last:
        if i < last and word[i] == left and word[i + 1] == right:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(texts: Iterable[str], vocab_size: int, pattern: str, min_pair_count: int = 2) -> list[bytes]:
    """Learn a byte-level BPE vocabulary of at most `vocab_size` base tokens.

    Returns token bytes in rank order: the 256 single bytes in byte order, then one token per merge in the order
    learned. Stops early (with a warning) when no pair occurs `min_pair_count` times. A merge whose concatenation
    already is a token (reached by another split) reuses that token instead of adding a duplicate.
    """
    if vocab_size < 256:
        raise TokenizerError(f"vocab_size must be at least 256 (the single bytes), got {vocab_size}")
    if min_pair_count < 1:
        raise TokenizerError(f"min_pair_count must be at least 1, got {min_pair_count}")
    started = time.perf_counter()
    piece_counts = count_pieces(texts, pattern)
    words: list[list[int]] = [list(piece) for piece in piece_counts]
    weights: list[int] = list(piece_counts.values())
    tokens: list[bytes] = [bytes([byte]) for byte in range(256)]
    token_ids: dict[bytes, int] = {token: rank for rank, token in enumerate(tokens)}
    logger.info("training BPE: %d distinct pieces, %d occurrences, %d bytes", len(words), sum(weights),
                sum(len(word) * weight for word, weight in zip(words, weights)))

    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    pair_pieces: dict[tuple[int, int], set[int]] = defaultdict(set)
    for index, (word, weight) in enumerate(zip(words, weights)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += weight
            pair_pieces[pair].add(index)

    # max-heap on count; ties -> smallest (left bytes, right bytes). An entry is live iff its count is current.
    heap = [(-count, tokens[left], tokens[right], (left, right)) for (left, right), count in pair_counts.items()]
    heapq.heapify(heap)

    while len(tokens) < vocab_size:
        best: tuple[int, int] | None = None
        while heap:
            negative_count, _, _, pair = heapq.heappop(heap)
            if pair_counts.get(pair, 0) == -negative_count:
                best = pair
                break
        if best is None or pair_counts[best] < min_pair_count:
            logger.warning("BPE training stopped at %d tokens (requested %d): no pair occurs %d times",
                           len(tokens), vocab_size, min_pair_count)
            break
        left, right = best
        merged_bytes = tokens[left] + tokens[right]
        merged = token_ids.get(merged_bytes)
        if merged is None:
            merged = len(tokens)
            tokens.append(merged_bytes)
            token_ids[merged_bytes] = merged

        changed: set[tuple[int, int]] = set()
        for index in sorted(pair_pieces.pop(best)):
            word = words[index]
            new_word = _merge_word(word, left, right, merged)
            if len(new_word) == len(word):  # stale index entry: the pair left this piece earlier
                continue
            weight = weights[index]
            for pair in zip(word, word[1:]):
                pair_counts[pair] -= weight
                changed.add(pair)
            for pair in zip(new_word, new_word[1:]):
                pair_counts[pair] += weight
                pair_pieces[pair].add(index)
                changed.add(pair)
            words[index] = new_word
        for pair in changed:
            count = pair_counts[pair]
            if count > 0:
                heapq.heappush(heap, (-count, tokens[pair[0]], tokens[pair[1]], pair))
            else:
                del pair_counts[pair]
                pair_pieces.pop(pair, None)
        if len(tokens) % 128 == 0:
            logger.info("  %d / %d tokens (%.1f s)", len(tokens), vocab_size, time.perf_counter() - started)
    logger.info("trained %d tokens in %.1f s", len(tokens), time.perf_counter() - started)
    return tokens


def write_tokenizer(folder: str | Path, tokens: list[bytes], pattern: str, special_tokens: Iterable[str],
                    bos_token: str | None, eos_tokens: Iterable[str], chat_template: str | None = None,
                    source: str | None = None) -> Path:
    """Write `tiktoken.model` and `tokenizer_config.json` into `folder` (created if needed) and return it.

    The vocabulary is validated first by building a Tokenizer from it, so a written folder always loads.
    `source` (optional) records how the tokenizer was built.
    """
    special_tokens = list(special_tokens)
    eos_tokens = list(eos_tokens)
    Tokenizer(tokens, pattern, special_tokens, bos_token, eos_tokens, chat_template)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(token).decode('ascii')} {rank}\n" for rank, token in enumerate(tokens)]
    (out / MODEL_FILE).write_text("".join(lines), encoding="ascii")
    config: dict[str, object] = {
        "pattern": pattern,
        "special_tokens": special_tokens,
        "bos_token": bos_token,
        "eos_tokens": eos_tokens,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    if source is not None:
        config["source"] = source
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def stdlib_source_files() -> list[Path]:
    """The standard library's .py files in sorted relative-path order, without tests and third-party packages."""
    return list(_listed_stdlib_source_files())


@functools.lru_cache(maxsize=1)
def _listed_stdlib_source_files() -> tuple[Path, ...]:
    # listed once a process (about 1 s of rglob on 2 cores; a training run lists it twice, the tests many times):
    # the stdlib does not change under a running interpreter
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [path for path in root.rglob("*.py")
             if path.is_file() and not _SKIPPED_STDLIB_DIRS.intersection(path.relative_to(root).parts[:-1])]
    return tuple(sorted(files, key=lambda path: path.relative_to(root).as_posix()))


def stdlib_corpus(max_bytes: int) -> Iterator[str]:
    """Texts of the stdlib source files in order, at most `max_bytes` UTF-8 bytes in all (the last one cut)."""
    remaining = max_bytes
    for path in stdlib_source_files():
        if remaining <= 0:
            return
        text = path.read_text(encoding="utf-8", errors="replace")
        data = text.encode("utf-8")
        if len(data) > remaining:
            text = data[:remaining].decode("utf-8", errors="ignore")
            data = text.encode("utf-8")
        remaining -= len(data)
        yield text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3serve.tokenizer_training",
                                     description="Train a byte-level BPE tokenizer on the Python standard library "
                                                 "source and write it in the K3 format.")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--vocab-size", type=int, required=True,
                        help="number of base (BPE) tokens, 256 single bytes included; the 8 specials come on top")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                        help=f"cap on the training text in bytes (default {DEFAULT_MAX_BYTES})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    started = time.perf_counter()
    texts = list(stdlib_corpus(args.max_bytes))
    num_bytes = sum(len(text.encode("utf-8")) for text in texts)
    print(f"corpus: {len(texts)} stdlib files, {num_bytes} bytes (Python {platform.python_version()})")
    try:
        tokens = train_bpe(texts, args.vocab_size, DEFAULT_PATTERN)
    except TokenizerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    source = (f"python -m k3serve.tokenizer_training --out {args.out} --vocab-size {args.vocab_size} "
              f"--max-bytes {args.max_bytes}  # byte-level BPE on {len(texts)} sorted CPython "
              f"{platform.python_version()} stdlib .py files ({num_bytes} bytes; test dirs, encodings and "
              "site-packages skipped)")
    write_tokenizer(args.out, tokens, DEFAULT_PATTERN, DEFAULT_SPECIAL_TOKENS, DEFAULT_BOS_TOKEN,
                    DEFAULT_EOS_TOKENS, source=source)
    tokenizer = Tokenizer.from_dir(args.out)
    num_tokens = sum(len(tokenizer.encode(text)) for text in texts)
    elapsed = time.perf_counter() - started
    print(f"wrote {args.out}: {tokenizer.num_base_tokens} base + {len(tokenizer.special_tokens)} special tokens; "
          f"{num_bytes / max(num_tokens, 1):.2f} bytes/token on the corpus; {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
