"""Tokenizer: exact round trips, the shipped asset, special tokens, streaming, malformed files, and BPE training."""

from __future__ import annotations

import base64
import json
import random
import time
from pathlib import Path

import pytest

from k3serve.errors import TokenizerError
from k3serve.tokenizer import (
    DEFAULT_PATTERN, DEFAULT_SPECIAL_TOKENS, Tokenizer, merge_piece_heap,
    merge_piece_reference,
)
from k3serve.tokenizer_training import train_bpe, write_tokenizer

# the stdlib-trained BPE (a test fixture; the shipped model carries its own tokenizer)
STDLIB_TOKENIZER = Path(__file__).resolve().parents[0] / "fixtures" / "stdlib_tokenizer"

LENGTHS = (0, 1, 2, 15, 63, 300, 2000)
SINGLE_BYTES = [bytes([byte]) for byte in range(256)]

# code point ranges to draw from: ASCII, C0/C1 controls and Latin-1, combining marks, CJK, emoji, anything else
CODE_POINT_RANGES = ((0x20, 0x7E), (0x00, 0xFF), (0x300, 0x36F), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF),
                     (0x0, 0x10FFFF))

SAMPLE_CODE = '''import os


class Walker:
    """Walk a tree."""

    def __init__(self, root: str) -> None:
        self.root = root

    def files(self):
        for folder, _, names in os.walk(self.root):
            for name in names:
                yield os.path.join(folder, name)
'''


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(STDLIB_TOKENIZER)


def random_text(rng: random.Random, length: int) -> str:
    chars = []
    while len(chars) < length:
        low, high = rng.choice(CODE_POINT_RANGES)
        code_point = rng.randint(low, high)
        if 0xD800 <= code_point <= 0xDFFF:
            continue
        chars.append(chr(code_point))
    return "".join(chars)


def small_tokenizer(extra: list[bytes]) -> Tokenizer:
    return Tokenizer(SINGLE_BYTES + extra, DEFAULT_PATTERN, ["[BOS]", "[EOS]"], "[BOS]", ["[EOS]"])


def write_folder(folder: Path, model_text: str, config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiktoken.model").write_text(model_text)
    if config is None:
        config = {"pattern": DEFAULT_PATTERN, "special_tokens": ["[BOS]", "[EOS]"], "bos_token": "[BOS]",
                  "eos_tokens": ["[EOS]"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def byte_model_lines(tokens: list[bytes] = SINGLE_BYTES) -> list[str]:
    return [f"{base64.b64encode(token).decode()} {rank}" for rank, token in enumerate(tokens)]


# ---- the shipped asset ---------------------------------------------------------------------------------------

def test_asset_loads_with_k3_layout(tokenizer: Tokenizer) -> None:
    assert tokenizer.num_base_tokens == 1024
    assert tokenizer.vocab_size == 1032
    assert tokenizer.special_tokens == {token: 1024 + index for index, token in enumerate(DEFAULT_SPECIAL_TOKENS)}
    assert tokenizer.bos_id == 1024
    assert tokenizer.eos_ids == (1025, 1026)
    assert tokenizer.pattern == DEFAULT_PATTERN
    assert tokenizer.chat_template is None
    config = json.loads((STDLIB_TOKENIZER / "tokenizer_config.json").read_text())
    assert "k3serve.tokenizer_training" in config["source"]


def test_asset_compresses_python_source(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(SAMPLE_CODE)
    assert len(SAMPLE_CODE.encode()) / len(ids) > 2.5
    assert tokenizer.decode(ids) == SAMPLE_CODE


# ---- round trips ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_random_bytes_round_trip(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    for length in LENGTHS:
        data = bytes(rng.getrandbits(8) for _ in range(length))
        ids = tokenizer.encode_bytes(data)
        assert all(0 <= token_id < tokenizer.num_base_tokens for token_id in ids)
        assert tokenizer.decode_bytes(ids) == data


@pytest.mark.parametrize("seed", range(4))
def test_random_unicode_round_trip(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(100 + seed)
    for length in LENGTHS:
        text = random_text(rng, length)
        ids = tokenizer.encode(text)
        assert tokenizer.decode_bytes(ids) == text.encode("utf-8")
        assert tokenizer.decode(ids) == text
        assert tokenizer.encode_bytes(text.encode("utf-8")) == ids


@pytest.mark.parametrize("text", ["", "a", "héllo wörld", "e\u0301\u0301 n\u0303", "日本語のテキスト", "👩‍👩‍👧 🎉🎉",
                                  "\x00\x01\x1b[0m\x7f\r\n\t", "    \n\n\t  x", "x = 1234567  # 'quoted' it's"])
def test_edge_strings_round_trip(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_lone_surrogate_text_is_rejected(tokenizer: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="UTF-8"):
        tokenizer.encode("ok \ud800 no")


def test_encode_100kb_is_fast(tokenizer: Tokenizer) -> None:
    text = (SAMPLE_CODE + random_text(random.Random(7), 200)) * 200  # ~100 KB
    fresh = Tokenizer.from_dir(STDLIB_TOKENIZER)
    started = time.perf_counter()
    ids = fresh.encode(text)
    assert time.perf_counter() - started < 2.0
    assert fresh.decode(ids) == text


# ---- BPE merge order -----------------------------------------------------------------------------------------

def test_lowest_rank_pair_merges_first() -> None:
    bc_first = small_tokenizer([b"bc", b"ab"])  # ranks: bc 256 < ab 257
    assert bc_first.encode("abc") == [ord("a"), 256]
    ab_first = small_tokenizer([b"ab", b"bc"])  # ranks: ab 256 < bc 257
    assert ab_first.encode("abc") == [256, ord("c")]
    with_abc = small_tokenizer([b"ab", b"bc", b"abc"])
    assert with_abc.encode("abc") == [258]
    assert with_abc.encode("abcbc") == [258, 257]


def test_equal_ranks_merge_leftmost_first() -> None:
    tok = small_tokenizer([b"aa"])
    assert tok.encode("aaa") == [256, ord("a")]
    assert tok.encode("aaaa") == [256, 256]
    assert tok.encode("aaaaa") == [256, 256, ord("a")]


@pytest.mark.parametrize("seed", range(3))
def test_heap_merge_matches_reference(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ranks = {tokenizer.id_to_bytes(i): i for i in range(tokenizer.num_base_tokens)}
    alphabet = [b" ", b"e", b"s", b"l", b"f", b"t", b"\n", b"a", b"_", b"("]
    for length in (1, 2, 15, 63, 300):
        piece = b"".join(rng.choice(alphabet) for _ in range(length))
        assert merge_piece_heap(piece, ranks) == merge_piece_reference(piece, ranks)
    repeated = {b"a": 0, b"aa": 1, b"aaaa": 2, b"aaa": 3}
    for length in range(1, 40):
        assert merge_piece_heap(b"a" * length, repeated) == merge_piece_reference(b"a" * length, repeated)


# ---- special tokens ------------------------------------------------------------------------------------------

def test_special_tokens_encode_only_when_allowed(tokenizer: Tokenizer) -> None:
    text = "[BOS]hi<|im_end|> there[EOS]"
    plain = tokenizer.encode(text)
    assert not any(tokenizer.is_special(token_id) for token_id in plain)
    assert tokenizer.decode(plain) == text
    special = tokenizer.encode(text, allow_special=True)
    assert special[0] == 1024 and special[-1] == 1025 and 1026 in special
    assert special[1:special.index(1026)] == tokenizer.encode("hi")
    assert tokenizer.decode(special) == text
    assert tokenizer.encode("<|im_user|><|im_middle|>", allow_special=True) == [1027, 1030]
    assert tokenizer.encode_bytes(b"[EOS]") == tokenizer.encode("[EOS]")


def test_out_of_range_ids_raise(tokenizer: Tokenizer) -> None:
    for bad in (-1, tokenizer.vocab_size, 10**9):
        with pytest.raises(TokenizerError, match="out of range"):
            tokenizer.id_to_bytes(bad)
        with pytest.raises(TokenizerError):
            tokenizer.decode([1, bad])
        with pytest.raises(TokenizerError):
            tokenizer.stream_decoder().add(bad)


# ---- streaming -----------------------------------------------------------------------------------------------

def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    decoder = tokenizer.stream_decoder()
    return [decoder.add(token_id) for token_id in ids] + [decoder.flush()]


def test_stream_never_emits_broken_characters(tokenizer: Tokenizer) -> None:
    text = "emoji 🎉👩‍👩‍👧 日本語 é\u0301 done"
    ids = tokenizer.encode(text)
    # the emoji are not in the 1024-token vocabulary, so their 4 UTF-8 bytes arrive as separate tokens
    assert tokenizer.encode("🎉") == list(b"\xf0\x9f\x8e\x89")
    chunks = stream(tokenizer, ids)
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "".join(chunks) == tokenizer.decode(ids) == text
    assert chunks[-1] == ""


@pytest.mark.parametrize("seed", range(3))
def test_stream_equals_decode_on_random_bytes(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    data = bytes(rng.getrandbits(8) for _ in range(500)) + b"\xe6\x97"  # ends inside a character
    ids = tokenizer.encode_bytes(data)
    chunks = stream(tokenizer, ids)
    assert "".join(chunks) == tokenizer.decode(ids)
    assert chunks[-1] == "\ufffd"


def test_stream_valid_random_unicode_has_no_replacement(tokenizer: Tokenizer) -> None:
    text = random_text(random.Random(3), 400).replace("\ufffd", "?")
    chunks = stream(tokenizer, tokenizer.encode(text))
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "".join(chunks) == text


# ---- malformed files -----------------------------------------------------------------------------------------

def test_valid_minimal_folder_loads(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_folder(tmp_path, "\n".join(byte_model_lines()) + "\n"))
    assert (tok.num_base_tokens, tok.vocab_size, tok.bos_id, tok.eos_ids) == (256, 258, 256, (257,))


@pytest.mark.parametrize("mutate, message", [
    (lambda lines: lines[:10] + ["not-base64!! 10"] + lines[11:], "line 11: invalid base64"),
    (lambda lines: lines[:4] + ["QQ=="] + lines[5:], "line 5: expected"),
    (lambda lines: lines[:4] + ["QQ== x"] + lines[5:], "line 5: rank"),
    (lambda lines: lines + ["QUI= 3"], "line 257: duplicate rank 3"),
    (lambda lines: lines + ["QUI= 300"], "not dense"),
    (lambda lines: lines[:65] + lines[66:], "not dense"),
    (lambda lines: [line for line in lines if not line.endswith(" 255")], "single bytes"),
    (lambda lines: lines + ["QQ== 256"], "same bytes"),
    (lambda lines: [], "no tokens"),
])
def test_malformed_model_file_raises(tmp_path: Path, mutate, message: str) -> None:
    folder = write_folder(tmp_path, "\n".join(mutate(byte_model_lines())) + "\n")
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_dir(folder)


@pytest.mark.parametrize("change, message", [
    ({"pattern": None}, "'pattern'"),
    ({"special_tokens": None}, "'special_tokens'"),
    ({"bos_token": None}, "'bos_token'"),
    ({"eos_tokens": None}, "'eos_tokens'"),
    ({"bos_token": "[NOPE]"}, "bos_token"),
    ({"eos_tokens": ["[EOS]", "<|x|>"]}, "eos_tokens"),
    ({"special_tokens": ["[BOS]", "[EOS]", "[BOS]"]}, "twice"),
    ({"pattern": "(unclosed"}, "pattern"),
])
def test_malformed_config_raises(tmp_path: Path, change: dict, message: str) -> None:
    config = {"pattern": DEFAULT_PATTERN, "special_tokens": ["[BOS]", "[EOS]"], "bos_token": "[BOS]",
              "eos_tokens": ["[EOS]"]}
    for key, value in change.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    folder = write_folder(tmp_path, "\n".join(byte_model_lines()), config)
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_dir(folder)


def test_missing_files_and_bad_json_raise(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tiktoken.model"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("\n".join(byte_model_lines()))
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)


# ---- training ------------------------------------------------------------------------------------------------

def training_corpus() -> list[str]:
    rng = random.Random(0)
    words = ["self", "return", "def", "value", "tokenizer", "the", "index", "None", "import", "for", "in"]
    texts = []
    for _ in range(40):
        line_words = [rng.choice(words) for _ in range(rng.randint(3, 12))]
        texts.append("    " + " ".join(line_words) + f"({rng.randint(0, 999)})\n")
    return texts + [SAMPLE_CODE]


def test_train_hand_checked_example() -> None:
    # "aaabdaaabac": aa (4) first; then ab and (aa, a) tie at 2 and b"a" < b"aa" picks ab; then (aa, ab) -> aaab
    tokens = train_bpe(["aaabdaaabac"], vocab_size=300, pattern=r".+")
    assert tokens[:256] == SINGLE_BYTES
    assert tokens[256:] == [b"aa", b"ab", b"aaab"]


def test_train_is_deterministic_and_order_independent() -> None:
    texts = training_corpus()
    first = train_bpe(texts, 320, DEFAULT_PATTERN)
    assert train_bpe(texts, 320, DEFAULT_PATTERN) == first
    assert train_bpe(list(reversed(texts)), 320, DEFAULT_PATTERN) == first
    assert first[:256] == SINGLE_BYTES
    assert len(first) == 320 and len(set(first)) == 320


def test_trained_merges_compress_and_write_loads(tmp_path: Path) -> None:
    texts = training_corpus()
    tokens = train_bpe(texts, 320, DEFAULT_PATTERN)
    folder = write_tokenizer(tmp_path / "tok", tokens, DEFAULT_PATTERN, DEFAULT_SPECIAL_TOKENS, "[BOS]",
                             ["[EOS]", "<|im_end|>"], chat_template="{{ messages }}", source="test")
    tok = Tokenizer.from_dir(folder)
    assert [tok.id_to_bytes(i) for i in range(tok.num_base_tokens)] == tokens
    assert tok.vocab_size == 328 and tok.eos_ids == (321, 322) and tok.chat_template == "{{ messages }}"
    corpus = "".join(texts)
    ids = tok.encode(corpus)
    assert len(ids) < 0.5 * len(corpus.encode())
    assert tok.decode(ids) == corpus


def test_train_rejects_tiny_vocab() -> None:
    with pytest.raises(TokenizerError):
        train_bpe(["abc"], 100, DEFAULT_PATTERN)
