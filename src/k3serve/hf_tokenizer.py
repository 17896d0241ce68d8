"""Byte-level BPE tokenizer reading Hugging Face `tokenizer.json` (Qwen3-MoE, Qwen3-Next, DeepSeek-V3, Llama-3).

Same public API as `k3serve.tokenizer.Tokenizer`, so the CLI and the server take either.

A `tokenizer.json` describes a pipeline; the parts read here are:

- `normalizer`: null, or NFC / NFD / NFKC / NFKD (alone or in a Sequence), applied to the text between added tokens.
- `pre_tokenizer`: splits text into pieces. Either `ByteLevel` (optionally prepending a space to each segment,
  then splitting with the GPT-2 pattern) or a `Sequence` of `Split` (regex or literal; behaviours Isolated,
  Removed, MergedWithPrevious, MergedWithNext, Contiguous; optional invert) and `Digits` steps ending in
  `ByteLevel` with `use_regex` false. Each step applies to every piece the previous one produced.
- `model` (type BPE): `vocab` maps token strings to ids; `merges` lists pairs ("a b" or ["a", "b"]), the merge's
  index is its priority. Token strings are bytes written in the ByteLevel alphabet (below).
- `added_tokens`: strings with fixed ids, cut out of the text before normalization. Those marked `special` are
  matched only with `allow_special=True`; the others (e.g. Qwen3's `<think>`) are plain vocabulary and always are.
- `decoder`: ByteLevel, so decoding concatenates token bytes.

ByteLevel alphabet (GPT-2): every byte is written as one printable character. Bytes that are already printable and
not whitespace (0x21-0x7E, 0xA1-0xAC, 0xAE-0xFF) stand for themselves; the other 68 bytes, in increasing order,
become U+0100, U+0101, ... (so the space 0x20 is U+0120 'Ġ' and the newline 0x0A is U+010A 'Ċ').

BPE on one piece: start from one symbol per byte, then repeatedly merge the adjacent pair with the lowest merge
index (leftmost on ties) until no adjacent pair is a merge. With `ignore_merges`, a piece that is itself a vocab
token is that token. Note the difference from `Tokenizer`: the priority belongs to the pair, not to the merged
token, so the same bytes can be reachable through one split and not another.

bos/eos come from `tokenizer_config.json` (`bos_token`, `eos_token`: strings or {"content": ...}; `add_bos_token`
false means no bos is prepended) plus `eos_token_id` (int or list) of `config.json` and `generation_config.json`.
"""

from __future__ import annotations

import heapq
import json
import logging
import operator
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import regex

from k3serve.errors import TokenizerError, unencodable_text_error
from k3serve.tokenizer import ByteDecoding, PieceCache

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MODEL_CONFIG_FILES = ("config.json", "generation_config.json")

# The split the ByteLevel pre-tokenizer uses when `use_regex` is true (GPT-2's): English contractions (lower case
# only), then letter runs, digit runs and runs of other non-space characters, each with an optional leading space;
# then a whitespace run that leaves its last character to the next piece, then any remaining whitespace.
GPT2_PATTERN = "|".join([
    r"'s|'t|'re|'ve|'m|'ll|'d",
    r" ?\p{L}+",
    r" ?\p{N}+",
    r" ?[^\s\p{L}\p{N}]+",
    r"\s+(?!\S)",
    r"\s+",
])

_SPLIT_BEHAVIORS = ("Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous")
_NORMALIZER_FORMS = ("NFC", "NFD", "NFKC", "NFKD")

# As in Tokenizer: short pieces use the quadratic merge loop, long ones the heap; long pieces are not cached.
_SHORT_PIECE_BYTES = 48
_MAX_CACHED_PIECE_BYTES = 256
_DEFAULT_CACHE_SIZE = 1 << 16


def byte_level_alphabet() -> tuple[str, ...]:
    """The character standing for each byte 0..255 in ByteLevel token strings (see the module docstring)."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars = []
    num_shifted = 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + num_shifted))
            num_shifted += 1
    return tuple(chars)


_BYTE_CHARS = byte_level_alphabet()
# str.translate table from alphabet characters to the latin-1 character of their byte. Latin-1 characters outside
# the alphabet go to a non-latin-1 sentinel, so that `.encode("latin-1")` fails exactly when a token string holds
# a character that is not in the alphabet.
_TO_LATIN1: dict[int, str] = {**{code: "\U00010000" for code in range(256)},
                              **{ord(char): chr(byte) for byte, char in enumerate(_BYTE_CHARS)}}


def token_string_to_bytes(token: str) -> bytes:
    """The bytes a vocab token stands for. A string with characters outside the ByteLevel alphabet stands for its
    own UTF-8 (as the ByteLevel decoder treats it)."""
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


def bytes_to_token_string(data: bytes) -> str:
    """Inverse of `token_string_to_bytes` for alphabet strings: bytes written in the ByteLevel alphabet."""
    return "".join(_BYTE_CHARS[byte] for byte in data)


# ----------------------------------------------------------------------------------------------------------------
# BPE merge over ids: a slow reference and a heap-based fast path that must agree exactly.
# `merges[(left_id, right_id)] = (priority, merged_id)`; lower priority merges first.

Merges = Mapping[tuple[int, int], tuple[int, int]]


def merge_symbols_reference(symbols: Sequence[int], merges: Merges) -> list[int]:
    """Merge the lowest-priority adjacent pair (leftmost on ties) until none is a merge; O(n^2)."""
    parts = list(symbols)
    while len(parts) > 1:
        best: tuple[int, int] | None = None
        best_index = -1
        for i in range(len(parts) - 1):
            merge = merges.get((parts[i], parts[i + 1]))
            if merge is not None and (best is None or merge[0] < best[0]):
                best, best_index = merge, i
        if best is None:
            break
        parts[best_index:best_index + 2] = [best[1]]
    return parts


def merge_symbols_heap(symbols: Sequence[int], merges: Merges) -> list[int]:
    """Same result as `merge_symbols_reference` in O(n log n).

    Symbols are a doubly linked list over their starting slot; a heap entry (priority, slot, left_id, right_id)
    is stale unless both slots still hold those ids and are still neighbours. Slot order equals text order, so
    popping (priority, slot) gives the leftmost pair on ties.
    """
    length = len(symbols)
    if length <= 1:
        return list(symbols)
    ids = list(symbols)
    next_slot = list(range(1, length + 1))
    prev_slot = list(range(-1, length - 1))
    alive = [True] * length
    heap: list[tuple[int, int, int, int]] = []
    for i in range(length - 1):
        merge = merges.get((ids[i], ids[i + 1]))
        if merge is not None:
            heap.append((merge[0], i, ids[i], ids[i + 1]))
    heapq.heapify(heap)

    def push_pair(left: int) -> None:
        right = next_slot[left]
        if right >= length:
            return
        merge = merges.get((ids[left], ids[right]))
        if merge is not None:
            heapq.heappush(heap, (merge[0], left, ids[left], ids[right]))

    while heap:
        _, left, left_id, right_id = heapq.heappop(heap)
        right = next_slot[left]
        if not alive[left] or right >= length or ids[left] != left_id or ids[right] != right_id:
            continue
        ids[left] = merges[(left_id, right_id)][1]
        alive[right] = False
        next_slot[left] = next_slot[right]
        if next_slot[right] < length:
            prev_slot[next_slot[right]] = left
        if prev_slot[left] >= 0:
            push_pair(prev_slot[left])
        push_pair(left)

    out = []
    slot = 0
    while slot < length:
        out.append(ids[slot])
        slot = next_slot[slot]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Pre-tokenizer steps: each maps a list of pieces to a list of pieces (never empty strings).

PreTokenizerStep = Callable[[list[str]], list[str]]


def split_pieces(text: str, pattern: regex.Pattern, behavior: str, invert: bool = False) -> list[str]:
    """Split `text` at the matches of `pattern` as the HF `Split` pre-tokenizer does.

    The text is cut into alternating matched and unmatched spans (`invert` swaps the two roles); then:
    Isolated keeps every span; Removed drops the matched ones; MergedWithPrevious glues a matched span to the
    unmatched span before it; MergedWithNext glues it to the unmatched span after it; Contiguous fuses adjacent
    spans of the same kind (runs of matches; with `invert`, runs of the pattern's matches, which then count as
    unmatched). Empty pieces are dropped.
    """
    spans: list[tuple[int, int, bool]] = []  # (start, end, matched)
    start = 0
    for match in pattern.finditer(text):
        if match.start() > start:
            spans.append((start, match.start(), invert))
        spans.append((match.start(), match.end(), not invert))
        start = match.end()
    if start < len(text):
        spans.append((start, len(text), invert))

    if behavior == "Isolated":
        kept = [(s, e) for s, e, _ in spans]
    elif behavior == "Removed":
        kept = [(s, e) for s, e, matched in spans if not matched]
    elif behavior == "MergedWithPrevious":
        kept = []
        previous_matched = False
        for s, e, matched in spans:
            if matched and not previous_matched and kept:
                kept[-1] = (kept[-1][0], e)
            else:
                kept.append((s, e))
            previous_matched = matched
    elif behavior == "MergedWithNext":
        kept = []
        next_matched = False
        for s, e, matched in reversed(spans):
            if matched and not next_matched and kept:
                kept[-1] = (s, kept[-1][1])
            else:
                kept.append((s, e))
            next_matched = matched
        kept.reverse()
    elif behavior == "Contiguous":
        kept = []
        previous_matched = False
        for s, e, matched in spans:
            if matched == previous_matched and kept:
                kept[-1] = (kept[-1][0], e)
            else:
                kept.append((s, e))
            previous_matched = matched
    else:
        raise TokenizerError(f"unsupported Split behavior {behavior!r} (supported: {', '.join(_SPLIT_BEHAVIORS)})")
    return [text[s:e] for s, e in kept if e > s]


def _regex_step(pattern: regex.Pattern, behavior: str, invert: bool) -> PreTokenizerStep:
    def step(pieces: list[str]) -> list[str]:
        return [part for piece in pieces for part in split_pieces(piece, pattern, behavior, invert)]
    return step


def _byte_level_step(add_prefix_space: bool, use_regex: bool) -> PreTokenizerStep:
    gpt2 = regex.compile(GPT2_PATTERN)

    def step(pieces: list[str]) -> list[str]:
        out = []
        for piece in pieces:
            if add_prefix_space and not piece.startswith(" "):
                piece = " " + piece
            out += split_pieces(piece, gpt2, "Isolated") if use_regex else [piece]
        return out
    return step


def _compile(pattern: str, where: str) -> regex.Pattern:
    try:
        return regex.compile(pattern)
    except regex.error as exc:
        raise TokenizerError(f"{where}: bad regex {pattern!r}: {exc}") from exc


def _build_pre_tokenizer(spec: Any) -> list[PreTokenizerStep]:
    """The steps of a pre_tokenizer spec, flattened; the last one must be ByteLevel (the only one that is)."""
    if spec is None:
        raise TokenizerError("pre_tokenizer is null; only byte-level BPE (a ByteLevel pre-tokenizer) is supported")
    items = _flatten(spec, "pre_tokenizer", "pretokenizers")
    steps: list[PreTokenizerStep] = []
    for index, item in enumerate(items):
        kind = item.get("type")
        is_last = index == len(items) - 1
        if kind == "ByteLevel":
            if not is_last:
                raise TokenizerError("pre_tokenizer: ByteLevel must be the last step (steps after it would see "
                                     "byte-level characters)")
            steps.append(_byte_level_step(bool(item.get("add_prefix_space", True)),
                                          bool(item.get("use_regex", True))))
        elif kind == "Split":
            pattern = item.get("pattern")
            if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
                compiled = _compile(pattern["Regex"], "pre_tokenizer Split")
            elif isinstance(pattern, dict) and isinstance(pattern.get("String"), str):
                compiled = regex.compile(regex.escape(pattern["String"]))
            else:
                raise TokenizerError(f"pre_tokenizer Split: unsupported pattern {pattern!r}")
            behavior = item.get("behavior")
            if behavior not in _SPLIT_BEHAVIORS:
                raise TokenizerError(f"pre_tokenizer Split: unsupported behavior {behavior!r} "
                                     f"(supported: {', '.join(_SPLIT_BEHAVIORS)})")
            steps.append(_regex_step(compiled, behavior, bool(item.get("invert", False))))
        elif kind == "Digits":
            # Rust's char::is_numeric is the N* categories, as \p{N}
            individual = bool(item.get("individual_digits", False))
            steps.append(_regex_step(regex.compile(r"\p{N}" if individual else r"\p{N}+"), "Isolated", False))
        else:
            raise TokenizerError(f"unsupported pre_tokenizer {kind!r} (supported: ByteLevel, Split, Digits, "
                                 "Sequence)")
        if is_last and kind != "ByteLevel":
            raise TokenizerError(f"pre_tokenizer does not end with ByteLevel (last step: {kind!r}); only byte-level "
                                 "BPE is supported")
    return steps


def _build_normalizer(spec: Any) -> tuple[str, ...]:
    """The Unicode normal forms to apply in order (empty for a null normalizer)."""
    if spec is None:
        return ()
    forms = []
    for item in _flatten(spec, "normalizer", "normalizers"):
        kind = item.get("type")
        if kind not in _NORMALIZER_FORMS:
            raise TokenizerError(f"unsupported normalizer {kind!r} (supported: null, "
                                 f"{', '.join(_NORMALIZER_FORMS)}, Sequence)")
        forms.append(kind)
    return tuple(forms)


def _check_decoder(spec: Any) -> None:
    if spec is None:
        raise TokenizerError("decoder is null; only the ByteLevel decoder is supported")
    for item in _flatten(spec, "decoder", "decoders"):
        if item.get("type") != "ByteLevel":
            raise TokenizerError(f"unsupported decoder {item.get('type')!r} (supported: ByteLevel)")


def _flatten(spec: Any, where: str, list_key: str) -> list[dict[str, Any]]:
    """A spec or a (nested) Sequence of specs as a flat list of dicts."""
    if not isinstance(spec, dict):
        raise TokenizerError(f"{where} must be a JSON object, got {type(spec).__name__}")
    if spec.get("type") != "Sequence":
        return [spec]
    members = spec.get(list_key)
    if not isinstance(members, list):
        raise TokenizerError(f"{where} Sequence needs a list {list_key!r}")
    return [leaf for member in members for leaf in _flatten(member, where, list_key)]


# ----------------------------------------------------------------------------------------------------------------

class HFTokenizer(ByteDecoding):
    """A byte-level BPE tokenizer built from a parsed `tokenizer.json` (see the module docstring)."""

    def __init__(self, spec: Mapping[str, Any], bos_token: str | None = None, eos_tokens: Sequence[str] = (),
                 extra_eos_ids: Sequence[int] = (), chat_template: str | None = None,
                 cache_size: int = _DEFAULT_CACHE_SIZE) -> None:
        """`spec` is the parsed tokenizer.json. `eos_tokens` are token strings, `extra_eos_ids` ids (from the
        model config). Raises TokenizerError on anything unsupported or inconsistent."""
        if not isinstance(spec, Mapping):
            raise TokenizerError("tokenizer.json must hold a JSON object")
        model = spec.get("model")
        if not isinstance(model, dict):
            raise TokenizerError("tokenizer.json has no 'model' object")
        if model.get("type") != "BPE":
            raise TokenizerError(f"unsupported tokenizer model {model.get('type')!r}; only byte-level BPE is "
                                 "supported")
        for key in ("continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(key):
                raise TokenizerError(f"unsupported BPE option {key}={model[key]!r}")
        if model.get("dropout"):
            raise TokenizerError(f"unsupported BPE option dropout={model['dropout']!r} (encoding would be random)")
        self.ignore_merges = bool(model.get("ignore_merges", False))

        self._normal_forms = _build_normalizer(spec.get("normalizer"))
        self._pre_tokenizer = _build_pre_tokenizer(spec.get("pre_tokenizer"))
        _check_decoder(spec.get("decoder"))

        vocab = model.get("vocab")
        if not isinstance(vocab, dict) or not vocab:
            raise TokenizerError("BPE model has no 'vocab' object")
        self._vocab: dict[str, int] = {}
        token_bytes: dict[int, bytes] = {}
        self._bytes_to_id: dict[bytes, int] = {}
        for token, token_id in vocab.items():
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise TokenizerError(f"vocab: id of {token!r} must be a non-negative integer, got {token_id!r}")
            if token_id in token_bytes:
                raise TokenizerError(f"vocab: id {token_id} is used twice")
            data = token_string_to_bytes(token)
            self._vocab[token] = token_id
            token_bytes[token_id] = data
            if bytes_to_token_string(data) == token:  # reachable from text: written in the alphabet
                self._bytes_to_id[data] = token_id
        self._byte_ids: list[int] = []
        for byte, char in enumerate(_BYTE_CHARS):
            if char not in self._vocab:
                raise TokenizerError(f"vocab has no token for byte {byte:#04x} ({char!r}); every byte must be a "
                                     "token for byte-level BPE")
            self._byte_ids.append(self._vocab[char])
        self.num_base_tokens = len(self._vocab)
        self._merges = self._read_merges(model.get("merges"))

        self.special_tokens: dict[str, int] = {}
        self._added: dict[str, int] = {}
        self._added_bytes: dict[int, bytes] = {}
        self._special_ids: set[int] = set()
        self._added_flags: dict[str, tuple[bool, bool, bool]] = {}  # content -> (lstrip, rstrip, single_word)
        self._read_added_tokens(spec.get("added_tokens", []))
        self._split_all = self._added_pattern(include_special=True)
        self._split_ordinary = self._added_pattern(include_special=False)

        all_ids = set(token_bytes) | set(self._added_bytes)
        self._vocab_size = max(all_ids) + 1
        self._id_bytes: list[bytes | None] = [None] * self._vocab_size
        for token_id, data in token_bytes.items():
            self._id_bytes[token_id] = data
        for token_id, data in self._added_bytes.items():  # an added token's content wins over the model's string
            self._id_bytes[token_id] = data

        self.bos_token = bos_token
        self.bos_id: int | None = None if bos_token is None else self.token_to_id(bos_token, "bos_token")
        eos_ids = [self.token_to_id(token, "eos_token") for token in eos_tokens]
        for token_id in extra_eos_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < self._vocab_size:
                raise TokenizerError(f"eos_token_id {token_id!r} is not a token id in [0, {self._vocab_size})")
            eos_ids.append(token_id)
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self.eos_tokens: tuple[str, ...] = tuple(self.id_to_bytes(i).decode("utf-8", "replace") for i in self.eos_ids)
        self.chat_template = chat_template

        self._cache = PieceCache(cache_size)

    # ---- loading ---------------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` (optional: then no bos and no eos token strings) and the
        `eos_token_id` of `config.json` / `generation_config.json` (each optional) from a checkpoint folder."""
        folder = Path(path)
        spec = _read_json(folder / TOKENIZER_FILE, required=True)
        config = _read_json(folder / CONFIG_FILE, required=False) or {}
        bos_token = _token_content(config.get("bos_token"), "bos_token")
        if config.get("add_bos_token") is False and bos_token is not None:
            logger.debug("%s: add_bos_token is false; %r is not prepended", folder, bos_token)
            bos_token = None
        eos_token = _token_content(config.get("eos_token"), "eos_token")
        extra_eos_ids: list[int] = []
        for name in MODEL_CONFIG_FILES:
            model_config = _read_json(folder / name, required=False) or {}
            value = model_config.get("eos_token_id")
            if value is None:
                continue
            values = value if isinstance(value, list) else [value]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise TokenizerError(f"{name}: eos_token_id must be an integer or a list of integers, got {value!r}")
            extra_eos_ids += values
        return cls(spec, bos_token=bos_token, eos_tokens=[] if eos_token is None else [eos_token],
                   extra_eos_ids=extra_eos_ids, chat_template=_chat_template(folder, config))

    def _read_merges(self, merges: Any) -> dict[tuple[int, int], tuple[int, int]]:
        if not isinstance(merges, list):
            raise TokenizerError("BPE model has no 'merges' list")
        out: dict[tuple[int, int], tuple[int, int]] = {}
        for priority, merge in enumerate(merges):
            if isinstance(merge, str):
                pair = merge.split(" ")
            elif isinstance(merge, list):
                pair = merge
            else:
                pair = []
            if len(pair) != 2 or not all(isinstance(part, str) for part in pair):
                raise TokenizerError(f"merge {priority}: expected 'a b' or [a, b], got {merge!r}")
            left, right = pair
            ids = [self._vocab.get(left), self._vocab.get(right), self._vocab.get(left + right)]
            if None in ids:
                missing = [t for t, i in zip((left, right, left + right), ids) if i is None][0]
                raise TokenizerError(f"merge {priority} ({left!r}, {right!r}): {missing!r} is not in the vocab")
            # NOTE: a pair listed twice keeps its last priority, as Hugging Face's loader does
            out[(ids[0], ids[1])] = (priority, ids[2])
        return out

    def _read_added_tokens(self, added_tokens: Any) -> None:
        if not isinstance(added_tokens, list):
            raise TokenizerError("added_tokens must be a list")
        for entry in added_tokens:
            if not isinstance(entry, dict):
                raise TokenizerError(f"added token must be an object, got {entry!r}")
            content, token_id = entry.get("content"), entry.get("id")
            if not isinstance(content, str) or not content:
                raise TokenizerError(f"added token {entry!r}: 'content' must be a non-empty string")
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise TokenizerError(f"added token {content!r}: 'id' must be a non-negative integer")
            if content in self._added and self._added[content] != token_id:
                raise TokenizerError(f"added token {content!r} has two ids, {self._added[content]} and {token_id}")
            self._added[content] = token_id
            self._added_bytes[token_id] = content.encode("utf-8")
            self._added_flags[content] = (bool(entry.get("lstrip")), bool(entry.get("rstrip")),
                                          bool(entry.get("single_word")))
            if entry.get("special", False):
                self.special_tokens[content] = token_id
                self._special_ids.add(token_id)

    def _added_pattern(self, include_special: bool) -> regex.Pattern | None:
        """One alternation of the added tokens to cut out of text, longest first (leftmost-longest matching).
        lstrip/rstrip absorb neighbouring whitespace; single_word refuses a match inside a word."""
        contents = [c for c in self._added if include_special or c not in self.special_tokens]
        if not contents:
            return None
        alternatives = []
        for content in sorted(contents, key=len, reverse=True):
            lstrip, rstrip, single_word = self._added_flags[content]
            body = regex.escape(content)
            if not (lstrip or rstrip or single_word):
                alternatives.append(body)
                continue
            if single_word:
                body = rf"(?<!\w){body}(?!\w)"
            before = r"\s*" if lstrip else ""
            after = r"\s*" if rstrip else ""
            alternatives.append(f"(?P<a{self._added[content]}>{before}{body}{after})")
        return regex.compile("|".join(alternatives))

    def token_to_id(self, token: str, what: str = "token") -> int:
        """The id of an added token or vocab token given by its text. Unknown -> TokenizerError naming `what`."""
        if token in self._added:
            return self._added[token]
        if token in self._vocab:
            return self._vocab[token]
        token_id = self._bytes_to_id.get(token.encode("utf-8"))
        if token_id is None:
            raise TokenizerError(f"{what}: {token!r} is not a token")
        return token_id

    # ---- sizes and lookups -----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """One past the largest id (vocab and added tokens)."""
        return self._vocab_size

    def id_to_bytes(self, token_id: int) -> bytes:
        """The bytes of one token; an added token gives its content's UTF-8. Unknown id -> TokenizerError."""
        try:
            index = operator.index(token_id)
        except TypeError:
            raise TokenizerError(f"token id must be an integer, got {token_id!r}") from None
        data = self._id_bytes[index] if 0 <= index < self._vocab_size else None
        if data is None:
            raise TokenizerError(f"token id {index} is not a token (vocab size {self._vocab_size})")
        return data

    def is_special(self, token_id: int) -> bool:
        """Whether an id is an added token marked special."""
        return token_id in self._special_ids

    # ---- encoding --------------------------------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. With `allow_special`, special token strings become their ids; otherwise they are
        ordinary text. Non-special added tokens always match. Lone surrogates -> TokenizerError."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        return self._encode(text, self._split_all if allow_special else self._split_ordinary, "strict")

    def encode_with_plain_spans(self, text: str, plain: Sequence[tuple[int, int]]) -> list[int]:
        """`encode(text, allow_special=True)`, except that a special token whose text starts inside one of the
        `plain` [start, end) spans (a rendered chat template's message text) stays ordinary text there: only the
        template's own markers become special ids. Equals `encode(text, allow_special=True)` when no special
        token text starts inside a span."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        if self._split_all is None:
            return self.encode(text)
        ids: list[int] = []
        start = 0
        for match in self._split_all.finditer(text):
            name = match.lastgroup
            token_id = int(name[1:]) if name is not None else self._added[match.group()]
            if token_id in self._special_ids:
                token = self._added_bytes[token_id].decode("utf-8")
                at = match.start() + match.group().index(token)  # past whitespace an lstrip token absorbs
                if any(low <= at < high for low, high in plain):
                    continue  # message text: left to the ordinary encoding of the segment
            ids += self._encode(text[start:match.start()], self._split_ordinary, "strict")
            ids.append(token_id)
            start = match.end()
        return ids + self._encode(text[start:], self._split_ordinary, "strict")

    def encode_bytes(self, data: bytes) -> list[int]:
        """Token ids of arbitrary bytes (invalid UTF-8 included). Never produces special ids.

        Valid UTF-8 encodes exactly as `encode(data.decode())`; an undecodable byte is carried through as a
        surrogate escape (U+DC80..U+DCFF) and re-encoded to the same byte.
        """
        text = bytes(data).decode("utf-8", errors="surrogateescape")
        return self._encode(text, self._split_ordinary, "surrogateescape")

    def _encode(self, text: str, added: regex.Pattern | None, errors: str) -> list[int]:
        ids: list[int] = []
        start = 0
        try:
            if added is not None:
                for match in added.finditer(text):
                    ids += self._encode_segment(text[start:match.start()], errors)
                    name = match.lastgroup
                    ids.append(int(name[1:]) if name is not None else self._added[match.group()])
                    start = match.end()
            ids += self._encode_segment(text[start:], errors)
        except UnicodeEncodeError as exc:
            raise unencodable_text_error(text) from None
        return ids

    def _encode_segment(self, segment: str, errors: str) -> list[int]:
        if not segment:
            return []
        for form in self._normal_forms:
            segment = unicodedata.normalize(form, segment)
        pieces = [segment]
        for step in self._pre_tokenizer:
            pieces = step(pieces)
        ids: list[int] = []
        for piece in pieces:
            ids += self._encode_piece(piece.encode("utf-8", errors))
        return ids

    def _encode_piece(self, piece: bytes) -> tuple[int, ...]:
        if len(piece) == 1:
            return (self._byte_ids[piece[0]],)
        if self.ignore_merges:
            token_id = self._bytes_to_id.get(piece)
            if token_id is not None:
                return (token_id,)
        cacheable = len(piece) <= _MAX_CACHED_PIECE_BYTES
        cached = self._cache.get(piece) if cacheable else None
        if cached is not None:
            return cached
        symbols = [self._byte_ids[byte] for byte in piece]
        if len(piece) <= _SHORT_PIECE_BYTES:
            ids = tuple(merge_symbols_reference(symbols, self._merges))
        else:
            ids = tuple(merge_symbols_heap(symbols, self._merges))
        if cacheable:
            self._cache.put(piece, ids)
        return ids


    def __repr__(self) -> str:
        return (f"HFTokenizer(vocab_size={self.vocab_size}, num_added={len(self._added)}, "
                f"num_special={len(self.special_tokens)}, bos_id={self.bos_id}, eos_ids={self.eos_ids})")


# ----------------------------------------------------------------------------------------------------------------
# File readers.

def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    """A JSON object from `path`; None for a missing optional file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if required:
            raise TokenizerError(f"missing tokenizer file {path}") from None
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot parse {path.name}: {exc}") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{path.name} must hold a JSON object")
    return value


def _token_content(value: Any, key: str) -> str | None:
    """A tokenizer_config token entry: null, a string, or an AddedToken object {"content": ...}."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"] or None
    raise TokenizerError(f"{CONFIG_FILE}: {key} must be a string, an object with 'content', or null; got {value!r}")


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The raw jinja chat template: tokenizer_config's `chat_template` (a string, or a list of named templates of
    which the one named "default"), else `chat_template.jinja` beside it, else None."""
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return entry["template"]
        return None
    path = folder / CHAT_TEMPLATE_FILE
    return path.read_text(encoding="utf-8") if path.exists() else None
