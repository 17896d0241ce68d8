"""The tokenizer rebuilt from GGUF metadata: a byte-level BPE trained with `tokenizers`, written into GGUF keys the
way llama.cpp's converter writes them (tokens by id, token types, merges, pre-tokenizer name, special ids, chat
template), encodes every text exactly as `tokenizers` does from the original tokenizer.json."""

from __future__ import annotations

import json

import gguf
import pytest
from tokenizers import Regex, pre_tokenizers

from k3serve.errors import TokenizerError
from k3serve.gguf_tokenizer import CONTROL, NORMAL, tokenizer_from_gguf
from k3serve.weights.gguf_file import GGUFFile
from test_hf_tokenizer import DEEPSEEK_PATTERNS, QWEN_PATTERN, SPECIALS, assert_parity, copy, train

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def qwen_style():
    return train(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_PATTERN), "isolated"),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))


def gguf_metadata(tokenizer, pre: str) -> dict:
    """What the converter writes for a byte-level BPE: every id's token string and type, merges as "a b"."""
    spec = json.loads(tokenizer.to_str())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    specials = {t["id"]: t["content"] for t in spec["added_tokens"]}
    size = max(list(by_id) + list(specials)) + 1
    tokens = [specials.get(i, by_id.get(i, f"[PAD{i}]")) for i in range(size)]
    types = [CONTROL if i in specials else NORMAL for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"), "tokenizer.chat_template": TEMPLATE}


def test_qwen2_pre_tokenizer_matches_the_reference(qwen_style):
    ours = tokenizer_from_gguf(gguf_metadata(qwen_style, "qwen2"), "test")
    assert_parity(ours, qwen_style)
    assert ours.chat_template == TEMPLATE
    assert ours.eos_ids == (qwen_style.token_to_id("<|im_end|>"),)
    assert set(ours.special_tokens) == set(SPECIALS)


def test_deepseek_v3_pre_tokenizer_matches_the_reference(qwen_style):
    reference = copy(qwen_style)
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), "isolated") for p in DEEPSEEK_PATTERNS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert_parity(tokenizer_from_gguf(gguf_metadata(reference, "deepseek-v3"), "test"), reference)


def test_unknown_pre_tokenizer_and_model_are_named(qwen_style):
    with pytest.raises(TokenizerError, match="pre-tokenizer 'llama-bpe' is not known"):
        tokenizer_from_gguf(gguf_metadata(qwen_style, "llama-bpe"), "test")
    metadata = gguf_metadata(qwen_style, "qwen2") | {"tokenizer.ggml.model": "llama"}
    with pytest.raises(TokenizerError, match="tokenizer model 'llama'"):
        tokenizer_from_gguf(metadata, "test")


def test_metadata_survives_a_gguf_file(qwen_style, tmp_path):
    """The same keys through gguf.GGUFWriter and our reader (string arrays, int arrays, scalars)."""
    metadata = gguf_metadata(qwen_style, "qwen2")
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen3moe")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    writer.add_token_merges(metadata["tokenizer.ggml.merges"])
    writer.add_eos_token_id(metadata["tokenizer.ggml.eos_token_id"])
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    read = GGUFFile(tmp_path / "t.gguf").metadata
    assert {k: read[k] for k in metadata} == metadata
    assert_parity(tokenizer_from_gguf(read, "test"), qwen_style)


# ---- a GGUF file with its tokenizer: generate and serve need no side files --------------------------------------

@pytest.fixture(scope="module")
def gguf_with_tokenizer(qwen_style, tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "model" / "families"))
    from _gguf_writer import write_gguf
    from _hf_tiny import build_tiny

    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    metadata = gguf_metadata(qwen_style, "qwen2")
    build_tiny("qwen3_moe", folder, vocab_size=len(metadata["tokenizer.ggml.tokens"]), mlp_only_layers=[])

    def add_tokenizer(writer, arch):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(metadata["tokenizer.ggml.tokens"])
        writer.add_token_types(metadata["tokenizer.ggml.token_type"])
        writer.add_token_merges(metadata["tokenizer.ggml.merges"])
        writer.add_eos_token_id(metadata["tokenizer.ggml.eos_token_id"])
        writer.add_chat_template(TEMPLATE)

    return write_gguf(folder, folder / "tiny.gguf", "BF16", metadata=add_tokenizer)


def test_generate_cli_runs_a_gguf_file(gguf_with_tokenizer):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "k3serve.cli", "generate", "--model", str(gguf_with_tokenizer),
                             "--prompt", "def f(x):", "--max-tokens", "6", "--ignore-eos", "--temperature", "0"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip()


def test_serve_renders_the_gguf_chat_template(gguf_with_tokenizer, qwen_style):
    import httpx

    from k3serve.engine.config import EngineConfig
    from k3serve.engine.engine import LLMEngine
    from k3serve.loading import load_model
    from k3serve.serve.api import create_app
    from k3serve.serve.threaded import serve_in_thread

    loaded = load_model(gguf_with_tokenizer)
    assert loaded.tokenizer is not None and loaded.tokenizer.chat_template == TEMPLATE
    engine = LLMEngine(loaded.model, EngineConfig(max_model_len=256, max_seqs=4, max_batch_tokens=256,
                                                  kv_cache_bytes=8 << 20), stop_ids=loaded.stop_ids)
    app = create_app(engine, loaded.tokenizer, "tiny")
    messages = [{"role": "user", "content": "hello there"}]
    with serve_in_thread(app) as url:
        reply = httpx.post(url + "/v1/chat/completions", timeout=120,
                           json={"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    rendered = "<|im_start|>user\nhello there<|im_end|>\n"
    expected = qwen_style.encode(rendered, add_special_tokens=False).ids
    assert reply.json()["usage"]["prompt_tokens"] == len(expected)
