"""llama.cpp's own K3 converter (`conversion/kimi_k3.py` in the llama-cpp-python 0.3.36 sdist), unpatched, on the
tiny oracle exactly as `k3serve make-tiny` writes it: it reads our config (the released keys: architectures,
hidden_act, mla_use_nope, num_key_value_heads, max_position_embeddings) and converts every tensor, MXFP4 experts
included. Without those keys it stops in its parameter step.

Only the vocabulary stays out of reach, and that is llama.cpp's design, not our files: its converter identifies a
BPE pre-tokenizer by hashing the ids of a fixed text and knows only released tokenizers (K3's through Kimi's
remote code), so no tiny tokenizer can pass. The test therefore checks that the converter gets past the config
and every tensor and, if it stops, stops at the tokenizer and nowhere else.

Needs the `peers` extra (llama-cpp-python, gguf) and the converter's source, the sdist:
    pip install -e '.[peers]'
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llama_sdist
(K3SERVE_LLAMA_CPP_SDIST names another path). Without the extra the test skips, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="the peers extra is not installed (pip install -e '.[peers]'): llama.cpp "
                                        "interop is not tested")

from k3serve.cli.main import main as k3serve_main  # noqa: E402

SDIST = Path(os.environ.get("K3SERVE_LLAMA_CPP_SDIST", "/tmp/llama_sdist/llama_cpp_python-0.3.36.tar.gz"))
INTEROP_KEYS = ("hidden_act", "mla_use_nope", "num_key_value_heads", "max_position_embeddings")


@pytest.fixture(scope="module")
def converter(tmp_path_factory) -> Path:
    if not SDIST.exists():
        pytest.fail(f"the peers extra is installed but llama.cpp's converter is not at {SDIST}: run "
                    "pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llama_sdist "
                    "(or set K3SERVE_LLAMA_CPP_SDIST)")
    root = tmp_path_factory.mktemp("llama_sdist")
    with tarfile.open(SDIST) as archive:
        members = [m for m in archive.getmembers()
                   if "/vendor/llama.cpp/" in m.name and ("/conversion/" in m.name or "/gguf-py/" in m.name
                                                          or m.name.endswith("/convert_hf_to_gguf.py")
                                                          or "/models/templates/" in m.name)]
        archive.extractall(root, members=members, filter="data")
    (script,) = root.glob("*/vendor/llama.cpp/convert_hf_to_gguf.py")
    return script


def _convert(script: Path, model: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), str(model), "--outfile", str(out), "--outtype", "bf16"],
                          capture_output=True, text=True, timeout=600)


def test_llama_cpp_converts_our_tiny_oracle_unpatched(converter, tmp_path):
    model = tmp_path / "tiny"
    assert k3serve_main(["make-tiny", str(model)]) == 0
    run = _convert(converter, model, tmp_path / "tiny.gguf")
    log = run.stdout + run.stderr
    assert "Set model parameters" in log and "Set model quantization version" in log, log[-3000:]
    assert "repacked 8 experts to MXFP4" in log, "the MXFP4 experts were not converted as MXFP4"
    if run.returncode != 0:  # only the vocabulary may stop it (see the module docstring)
        tail = log[log.index("Set model tokenizer"):]
        assert "pre-tokenizer" in tail or "tokenizer" in tail.lower(), log[-3000:]
    else:
        assert (tmp_path / "tiny.gguf").stat().st_size > 0


def test_without_the_released_keys_the_converter_stops_at_the_config(converter, tmp_path):
    model = tmp_path / "tiny"
    assert k3serve_main(["make-tiny", str(model)]) == 0
    raw = json.loads((model / "config.json").read_text())
    for key in INTEROP_KEYS:
        del raw["text_config"][key]
    (model / "config.json").write_text(json.dumps(raw))
    run = _convert(converter, model, tmp_path / "old.gguf")
    log = run.stdout + run.stderr
    assert run.returncode != 0 and "Set model tokenizer" not in log, log[-3000:]
