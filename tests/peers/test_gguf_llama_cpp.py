"""GGUF files made by llama.cpp itself, read by k3serve, against llama.cpp (llama-cpp-python) on the same file.

- The tokenizer: llama.cpp ships a real Qwen2 vocabulary as a vocab-only GGUF (models/ggml-vocab-qwen2.gguf) with
  its own test vectors (.inp texts, .out token ids); our GGUF tokenizer must give every one of them.
- The converter, unpatched: its vocab step only accepts tokenizers whose encoding of a fixed text it recognises,
  so the tiny Qwen3-MoE gets the real Qwen2 vocabulary (rebuilt as a tokenizer.json from that vocab GGUF; the
  converter then recognises it as qwen2 on its own). The GGUF it writes must give, in k3serve, the same logits as
  the safetensors checkpoint, and logits close to llama.cpp's own on the same file, with the same argmax.

Needs the `peers` extra and the llama-cpp-python 0.3.36 sdist (see test_llama_cpp_convert.py); skips without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="the peers extra is not installed (pip install -e '.[peers]')")

from k3serve.gguf_tokenizer import tokenizer_from_gguf, tokenizer_spec  # noqa: E402
from k3serve.loading import load_model  # noqa: E402
from k3serve.model.families import load_family  # noqa: E402
from k3serve.weights.gguf_file import GGUFFile  # noqa: E402

SDIST = Path(os.environ.get("K3SERVE_LLAMA_CPP_SDIST", "/tmp/llama_sdist/llama_cpp_python-0.3.36.tar.gz"))
VOCAB = "ggml-vocab-qwen2.gguf"
LLAMA_CPP_TOLERANCE = 1e-2  # llama.cpp's CPU graph vs ours on logits of magnitude ~3; measured 2.8e-3


@pytest.fixture(scope="module")
def llama_cpp_tree(tmp_path_factory) -> Path:
    if not SDIST.exists():
        pytest.fail(f"the peers extra is installed but llama.cpp's sdist is not at {SDIST} (see "
                    "test_llama_cpp_convert.py)")
    root = tmp_path_factory.mktemp("llama_sdist")
    with tarfile.open(SDIST) as archive:
        members = [m for m in archive.getmembers()
                   if "/vendor/llama.cpp/" in m.name and ("/conversion/" in m.name or "/gguf-py/" in m.name
                                                          or m.name.endswith("/convert_hf_to_gguf.py")
                                                          or f"/models/{VOCAB}" in m.name
                                                          or "/models/templates/" in m.name)]
        archive.extractall(root, members=members, filter="data")
    (tree,) = root.glob("*/vendor/llama.cpp")
    return tree


def test_qwen2_vocab_gguf_passes_llama_cpps_own_token_vectors(llama_cpp_tree):
    path = llama_cpp_tree / "models" / VOCAB
    tokenizer = tokenizer_from_gguf(GGUFFile(path).metadata, str(path))
    texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = path.with_suffix(".gguf.out").read_text(encoding="utf-8").strip("\n").split("\n")
    assert len(expected) >= 40
    for text, ids in zip(texts, expected):
        assert tokenizer.encode(text) == [int(i) for i in ids.split()], text


def _qwen2_tokenizer_json(vocab: GGUFFile) -> dict:
    """The vocab GGUF as a complete tokenizer.json (the fields `tokenizers` requires, NFC as Qwen2's)."""
    spec = tokenizer_spec(vocab.metadata, VOCAB)
    spec["normalizer"] = {"type": "NFC"}
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    spec["model"].update(dropout=None, unk_token=None, continuing_subword_prefix=None, end_of_word_suffix=None,
                         fuse_unk=False, byte_fallback=False, ignore_merges=False)
    for token in spec["added_tokens"]:
        token.update(single_word=False, lstrip=False, rstrip=False, normalized=False)
    spec.update(version="1.0", truncation=None, padding=None, post_processor=None)
    return spec


def test_llama_cpp_converted_qwen3_moe_matches_safetensors_and_llama_cpp(llama_cpp_tree, tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "model" / "families"))
    from _hf_tiny import build_tiny

    vocab = GGUFFile(llama_cpp_tree / "models" / VOCAB)
    num_tokens = len(vocab.metadata["tokenizer.ggml.tokens"])
    eos = int(vocab.metadata["tokenizer.ggml.eos_token_id"])
    folder = tmp_path / "tiny"
    build_tiny("qwen3_moe", folder, vocab_size=num_tokens, mlp_only_layers=[], bos_token_id=None,
               eos_token_id=eos, pad_token_id=eos)
    (folder / "tokenizer.json").write_text(json.dumps(_qwen2_tokenizer_json(vocab), ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": vocab.metadata["tokenizer.ggml.tokens"][eos],
                                                              "add_bos_token": False}))
    out = tmp_path / "tiny.gguf"
    run = subprocess.run([sys.executable, str(llama_cpp_tree / "convert_hf_to_gguf.py"), str(folder), "--outfile",
                          str(out), "--outtype", "f32"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]

    loaded = load_model(out)
    text = "Hello world, this is a test."
    ids = loaded.tokenizer.encode(text)
    assert loaded.model.config.model_type == "qwen3_moe"
    assert np.array_equal(loaded.model.logits(ids), load_family(folder).logits(ids))

    llm = llama_cpp.Llama(model_path=str(out), logits_all=True, n_ctx=64, n_threads=1, verbose=False)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)], dtype=np.float32)
    ours = loaded.model.logits(ids)
    assert float(np.max(np.abs(theirs - ours))) < LLAMA_CPP_TOLERANCE
    assert np.array_equal(theirs.argmax(-1), ours.argmax(-1))


def test_llama_cpp_converted_k3_matches_the_folder(llama_cpp_tree, tmp_path):
    """llama.cpp's K3 converter, unpatched, gets past its vocab step when the tiny oracle carries a vocabulary it
    recognises (Qwen2's, as above): the whole file is written, MXFP4 experts included, and k3serve reads it back to
    the folder's logits (to the rounding of A_log) and greedy tokens. llama.cpp's own kimi-k3 graph on that file is
    not compared: it disagrees with ours (docs/FAMILIES.md), which is not settled."""
    import dataclasses

    from k3serve.config import tiny_config
    from k3serve.weights.synthetic import write_random_checkpoint

    vocab = GGUFFile(llama_cpp_tree / "models" / VOCAB)
    eos = int(vocab.metadata["tokenizer.ggml.eos_token_id"])
    config = dataclasses.replace(tiny_config(), vocab_size=len(vocab.metadata["tokenizer.ggml.tokens"]),
                                 bos_token_id=None, eos_token_ids=(eos,))
    folder = tmp_path / "k3"
    write_random_checkpoint(config, folder, seed=3)
    (folder / "tokenizer.json").write_text(json.dumps(_qwen2_tokenizer_json(vocab), ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": vocab.metadata["tokenizer.ggml.tokens"][eos],
                                                              "add_bos_token": False}))
    out = tmp_path / "k3.gguf"
    run = subprocess.run([sys.executable, str(llama_cpp_tree / "convert_hf_to_gguf.py"), str(folder), "--outfile",
                          str(out), "--outtype", "bf16"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "repacked" in run.stdout + run.stderr  # the experts went through its MXFP4 repack

    from_gguf, from_folder = load_model(out), load_model(folder)
    ids = from_gguf.tokenizer.encode("Hello world, this is a test.")
    ours, expected = from_gguf.model.logits(ids), from_folder.model.logits(ids)
    assert float(np.max(np.abs(ours - expected))) <= 1e-5 * float(np.max(np.abs(expected)))
    assert from_gguf.model.greedy(ids, 6) == from_folder.model.greedy(ids, 6)
