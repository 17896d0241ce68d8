"""Constrained decoding: a grammar masks each step's logits to the tokens that keep the output a prefix of a
sentence of the grammar (JSON mode, a JSON schema, a tool call), through llguidance.

    allowed_t = { v : output_{<t} + bytes(v) is a prefix of some sentence of G }    (EOS only once G is complete)
    logits'_t[v] = logits_t[v] if v in allowed_t else -inf

llguidance was chosen by measuring every candidate on this CPU with our tokenizer (benchmarks/bench_grammar.py,
docs/BENCHMARKS.md): it builds its token trie from our vocabulary (bytes per token id) with no Hugging Face
tokenizer, compiles a JSON schema lazily (no per-schema warm-up), and computes a mask in microseconds per token.

A `Grammar` is compiled once per request; each sequence (each of the n completions) gets its own
`TokenConstraint`, which the sampler applies (engine/sampling.py) and which advances on every token the engine
appends. Speculative verification advances a copy of it (`fork`) through the drafts.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from k3serve.errors import RequestError

logger = logging.getLogger(__name__)

_TOKENIZERS: dict[int, tuple[Any, Any]] = {}  # id(k3serve tokenizer) -> (tokenizer, llguidance tokenizer)
_TOKENIZERS_LOCK = threading.Lock()


class _VocabWrapper:
    """What llguidance's `TokenizerWrapper` reads: the bytes of every token id, the special ids and an encoder."""

    def __init__(self, tokenizer) -> None:
        self.eos_token_id = tokenizer.eos_ids[0] if tokenizer.eos_ids else None
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.id_to_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        self._tokenizer = tokenizer

    def __call__(self, data: bytes) -> list[int]:
        return self._tokenizer.encode_bytes(data)


def grammar_tokenizer(tokenizer):
    """The llguidance tokenizer over a k3serve tokenizer (built once per tokenizer: ~10 ms per 1K tokens)."""
    import llguidance

    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(id(tokenizer))
        if cached is not None and cached[0] is tokenizer:
            return cached[1]
        wrapped = llguidance.TokenizerWrapper(_VocabWrapper(tokenizer))
        built = llguidance.LLTokenizer(wrapped, eos_token=list(tokenizer.eos_ids) or None)
        _TOKENIZERS[id(tokenizer)] = (tokenizer, built)
        return built


class OutputConstraint(Protocol):
    """What a request's output must satisfy, as the engine takes it (`add_request(grammar=...)`): a fresh
    `TokenConstraint`-like position per sequence (mask / accept / fork). `ends_on_eos`: an end-of-sequence id
    always ends the output (a grammar's document is complete), `ignore_eos` or not."""

    ends_on_eos: bool

    def constraint(self): ...


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's serialised form, with the tokenizer it masks for (the model's logits may be wider
    than the tokenizer: ids past it are never allowed)."""

    ends_on_eos = True  # nothing may follow a complete document

    text: str
    tokenizer: Any  # llguidance.LLTokenizer

    @classmethod
    def from_json_schema(cls, schema: dict | bool, tokenizer) -> Grammar:
        """Any JSON document valid under `schema` (True: any JSON object, for JSON mode)."""
        import llguidance

        if schema is True:
            schema = {"type": "object"}
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as exc:
            raise RequestError(f"the JSON schema cannot be used: {exc}") from None
        return cls._checked(text, tokenizer)

    @classmethod
    def _checked(cls, text: str, tokenizer) -> Grammar:
        import llguidance

        lltok = grammar_tokenizer(tokenizer)
        error = llguidance.LLMatcher.validate_grammar(text, lltok)
        if error and not error.startswith("WARNING"):
            raise RequestError(f"the JSON schema cannot be used: {error}")
        return cls(text, lltok)

    def constraint(self) -> TokenConstraint:
        """A fresh matcher at the start of the output, for one sequence."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, self.text, log_level=0)
        if matcher.is_error():
            raise RequestError(f"the grammar cannot be used: {matcher.get_error()}")
        return TokenConstraint(matcher, self.tokenizer.vocab_size)


def bound_grammar(text: str | None, tokenizer) -> Grammar | None:
    """A grammar's serialised text (as a request carries it) bound to the tokenizer of the process that runs it."""
    return None if text is None else Grammar(text, grammar_tokenizer(tokenizer))


class TokenConstraint:
    """One sequence's position in a grammar: the allowed next tokens, advanced token by token."""

    def __init__(self, matcher, grammar_vocab: int) -> None:
        self._matcher = matcher
        self._grammar_vocab = grammar_vocab
        self._bitmask = np.zeros((grammar_vocab + 31) // 32, dtype=np.int32)

    def allowed(self, vocab_size: int | None = None) -> np.ndarray:
        """[V] bool: the tokens that may come next (V = vocab_size, default the tokenizer's)."""
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:self._grammar_vocab]  # [V grammar]
        width = self._grammar_vocab if vocab_size is None else vocab_size
        out = np.zeros(width, dtype=bool)
        shared = min(width, self._grammar_vocab)
        out[:shared] = bits[:shared].astype(bool)
        return out

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] -> a copy with every token the grammar forbids at -inf."""
        allowed = self.allowed(logits.shape[-1])
        if not allowed.any():  # the matcher failed (should not happen after allowed tokens): leave EOS possible
            raise RequestError(f"the grammar allows no next token: {self._matcher.get_error() or 'dead end'}")
        return np.where(allowed, logits, -np.inf).astype(logits.dtype, copy=False)

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise RequestError(f"token {token} breaks the grammar: {self._matcher.get_error()}")

    def fork(self) -> TokenConstraint:
        """An independent copy at the same position (speculative verification advances a copy through the drafts
        and drops it). Not `rollback`: llguidance does not record tokens consumed once the grammar has stopped
        (the end-of-sequence ids after a complete document), so rolling back over them undid real tokens."""
        return TokenConstraint(self._matcher.deep_copy(), self._grammar_vocab)

    @property
    def is_complete(self) -> bool:
        """The output so far is a whole sentence of the grammar (only an end-of-sequence token may follow)."""
        return self._matcher.is_accepting()
