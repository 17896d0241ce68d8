"""Byte-level BPE tokenizer reading the K3 on-disk format.

A tokenizer folder holds two files:

- `tiktoken.model`: one line per base token, `<base64 of the token's bytes> <rank>`, ranks dense 0..N-1.
  The rank is also the token id. Every single byte must be a base token, so any byte string is encodable.
- `tokenizer_config.json`: `pattern` (the pre-tokenizer split regex, `regex` module syntax), `special_tokens`
  (strings with ids N + index), `bos_token` (a special token string or null), `eos_tokens` (special token
  strings the model may end with) and an optional `chat_template`.

Encoding splits text with the pattern, then merges each piece's bytes pairwise: repeatedly merge the adjacent pair
whose concatenation has the lowest rank (leftmost on ties) until no adjacent concatenation is a token.
Decoding concatenates token bytes; special tokens decode to their strings.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import heapq
import json
import logging
import operator
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import regex

from k3serve.errors import TokenizerError, unencodable_text_error

logger = logging.getLogger(__name__)

MODEL_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"

# Our default pre-tokenizer split, in order of preference:
#   English contractions ('s 't 're 've 'm 'll 'd, any case); letter runs (with combining marks) with an optional
#   leading space; digit runs of 1-3; punctuation runs with an optional leading space, absorbing trailing newlines;
#   newlines with the spaces before them; a whitespace run that leaves its last space to the next word (so code
#   indentation becomes one piece and ` def` another); any remaining whitespace.
# NOTE: the alternatives cover every code point (letters/marks, numbers, whitespace, everything else), so no text
# falls between matches; the encoder still handles gaps for patterns that do not.
DEFAULT_PATTERN = "|".join([
    r"'(?i:[sdmt]|ll|ve|re)",
    r" ?[\p{L}\p{M}]+",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

DEFAULT_SPECIAL_TOKENS: tuple[str, ...] = (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "[PAD]",
)
DEFAULT_BOS_TOKEN = "[BOS]"
DEFAULT_EOS_TOKENS: tuple[str, ...] = ("[EOS]", "<|im_end|>")

# Pieces up to this many bytes use the quadratic merge loop; longer ones the heap-based merge (same result).
_SHORT_PIECE_BYTES = 48
# Pieces longer than this are not cached: they are rare and would crowd out the common ones.
_MAX_CACHED_PIECE_BYTES = 256
_DEFAULT_CACHE_SIZE = 1 << 16


# ----------------------------------------------------------------------------------------------------------------
# BPE merge: a slow reference and a heap-based fast path that must agree exactly.

def merge_piece_reference(piece: bytes, ranks: Mapping[bytes, int]) -> list[int]:
    """Merge one piece by lowest rank, leftmost on ties; O(n^2). Every single byte of `piece` must be in `ranks`."""
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_rank = -1
        best_index = -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_index < 0 or rank < best_rank):
                best_rank, best_index = rank, i
        if best_index < 0:
            break
        parts[best_index:best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    return [ranks[part] for part in parts]


def merge_piece_heap(piece: bytes, ranks: Mapping[bytes, int]) -> list[int]:
    """Same result as `merge_piece_reference` in O(n log n): candidate pairs in a heap keyed by (rank, offset).

    Parts are identified by their start offset in `piece`; `next_start[s]` is the start of the part after the one
    starting at `s` (len(piece) for the last). A heap entry (rank, left, right, right_end) is stale unless both
    parts are still alive and still span exactly [left, right) and [right, right_end).
    """
    length = len(piece)
    if length <= 1:
        return [ranks[piece]] if length else []
    next_start = list(range(1, length + 1))
    prev_start = list(range(-1, length - 1))
    alive = [True] * length
    heap: list[tuple[int, int, int, int]] = []
    for i in range(length - 1):
        rank = ranks.get(piece[i:i + 2])
        if rank is not None:
            heap.append((rank, i, i + 1, i + 2))
    heapq.heapify(heap)

    def push_pair(left: int) -> None:
        right = next_start[left]
        if right >= length:
            return
        right_end = next_start[right]
        rank = ranks.get(piece[left:right_end])
        if rank is not None:
            heapq.heappush(heap, (rank, left, right, right_end))

    while heap:
        _, left, right, right_end = heapq.heappop(heap)
        if not (alive[left] and alive[right] and next_start[left] == right and next_start[right] == right_end):
            continue
        alive[right] = False
        next_start[left] = right_end
        if right_end < length:
            prev_start[right_end] = left
        if prev_start[left] >= 0:
            push_pair(prev_start[left])
        push_pair(left)

    ids = []
    start = 0
    while start < length:
        ids.append(ranks[piece[start:next_start[start]]])
        start = next_start[start]
    return ids


# ----------------------------------------------------------------------------------------------------------------

class StreamDecoder:
    """Turns generated ids, one at a time, into the text to show, holding back bytes of an unfinished UTF-8
    character. Special tokens (`[BOS]`, `[EOS]`, chat markers) are control, not text: they add nothing.

    The concatenation of every `add` result and the final `flush` equals `tokenizer.decode` of the ids without the
    special ones.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Feed one id; return the text completed by it (possibly empty; always empty for a special token)."""
        data = self._tokenizer.id_to_bytes(token_id)  # an unknown id is a TokenizerError, special or not
        if self._tokenizer.is_special(token_id):
            return ""
        return self._decoder.decode(data, final=False)

    def add_many(self, ids: Iterable[int]) -> str:
        """Feed several ids; return the text they complete."""
        return "".join(self.add(token_id) for token_id in ids)

    def flush(self) -> str:
        """End of stream: return what is still held back (an incomplete character becomes U+FFFD) and reset."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


class PieceCache:
    """A thread-safe LRU of piece bytes -> token ids, shared by the BPE tokenizers."""

    def __init__(self, size: int) -> None:
        self._entries: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, piece: bytes) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._entries.get(piece)
            if ids is not None:
                self._entries.move_to_end(piece)
            return ids

    def put(self, piece: bytes, ids: tuple[int, ...]) -> None:
        with self._lock:
            self._entries[piece] = ids
            if len(self._entries) > self._size:
                self._entries.popitem(last=False)


class ByteDecoding:
    """Decoding for any tokenizer whose tokens are byte strings (`id_to_bytes`)."""

    def id_to_bytes(self, token_id: int) -> bytes:
        raise NotImplementedError

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The exact bytes of a sequence of ids."""
        return b"".join(self.id_to_bytes(token_id) for token_id in ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        """A decoder for ids arriving one at a time (see StreamDecoder)."""
        return StreamDecoder(self)


class Tokenizer(ByteDecoding):
    """A byte-level BPE tokenizer: base tokens (rank = id) followed by special tokens."""

    def __init__(self, tokens: list[bytes], pattern: str, special_tokens: list[str], bos_token: str | None,
                 eos_tokens: list[str], chat_template: str | None = None,
                 cache_size: int = _DEFAULT_CACHE_SIZE) -> None:
        """`tokens[i]` is the bytes of base token i. Raises TokenizerError on an inconsistent vocabulary."""
        self._tokens: list[bytes] = list(tokens)
        self._ranks: dict[bytes, int] = {}
        for rank, token in enumerate(self._tokens):
            if not token:
                raise TokenizerError(f"base token {rank} is empty")
            if token in self._ranks:
                raise TokenizerError(f"base tokens {self._ranks[token]} and {rank} have the same bytes {token!r}")
            self._ranks[token] = rank
        missing = [byte for byte in range(256) if bytes([byte]) not in self._ranks]
        if missing:
            raise TokenizerError(f"{len(missing)} single bytes are not base tokens (first: {missing[0]:#04x}); "
                                 "every byte must be a token for byte-level BPE")

        self.pattern = pattern
        try:
            self._split = regex.compile(pattern)
        except regex.error as exc:
            raise TokenizerError(f"bad split pattern: {exc}") from exc

        self.special_tokens: dict[str, int] = {}
        for index, special in enumerate(special_tokens):
            if not isinstance(special, str) or not special:
                raise TokenizerError(f"special token {index} must be a non-empty string, got {special!r}")
            if special in self.special_tokens:
                raise TokenizerError(f"special token {special!r} is listed twice")
            self.special_tokens[special] = len(self._tokens) + index
        self._special_bytes = {token_id: special.encode("utf-8") for special, token_id in self.special_tokens.items()}
        # longest first, so a special that is a prefix of another never wins
        ordered = sorted(self.special_tokens, key=len, reverse=True)
        self._special_split = regex.compile("|".join(regex.escape(s) for s in ordered)) if ordered else None

        self.bos_token = bos_token
        self.bos_id: int | None = None if bos_token is None else self._special_id(bos_token, "bos_token")
        self.eos_tokens = tuple(eos_tokens)
        self.eos_ids: tuple[int, ...] = tuple(self._special_id(t, "eos_tokens") for t in self.eos_tokens)
        self.chat_template = chat_template

        self._cache = PieceCache(cache_size)

    # ---- loading ---------------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tiktoken.model` and `tokenizer_config.json` from a folder."""
        folder = Path(path)
        tokens = read_tiktoken_model(folder / MODEL_FILE)
        config = _read_config(folder / CONFIG_FILE)
        return cls(tokens, config["pattern"], config["special_tokens"], config["bos_token"], config["eos_tokens"],
                   config.get("chat_template"))

    def _special_id(self, token: Any, key: str) -> int:
        if not isinstance(token, str) or token not in self.special_tokens:
            raise TokenizerError(f"{key}: {token!r} is not one of the special tokens")
        return self.special_tokens[token]

    # ---- sizes and lookups -----------------------------------------------------------------------------------

    @property
    def num_base_tokens(self) -> int:
        """N: the number of BPE tokens (ids 0..N-1)."""
        return len(self._tokens)

    @property
    def vocab_size(self) -> int:
        """Base tokens plus special tokens."""
        return len(self._tokens) + len(self.special_tokens)

    def id_to_bytes(self, token_id: int) -> bytes:
        """The bytes of one token; a special token gives its string's UTF-8. Out of range -> TokenizerError."""
        try:
            index = operator.index(token_id)
        except TypeError:
            raise TokenizerError(f"token id must be an integer, got {token_id!r}") from None
        if 0 <= index < len(self._tokens):
            return self._tokens[index]
        special = self._special_bytes.get(index)
        if special is None:
            raise TokenizerError(f"token id {index} is out of range [0, {self.vocab_size})")
        return special

    def is_special(self, token_id: int) -> bool:
        """Whether an id is a special token."""
        return token_id in self._special_bytes

    # ---- encoding --------------------------------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. With `allow_special`, special token strings become their ids; otherwise they are
        ordinary text. Lone surrogates (not encodable as UTF-8) -> TokenizerError."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        if not allow_special or self._special_split is None:
            return self._encode_ordinary(text, "strict")
        ids: list[int] = []
        start = 0
        for match in self._special_split.finditer(text):
            ids += self._encode_ordinary(text[start:match.start()], "strict")
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        ids += self._encode_ordinary(text[start:], "strict")
        return ids

    def encode_bytes(self, data: bytes) -> list[int]:
        """Token ids of arbitrary bytes (invalid UTF-8 included). Never produces special ids.

        Valid UTF-8 encodes exactly as `encode(data.decode())`; an undecodable byte is carried through the split
        as a surrogate escape (U+DC80..U+DCFF) and re-encoded to the same byte.
        """
        return self._encode_ordinary(bytes(data).decode("utf-8", errors="surrogateescape"), "surrogateescape")

    def _encode_ordinary(self, text: str, errors: str) -> list[int]:
        ids: list[int] = []
        start = 0
        try:
            for match in self._split.finditer(text):
                if match.start() > start:  # text the pattern skipped: still encoded, never dropped
                    ids += self._encode_piece(text[start:match.start()].encode("utf-8", errors))
                if match.end() > match.start():
                    ids += self._encode_piece(match.group().encode("utf-8", errors))
                start = match.end()
            if start < len(text):
                ids += self._encode_piece(text[start:].encode("utf-8", errors))
        except UnicodeEncodeError as exc:
            raise unencodable_text_error(text) from None
        return ids

    def _encode_piece(self, piece: bytes) -> tuple[int, ...]:
        rank = self._ranks.get(piece)
        if rank is not None:
            return (rank,)
        cacheable = len(piece) <= _MAX_CACHED_PIECE_BYTES
        cached = self._cache.get(piece) if cacheable else None
        if cached is not None:
            return cached
        if len(piece) <= _SHORT_PIECE_BYTES:
            ids = tuple(merge_piece_reference(piece, self._ranks))
        else:
            ids = tuple(merge_piece_heap(piece, self._ranks))
        if cacheable:
            self._cache.put(piece, ids)
        return ids


    def __repr__(self) -> str:
        return (f"Tokenizer(num_base_tokens={self.num_base_tokens}, num_special={len(self.special_tokens)}, "
                f"bos_id={self.bos_id}, eos_ids={self.eos_ids})")


# ----------------------------------------------------------------------------------------------------------------
# File readers: they refuse to guess. A missing file or key, or a malformed line, is a TokenizerError naming it.

def read_tiktoken_model(path: Path) -> list[bytes]:
    """Base token bytes in rank order from a `tiktoken.model` file."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"missing tokenizer file {path}") from None
    except OSError as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    by_rank: dict[int, bytes] = {}
    for line_number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise TokenizerError(f"{path.name} line {line_number}: expected '<base64> <rank>', got {line[:80]!r}")
        encoded, rank_text = fields
        try:
            token = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise TokenizerError(f"{path.name} line {line_number}: invalid base64 {encoded[:80]!r}") from None
        if not rank_text.isdigit():
            raise TokenizerError(f"{path.name} line {line_number}: rank {rank_text[:40]!r} is not a non-negative "
                                 "integer")
        rank = int(rank_text)
        if rank in by_rank:
            raise TokenizerError(f"{path.name} line {line_number}: duplicate rank {rank}")
        by_rank[rank] = token
    if not by_rank:
        raise TokenizerError(f"{path.name} has no tokens")
    if max(by_rank) != len(by_rank) - 1:
        first_gap = next(rank for rank in range(len(by_rank)) if rank not in by_rank)
        raise TokenizerError(f"{path.name}: ranks are not dense 0..{len(by_rank) - 1} (rank {first_gap} is missing, "
                             f"max rank is {max(by_rank)})")
    return [by_rank[rank] for rank in range(len(by_rank))]


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TokenizerError(f"missing tokenizer file {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot parse {path.name}: {exc}") from exc
    if not isinstance(config, dict):
        raise TokenizerError(f"{path.name} must hold a JSON object")
    for key in ("pattern", "special_tokens", "bos_token", "eos_tokens"):
        if key not in config:
            raise TokenizerError(f"{path.name} is missing key {key!r}")
    if not isinstance(config["pattern"], str):
        raise TokenizerError(f"{path.name}: 'pattern' must be a string")
    if not isinstance(config["special_tokens"], list):
        raise TokenizerError(f"{path.name}: 'special_tokens' must be a list of strings")
    if config["bos_token"] is not None and not isinstance(config["bos_token"], str):
        raise TokenizerError(f"{path.name}: 'bos_token' must be a string or null")
    if not isinstance(config["eos_tokens"], list):
        raise TokenizerError(f"{path.name}: 'eos_tokens' must be a list of strings")
    template = config.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{path.name}: 'chat_template' must be a string")
    return config
