"""A K3 GGUF with Kimi's tiktoken vocabulary stored as llama.cpp's converter stores it (`tokenizer.ggml.pre =
"kimi-k2"`; conversion/kimi_linear.py, read for this, not copied): every rank's bytes as a byte-level token string
at id = rank, the special tokens after them as control tokens, `[PAD<i>]` (unused) up to the model's vocab_size,
and one merge "a b" per token whose rank-limited BPE splits it into exactly two parts.

The vocabulary is our embedded model's. The reference is our own tiktoken-format `Tokenizer` over the same ranks
with Kimi's split pattern: the tokenizer rebuilt from the GGUF metadata alone must encode every text of the corpus
to the same ids and decode them back. Then `load_model` / `serve` on that K3 GGUF work in text.
"""

from __future__ import annotations

import gguf
import pytest
import regex

from k3serve.default_model import default_model_dir
from k3serve.gguf_tokenizer import CONTROL, NORMAL, PRE_TOKENIZER_REGEXES, UNUSED, tokenizer_from_gguf
from k3serve.hf_tokenizer import bytes_to_token_string
from k3serve.loading import load_model
from k3serve.tokenizer import Tokenizer
from k3serve.weights.gguf_file import GGUFFile
from test_gguf_k3 import write_k3_gguf

TEMPLATE = ("{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_assistant|>{% endif %}")

CORPUS = [
    "", "Hello, world!", "  leading and trailing  ", "tabs\tand\nnewlines\r\n\n\nend", " " * 17 + "x",
    "I'M SURE THEY'LL GO, YOU'RE RIGHT, WE'VE SEEN IT'S DONE", "don't can't won't", "CamelCaseWordsHTTPServer",
    "1234567890 3.14159 -42 1e10 ١٢٣٤ ⅷ", "x = [i ** 2 for i in range(10)]  # squares\n",
    "def f(a, b):\n    return a + b\n\n\nclass A:\n\tpass\n", "if (x != y && z >= 3) { y += 1; }",
    "naïve café Ünïcödé résumé", "Ελληνικά και русский текст", "中文文本，混合English和数字123。", "日本語のテキスト、カタカナ",
    "한국어 텍스트", "emoji 🎉🚀 and ZWJ 👨‍👩‍👧", "combining: e\u0301 a\u0308 n\u0303", "🀄中a", "々〇、。「」",
    "mixed\u00a0nbsp\u2003em space", "a" * 300, "!!!???...,,,;;;", "path/to/file.py:12:5", "https://example.com/?q=1&r=2",
]


def rank_limited_split(token: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """tiktoken's merge of `token`'s bytes using only ranks below the token's own: two parts if a merge makes it."""
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 1:
        found = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if ranks.get(a + b, limit) < limit]
        if not found:
            break
        _, i = min(found)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def kimi_k2_vocab(reference: Tokenizer, vocab_size: int):
    """The tokenizer keys the converter writes for a tiktoken vocabulary, as a function of a GGUFWriter."""
    base = [reference.id_to_bytes(i) for i in range(reference.num_base_tokens)]
    ranks = {token: rank for rank, token in enumerate(base)}
    by_id = {i: bytes_to_token_string(token) for i, token in enumerate(base)}
    by_id |= {token_id: special for special, token_id in reference.special_tokens.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [UNUSED if i not in by_id else CONTROL if reference.is_special(i) else NORMAL for i in range(vocab_size)]
    merges = []
    for token in base:
        parts = rank_limited_split(token, ranks) if len(token) > 1 else []
        if len(parts) == 2:
            merges.append(" ".join(bytes_to_token_string(p) for p in parts))

    def add(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("kimi-k2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_chat_template(TEMPLATE)
    return add


@pytest.fixture(scope="module")
def reference() -> Tokenizer:
    """Our embedded vocabulary under Kimi's split pattern, merged by rank (tiktoken's rule)."""
    embedded = Tokenizer.from_dir(default_model_dir())
    base = [embedded.id_to_bytes(i) for i in range(embedded.num_base_tokens)]
    (pattern,) = PRE_TOKENIZER_REGEXES["kimi-k2"]
    return Tokenizer(base, pattern, list(embedded.special_tokens), embedded.bos_token, list(embedded.eos_tokens))


@pytest.fixture(scope="module")
def k3_gguf(reference, tmp_path_factory):
    from k3serve.config import load_config

    folder = default_model_dir()
    return write_k3_gguf(folder, tmp_path_factory.mktemp("kimi") / "k3.gguf",
                         metadata=kimi_k2_vocab(reference, load_config(folder).vocab_size))


def test_kimi_k2_tokenizer_from_gguf_equals_the_tiktoken_reference(reference, k3_gguf):
    ours = tokenizer_from_gguf(GGUFFile(k3_gguf).metadata, "k3.gguf")
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text[:60]
        assert ours.decode(ids) == text
    special = "<|im_user|>hi<|im_end|>"
    assert ours.encode(special, allow_special=True) == reference.encode(special, allow_special=True)
    assert ours.chat_template == TEMPLATE
    assert set(ours.special_tokens) == set(reference.special_tokens)


# Kimi's split pattern as published with its tokenizer (set intersection, regex's V1 syntax), a bare Han read as
# Script_Extensions as Rust's regex reads it: ours must cut every corpus text into the same pieces.
KIMI_PUBLISHED = (r"(?V1)[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
                  r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?"
                  r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
                  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
                  ).replace(r"\p{Han}", r"\p{scx=Han}")


def test_kimi_k2_split_is_kimis_pattern():
    (ours,) = PRE_TOKENIZER_REGEXES["kimi-k2"]
    for text in CORPUS + ["中文English混合 ABCdef's 12345", "ǅungla ǄUNGLA Ǆungla"]:
        assert regex.findall(ours, text) == regex.findall(KIMI_PUBLISHED, text), text[:60]
    assert regex.findall(ours, "中文English混合 ABCdef's 12345") == [
        "中文", "English", "混合", " ABCdef's", " ", "123", "45"]


def test_k3_gguf_serves_text_with_its_own_tokenizer_and_template(reference, k3_gguf):
    from fastapi.testclient import TestClient

    from k3serve.engine.config import EngineConfig
    from k3serve.engine.engine import LLMEngine
    from k3serve.serve.api import create_app

    loaded = load_model(k3_gguf)
    assert loaded.tokenizer is not None and loaded.tokenizer.chat_template == TEMPLATE
    folder = load_model(default_model_dir()).model
    engine = LLMEngine(loaded.model, EngineConfig(block_size=4, num_blocks=256, max_model_len=256),
                       stop_ids=loaded.stop_ids)
    with TestClient(create_app(engine, loaded.tokenizer, "k3-gguf")) as client:
        response = client.post("/v1/chat/completions", json={
            "model": "k3-gguf", "messages": [{"role": "user", "content": "Once upon a time"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    prompt = reference.encode("<|im_user|>Once upon a time<|im_end|><|im_assistant|>", allow_special=True)
    assert body["usage"]["prompt_tokens"] == len(prompt)
    expected = folder.greedy(prompt, 8)  # the same weights from the safetensors folder
    text = reference.decode([t for t in expected if not reference.is_special(t)])
    assert body["choices"][0]["message"]["content"] == text and text.strip()


def test_pack_streams_a_k3_gguf_as_it_runs_resident(reference, k3_gguf, tmp_path):
    """`k3serve pack FILE.gguf OUT` reads the file through the same reader as `--model FILE.gguf`: the store streamed
    at its minimum budget gives the resident file's logits and greedy tokens, with the file's tokenizer."""
    import numpy as np

    from k3serve.cli.main import main
    from k3serve.stream.budget import minimum_budget_bytes
    from k3serve.stream.options import StreamOptions
    from k3serve.weights.store import PackedStore

    out = tmp_path / "store"
    assert main(["pack", str(k3_gguf), str(out)]) == 0
    store = PackedStore(out)
    resident = load_model(k3_gguf)
    streamed = load_model(out, stream=StreamOptions(ram_budget=minimum_budget_bytes(store), io="pread",
                                                    trunk_dtype="float32"))
    ids = reference.encode("The old man said: \"Once upon a time, there was a king.\"")
    assert np.array_equal(streamed.model.logits(ids), resident.model.logits(ids))
    assert streamed.model.greedy(ids, 8) == resident.model.greedy(ids, 8)
    assert streamed.model.source.stats().stream.expert_evictions > 0
    for text in CORPUS:
        assert streamed.tokenizer.encode(text) == reference.encode(text), text[:60]
    assert streamed.tokenizer.chat_template == TEMPLATE
    assert set(streamed.stop_ids) == set(resident.stop_ids)


def test_pack_of_a_k3_gguf_refuses_what_it_cannot_do(k3_gguf, tmp_path, capsys):
    from k3serve.cli.main import main

    assert main(["pack", str(k3_gguf), str(tmp_path / "s"), "--shard", "0/2"]) != 0
    assert "is a GGUF file: --shard" in capsys.readouterr().err
    assert main(["pack", str(k3_gguf), str(tmp_path / "s"), "--expert-precision", "int8"]) != 0
    assert "K3 experts ship as MXFP4" in capsys.readouterr().err


def test_the_stream_decoder_of_a_k3_gguf_prints_no_special_token(reference, k3_gguf):
    ours = tokenizer_from_gguf(GGUFFile(k3_gguf).metadata, "k3.gguf")
    specials = sorted(ours.special_tokens.values())
    ids = ours.encode("before") + specials + ours.encode(" after ünï")
    decoder = ours.stream_decoder()
    text = "".join(decoder.add(t) for t in ids) + decoder.flush()
    assert text == "before after ünï"
    assert text == ours.decode([t for t in ids if not ours.is_special(t)])


def test_generate_on_a_k3_gguf_never_prints_special_tokens(reference, k3_gguf, capsys):
    """With --ignore-eos the model goes on after [EOS] with [BOS] (a new document), as the real K3 does: the ids
    hold them, the printed text does not."""
    from k3serve.cli.main import main

    run = ["generate", "--model", str(k3_gguf), "--temperature", "1", "--seed", "1", "--ignore-eos",
           "--max-tokens", "160", "--no-token-healing"]
    prompt = "hello"
    assert main(run + ["--prompt-ids", ",".join(map(str, reference.encode(prompt)))]) == 0
    ids = [int(t) for t in capsys.readouterr().out.strip().split(",")]
    bos, eos = reference.special_tokens["[BOS]"], reference.special_tokens["[EOS]"]
    assert bos in ids and eos in ids  # the run goes past an end of document
    assert main(run + ["--prompt", prompt]) == 0
    printed = capsys.readouterr().out
    for special in reference.special_tokens:
        assert special not in printed, special
    assert printed == reference.decode([t for t in ids if not reference.is_special(t)]) + "\n"
