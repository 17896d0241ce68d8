"""The training corpus: Python standard library source mixed with English prose, with a held-out split.

Both streams come from the interpreter's own standard library, so the corpus exists offline on any machine:
- code: the stdlib .py files (k3serve.tokenizer_training.stdlib_corpus), in sorted path order;
- prose: the English docstrings and comment blocks of those same files, one document per docstring/comment block.
  (No public-domain prose package is installed by default on a fresh machine; see docs/MODEL.md.)
Documents are interleaved code, prose, code, ... and every `HOLDOUT_EVERY`-th document of each stream is held out,
so the split depends only on the Python version's stdlib, never on hash order or randomness.
"""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass

from k3serve.tokenizer_training import stdlib_corpus

HOLDOUT_EVERY = 20
MIN_PROSE_CHARS = 80


@dataclass(frozen=True)
class Corpus:
    train: list[str]
    heldout: list[str]
    num_code_bytes: int
    num_prose_bytes: int


def prose_blocks(source: str) -> list[str]:
    """English docstrings and runs of consecutive comment lines of one module (shorter ones dropped)."""
    blocks: list[str] = []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return blocks
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                blocks.append(doc)
    run: list[str] = []
    last_line = -2
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            text = tok.string.lstrip("#").strip()
            if tok.start[0] != last_line + 1 and run:
                blocks.append(" ".join(run))
                run = []
            if text and not text.startswith("!"):
                run.append(text)
            last_line = tok.start[0]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    if run:
        blocks.append(" ".join(run))
    return [b for b in blocks
            if len(b) >= MIN_PROSE_CHARS and b.isascii() and sum(ch.isalpha() for ch in b) > 0.6 * len(b)]


def build_corpus(max_code_bytes: int, max_prose_bytes: int) -> Corpus:
    code = list(stdlib_corpus(max_code_bytes))
    prose: list[str] = []
    total = 0
    for text in stdlib_corpus(1 << 40):
        for block in prose_blocks(text):
            if total >= max_prose_bytes:
                break
            prose.append(block + "\n")
            total += len(block) + 1
        if total >= max_prose_bytes:
            break
    train: list[str] = []
    heldout: list[str] = []
    for stream in (code, prose):
        for index, doc in enumerate(stream):
            (heldout if index % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else train).append(doc)
    # interleave the streams in the training order: code, prose, code, ... (deterministic)
    train_code = [d for i, d in enumerate(code) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    train_prose = [d for i, d in enumerate(prose) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    ratio = max(1, len(train_prose) // max(len(train_code), 1))
    mixed: list[str] = []
    for i, doc in enumerate(train_code):
        mixed.append(doc)
        mixed.extend(train_prose[i * ratio:(i + 1) * ratio])
    mixed.extend(train_prose[len(train_code) * ratio:])
    return Corpus(train=mixed, heldout=heldout, num_code_bytes=sum(len(d.encode()) for d in code),
                  num_prose_bytes=sum(len(d.encode()) for d in prose))
