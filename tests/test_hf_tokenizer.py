"""HFTokenizer: parity with Hugging Face `tokenizers` on tokenizer.json files trained at test time (plain ByteLevel,
Qwen-style and DeepSeek-style Split sequences, every Split behaviour, normalizers, added-token options, string
merges, ignore_merges), round trips, streaming, bos/eos/config reading, refusals, and `generate --prompt` on a
family checkpoint that ships only tokenizer.json."""

from __future__ import annotations

import contextlib
import io
import json
import random
import string
import sys
import textwrap
import unicodedata
from pathlib import Path

import pytest
import regex
import tokenizers  # a declared test dependency: missing, the run must fail, not skip
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers

from k3serve.errors import TokenizerError
from k3serve.hf_tokenizer import (
    GPT2_PATTERN, HFTokenizer, byte_level_alphabet, bytes_to_token_string, merge_symbols_heap,
    merge_symbols_reference, token_string_to_bytes,
)

# Qwen2/Qwen3's split pattern and DeepSeek-V3's three splits, as their tokenizer.json files write them
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK_PATTERNS = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                     r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
                     r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

MULTILINGUAL = (
    "Ünïcödé façade, naïve café; Straße. Привет, мир! Γειά σου κόσμε. שלום עולם. مرحبا بالعالم.\n"
    "日本語のテキストです。中文测试，你好世界！한국어 텍스트입니다. ไทย ภาษา.\n"
    "Emoji: 👋🏽 👨‍👩‍👧 🇫🇷 ❤️ 🤖🤖🤖 ✨\n"
) * 3
TRAINING_TEXT = open(textwrap.__file__, encoding="utf-8").read() + MULTILINGUAL


def _texts() -> list[str]:
    code = open(string.__file__, encoding="utf-8").read()  # not in the training text: many unmerged pairs
    texts = [code[i:i + 700] for i in range(0, 7000, 700)]
    texts += [
        "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "a", "hello world", " hello  world ", "Hello World!!",
        "I'm sure you'll see they've, we'd, I've; IT'S DON'T We'Re",
        "   leading and trailing   ", "x" + " " * 40 + "y", "\r\n\r\nwindows\r\nlines\r\n",
        "tabs\tand\t\tmore\t\t\ttabs", "123 4567 89012345 3.14159 1,000,000 ٣٤٥ ½ ①②",
        "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
        "日本語のテキストです。", "中文测试，你好世界！", "한국어", "👋🏽👨‍👩‍👧🇫🇷", "e\u0301 n\u0303 A\u030a", "ﬁ ﬂ Ⅻ ㎏",
        "\u00a0nbsp\u2003em space\u3000ideographic", "zero\u200bwidth", "\x00\x01\x7f control \x1b[0m",
        "a" * 500, " " * 300, "ab" * 200, "日" * 120, "😀" * 40, "0123456789" * 30, "_".join(["snake"] * 60),
        MULTILINGUAL,
        # special tokens, alone, adjacent, partial, and inside words
        "<|endoftext|>", "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|><|endoftext|>", "before<|endoftext|>after", "<|endoftext|", "|endoftext|>", "<|im_end|>x",
        "<|im_start|> spaced <|im_end|>",
        # added tokens with options (present only in some tokenizers; ordinary text elsewhere)
        "<think>reasoning</think> answer", "word<think>word", "a <mask> b", "a<mask>b", "x  <sep>  y",
    ]
    rng = random.Random(1234)
    ranges = ((0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x400, 0x4FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
              (0x1F300, 0x1FAFF), (0x0, 0x10FFFF))
    for length in (1, 2, 3, 15, 63, 300):
        for _ in range(4):
            chars = []
            while len(chars) < length:
                low, high = rng.choice(ranges)
                char = chr(rng.randint(low, high))
                # assigned in this Python's Unicode database: the regex module and Oniguruma (the reference's
                # regex engine) may know different Unicode versions, which disagree on unassigned code points
                if unicodedata.category(char) not in ("Cn", "Cs"):
                    chars.append(char)
            texts.append("".join(chars))
    return texts


TEXTS = _texts()


def train(pre_tokenizer, vocab_size: int = 500) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on TRAINING_TEXT (all 256 bytes in the alphabet) with SPECIALS added."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([TRAINING_TEXT], trainer)
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def copy(tokenizer: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """A copy to modify (the module fixtures are shared)."""
    return tokenizers.Tokenizer.from_str(tokenizer.to_str())


def save(tokenizer: tokenizers.Tokenizer, folder: Path, edit=None) -> tuple[HFTokenizer, tokenizers.Tokenizer]:
    """Write tokenizer.json (optionally edited as JSON) to `folder`; return ours and the reference, both loaded
    from that file."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = json.loads(tokenizer.to_str())
    if edit is not None:
        edit(spec)
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return HFTokenizer.from_dir(folder), tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


def reference_ids(reference: tokenizers.Tokenizer, text: str, allow_special: bool) -> list[int]:
    reference.encode_special_tokens = not allow_special  # special tokens as plain text
    try:
        return reference.encode(text, add_special_tokens=False).ids
    finally:
        reference.encode_special_tokens = False


def assert_parity(ours: HFTokenizer, reference: tokenizers.Tokenizer, texts: list[str] = TEXTS) -> None:
    for text in texts:
        for allow_special in (False, True):
            expected = reference_ids(reference, text, allow_special)
            ids = ours.encode(text, allow_special=allow_special)
            assert ids == expected, (text[:80], allow_special)
            assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=False), text[:80]


@pytest.fixture(scope="module")
def byte_level() -> tokenizers.Tokenizer:
    return train(pre_tokenizers.ByteLevel(add_prefix_space=False))


@pytest.fixture(scope="module")
def qwen_style() -> tokenizers.Tokenizer:
    return train(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_PATTERN), "isolated"),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))


@pytest.fixture(scope="module")
def qwen_loaded(qwen_style, tmp_path_factory) -> tuple[HFTokenizer, tokenizers.Tokenizer]:
    return save(qwen_style, tmp_path_factory.mktemp("qwen"))


# ---- parity ----------------------------------------------------------------------------------------------------

def test_byte_alphabet_is_gpt2s():
    alphabet = byte_level_alphabet()
    assert len(set(alphabet)) == 256
    assert sorted(alphabet) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert alphabet[ord("A")] == "A" and alphabet[0x20] == "\u0120" and alphabet[0x0A] == "\u010a"
    assert alphabet[0xAD] == "\u0143" and alphabet[0xFF] == "\u00ff"  # the soft hyphen is the last shifted byte
    data = bytes(range(256))
    assert token_string_to_bytes(bytes_to_token_string(data)) == data
    assert token_string_to_bytes("<｜x｜>") == "<｜x｜>".encode()  # outside the alphabet: its own UTF-8


def test_plain_byte_level_matches_reference(byte_level, tmp_path):
    ours, reference = save(byte_level, tmp_path)
    assert ours.vocab_size == reference.get_vocab_size(with_added_tokens=True)
    assert_parity(ours, reference)


def test_byte_level_with_prefix_space_matches_reference(byte_level, tmp_path):
    def edit(spec):
        spec["pre_tokenizer"]["add_prefix_space"] = True
    ours, reference = save(byte_level, tmp_path, edit)
    assert_parity(ours, reference)
    assert ours.decode(ours.encode("x")) == " x"


def test_qwen_style_split_sequence_matches_reference(qwen_loaded):
    assert_parity(*qwen_loaded)


def test_deepseek_style_split_sequence_matches_reference(qwen_style, tmp_path):
    qwen_style = copy(qwen_style)
    qwen_style.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), "isolated") for p in DEEPSEEK_PATTERNS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert_parity(*save(qwen_style, tmp_path))


@pytest.mark.parametrize("behavior", ["isolated", "removed", "merged_with_previous", "merged_with_next",
                                      "contiguous"])
@pytest.mark.parametrize("invert", [False, True])
def test_every_split_behavior_matches_reference(byte_level, tmp_path, behavior, invert):
    byte_level = copy(byte_level)
    byte_level.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[,.;:]|\s"), behavior, invert=invert),
        pre_tokenizers.Split(" ", "isolated"),  # a literal (String) pattern
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    assert_parity(*save(byte_level, tmp_path), texts=TEXTS[:12] + TEXTS[-40:] + ["a,,b..c; d::e  f,", ",.x.,"])


@pytest.mark.parametrize("normalizer", [normalizers.NFC(), normalizers.NFKC(),
                                        normalizers.Sequence([normalizers.NFD(), normalizers.NFC()])])
def test_normalizers_match_reference(qwen_style, tmp_path, normalizer):
    qwen_style = copy(qwen_style)
    qwen_style.normalizer = normalizer
    ours, reference = save(qwen_style, tmp_path)
    assert_parity(ours, reference)
    assert ours.encode("e\u0301") == ours.encode("\u00e9")


def test_string_merges_match_reference(byte_level, tmp_path):
    def edit(spec):
        assert isinstance(spec["model"]["merges"][0], list)
        spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]
    assert_parity(*save(byte_level, tmp_path, edit))


def test_ignore_merges_uses_a_whole_piece_token(byte_level, tmp_path):
    # "zqzq" is a vocab token no merge reaches: only ignore_merges finds it. It takes the first id after the
    # vocab, shifting the added tokens up by one (Hugging Face numbers added tokens from the vocab's size).
    def add_token(ignore_merges):
        def edit(spec):
            spec["model"]["vocab"]["zqzq"] = len(spec["model"]["vocab"])
            for added in spec["added_tokens"]:
                added["id"] += 1
            spec["model"]["ignore_merges"] = ignore_merges
        return edit

    ours, reference = save(byte_level, tmp_path / "on", add_token(True))
    token_id = ours.token_to_id("zqzq")
    assert ours.encode("zqzq zqzq") == [token_id, *ours.encode(" zqzq")] and len(ours.encode(" zqzq")) > 1
    assert_parity(ours, reference, TEXTS + ["zqzq", "a zqzq"])
    ours_off, reference_off = save(byte_level, tmp_path / "off", add_token(False))
    assert token_id not in ours_off.encode("zqzq")
    assert_parity(ours_off, reference_off, ["zqzq", "a zqzq"])


def test_added_token_options_match_reference(qwen_style, tmp_path):
    qwen_style = copy(qwen_style)
    qwen_style.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True),
                                   AddedToken("<sep>", rstrip=True, lstrip=True, special=True)])
    qwen_style.add_tokens([AddedToken("<think>", special=False, normalized=False),
                           AddedToken("</think>", special=False, normalized=False)])
    ours, reference = save(qwen_style, tmp_path)
    assert_parity(ours, reference)
    think = ours.token_to_id("<think>")
    assert think in ours.encode("<think>") and not ours.is_special(think)  # plain vocabulary: always matched
    assert ours.token_to_id("<mask>") not in ours.encode("a <mask>")
    assert ours.encode("a <mask>", allow_special=True) == ours.encode("a") + [ours.token_to_id("<mask>")]


# ---- round trips, streaming, merges ----------------------------------------------------------------------------

def test_decode_inverts_encode_and_specials_decode_to_their_text(qwen_loaded):
    ours, _ = qwen_loaded
    for text in TEXTS:
        assert ours.decode(ours.encode(text)) == text
        assert ours.decode(ours.encode(text, allow_special=True)) == text
    ids = ours.encode("<|im_start|>hi", allow_special=True)
    assert ids[0] == ours.special_tokens["<|im_start|>"] and ours.is_special(ids[0]) and not ours.is_special(ids[1])


def test_encode_bytes_carries_invalid_utf8(qwen_loaded):
    ours, _ = qwen_loaded
    for data in (b"\xff\xfe abc \x80", "日本".encode()[:-1], b"ok \xc3", bytes(range(256))):
        assert ours.decode_bytes(ours.encode_bytes(data)) == data
    text = "<|endoftext|> héllo"
    assert ours.encode_bytes(text.encode()) == ours.encode(text)


def test_stream_decoder_never_emits_replacement_on_valid_utf8(qwen_loaded):
    ours, _ = qwen_loaded
    for text in TEXTS:
        ids = ours.encode(text, allow_special=True)
        decoder = ours.stream_decoder()
        chunks = [decoder.add(token_id) for token_id in ids] + [decoder.flush()]
        assert "\ufffd" not in "".join(chunks), text[:80]
        # special tokens are control, never printed as text (tests/weights/test_gguf_kimi_tokenizer.py)
        assert "".join(chunks) == ours.decode([t for t in ids if not ours.is_special(t)])
        if not any(ours.is_special(t) for t in ids):
            assert "".join(chunks) == text
    assert any(len(ours.id_to_bytes(i)) == 1 and ours.id_to_bytes(i)[0] >= 0x80 for i in ours.encode("日"))


def test_heap_merge_equals_reference_merge():
    rng = random.Random(7)
    for _ in range(200):
        num_symbols = rng.randint(2, 6)
        merges = {}
        next_id = num_symbols
        for priority in range(rng.randint(1, 30)):
            pair = (rng.randrange(next_id), rng.randrange(next_id))
            merges[pair] = (priority, next_id)
            next_id += 1
        word = [rng.randrange(num_symbols) for _ in range(rng.choice((1, 2, 5, 17, 63, 200)))]
        assert merge_symbols_heap(word, merges) == merge_symbols_reference(word, merges)


def test_long_pieces_take_the_heap_path_and_match(qwen_loaded):
    ours, reference = qwen_loaded
    assert_parity(ours, reference, ["a" * 2000, " " * 1000, "ab" * 999 + "a", "日" * 400, "ＡＢＣ" * 100])


def test_bad_inputs_are_tokenizer_errors(qwen_loaded):
    ours, _ = qwen_loaded
    with pytest.raises(TokenizerError, match="UTF-8"):
        ours.encode("lone \ud800 surrogate")
    with pytest.raises(TokenizerError):
        ours.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="not a token"):
        ours.decode([ours.vocab_size])
    with pytest.raises(TokenizerError):
        ours.decode([-1])


# ---- configs, bos/eos ------------------------------------------------------------------------------------------

def test_bos_eos_and_chat_template_from_config_files(qwen_style, tmp_path):
    ours, _ = save(qwen_style, tmp_path)
    assert ours.bos_id is None and ours.eos_ids == () and ours.chat_template is None  # no config files
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", "lstrip": False}, "eos_token": "<|im_end|>",
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "eos_token_id": [7, 8]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 8}))
    ours = HFTokenizer.from_dir(tmp_path)
    assert ours.bos_id == ours.special_tokens["<|im_start|>"] and ours.bos_token == "<|im_start|>"
    assert ours.eos_ids == (ours.special_tokens["<|im_end|>"], 7, 8)
    assert ours.eos_tokens[0] == "<|im_end|>"
    assert ours.chat_template == "{% for m in messages %}{{ m.content }}{% endfor %}"

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>", "add_bos_token": False,
                                                                "eos_token": None}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 10 ** 9}))
    with pytest.raises(TokenizerError, match="eos_token_id"):
        HFTokenizer.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    ours = HFTokenizer.from_dir(tmp_path)
    assert ours.bos_id is None and ours.eos_ids == (8,)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not_a_token|>"}))
    with pytest.raises(TokenizerError, match="not_a_token"):
        HFTokenizer.from_dir(tmp_path)


# ---- refusals --------------------------------------------------------------------------------------------------

def test_wordpiece_is_refused_by_name(tmp_path):
    wordpiece = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wordpiece.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="WordPiece"):
        HFTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda spec: spec.update(model={"type": "Unigram", "vocab": [["a", 0.0]]}), "Unigram"),
    (lambda spec: spec.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁"}), "Metaspace"),
    (lambda spec: spec.update(pre_tokenizer=None), "pre_tokenizer"),
    (lambda spec: spec.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False},
        {"type": "Split", "pattern": {"Regex": "a"}, "behavior": "Isolated", "invert": False}]}), "last"),
    (lambda spec: spec.update(normalizer={"type": "Lowercase"}), "Lowercase"),
    (lambda spec: spec.update(decoder={"type": "WordPiece", "prefix": "##"}), "decoder"),
    (lambda spec: spec["model"].update(dropout=0.1), "dropout"),
    (lambda spec: spec["model"].update(continuing_subword_prefix="##"), "continuing_subword_prefix"),
    (lambda spec: spec["model"]["vocab"].pop("\u0120"), "0x20"),
    (lambda spec: spec["model"]["merges"].append(["Ġ", "nope"]), "nope"),
])
def test_unsupported_or_broken_files_are_refused_by_name(byte_level, tmp_path, edit, message):
    spec = json.loads(byte_level.to_str())
    edit(spec)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match=message):
        HFTokenizer.from_dir(tmp_path)


def test_missing_or_malformed_file_is_refused(tmp_path):
    with pytest.raises(TokenizerError, match="missing tokenizer file"):
        HFTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot parse"):
        HFTokenizer.from_dir(tmp_path)


def test_gpt2_pattern_is_the_byte_level_default():
    # ByteLevel(use_regex=True) must cut exactly where the reference does
    pattern = regex.compile(GPT2_PATTERN)
    reference = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for text in TEXTS:
        expected = [piece for piece, _ in reference.pre_tokenize_str(text)]
        pieces = [bytes_to_token_string(m.group().encode()) for m in pattern.finditer(text)]
        assert pieces == expected, text[:80]


# ---- end to end: a family checkpoint with only tokenizer.json --------------------------------------------------

def test_generate_prompt_on_a_family_checkpoint_with_tokenizer_json(qwen_loaded, qwen_style, tmp_path):
    sys.path.insert(0, str(Path(__file__).parent / "model" / "families"))
    import _hf_tiny  # builds tiny transformers checkpoints (torch, transformers: test dependencies)

    from k3serve.cli.main import main
    from k3serve.engine.generate import generate
    from k3serve.engine.sampling import SamplingParams
    from k3serve.loading import load_model

    ours, _ = qwen_loaded
    _hf_tiny.build_tiny("qwen3_moe", tmp_path, vocab_size=ours.vocab_size, eos_token_id=ours.special_tokens[
        "<|endoftext|>"])
    save(qwen_style, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>"}))

    loaded = load_model(tmp_path)
    assert isinstance(loaded.tokenizer, HFTokenizer)
    assert set(loaded.stop_ids) >= {ours.special_tokens["<|im_end|>"], ours.special_tokens["<|endoftext|>"]}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["generate", "--model", str(tmp_path), "--prompt", "def main():", "--max-tokens", "12",
                     "--ignore-eos", "--no-token-healing"])
    assert code == 0
    prompt_ids = ours.encode("def main():")
    tokens, _ = generate(loaded.model, prompt_ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                         stop_ids=loaded.stop_ids)
    assert len(tokens) == 12
    stops = set(loaded.stop_ids)
    assert stdout.getvalue() == ours.decode([t for t in tokens if t not in stops]) + "\n"


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_serve_a_family_checkpoint_with_its_own_chat_template(qwen_loaded, qwen_style, tmp_path):
    """`serve` runs a family model: the chat prompt is the checkpoint's jinja template, rendered and tokenized with
    its special tokens; the completion is the model's greedy continuation of exactly those ids."""
    sys.path.insert(0, str(Path(__file__).parent / "model" / "families"))
    import _hf_tiny
    from fastapi.testclient import TestClient

    from k3serve.engine.config import EngineConfig
    from k3serve.engine.engine import LLMEngine
    from k3serve.loading import load_model
    from k3serve.serve.api import create_app

    ours, _ = qwen_loaded
    _hf_tiny.build_tiny("qwen3_moe", tmp_path, vocab_size=ours.vocab_size, eos_token_id=ours.special_tokens[
        "<|endoftext|>"])
    save(qwen_style, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>",
                                                                "chat_template": CHATML}))
    loaded = load_model(tmp_path)
    engine = LLMEngine(loaded.model, EngineConfig(block_size=4, num_blocks=256, max_model_len=256),
                       stop_ids=loaded.stop_ids)
    with TestClient(create_app(engine, loaded.tokenizer, "tiny-qwen")) as client:
        response = client.post("/v1/chat/completions", json={
            "model": "tiny-qwen", "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "def main():"}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    prompt = ours.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ndef main():<|im_end|>\n"
                         "<|im_start|>assistant\n", allow_special=True)
    assert body["usage"]["prompt_tokens"] == len(prompt)
    expected = loaded.model.greedy(prompt, 6)  # ignore_eos: all six, special ones not shown as text
    assert body["choices"][0]["message"]["content"] == ours.decode([t for t in expected if not ours.is_special(t)])
