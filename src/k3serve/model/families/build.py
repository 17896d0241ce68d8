"""Pieces every family builder shares: the common config keys, GLU and lm_head weights, and expert readers.

Experts come in two layouts, both read lazily, one expert at a time:
- per expert (released checkpoints, and what transformers' `save_pretrained` writes back):
  `{moe}experts.{e}.{gate}.weight` [I, H], `{up}` [I, H], `{down}` [H, I];
- fused (transformers' in-memory layout): `{moe}experts.gate_up_proj` [E, 2I, H], `{moe}experts.down_proj`
  [E, H, I]; one expert's slice is read by byte range, never the whole tensor.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from k3serve.errors import CheckpointError
from k3serve.model.families.experts import ExpertReader, Int8Matrix, MXFP4Matrix
from k3serve.model.families.hf_config import HFConfig
from k3serve.model.families.moe import GLUWeights
from k3serve.model.families.tensors import TensorReader
from k3serve.model.weights import fuse_rows, keep_bf16
from k3serve.weights.bf16 import bf16_bits_to_f32
from k3serve.weights.safetensors_io import STORAGE_DTYPES

# transformers builds q_a_layernorm and kv_a_layernorm (DeepSeek-V3, Kimi Linear) without passing the config's
# eps, so they use the class default
MLA_INNER_NORM_EPS = 1e-6


def common_keys(config: HFConfig) -> dict:
    """The DecoderConfig fields every family reads the same way."""
    bos, eos = config.special_ids()
    return dict(
        vocab_size=config.integer("vocab_size"),
        hidden_size=config.integer("hidden_size"),
        num_layers=config.integer("num_hidden_layers"),
        rms_norm_eps=config.number("rms_norm_eps"),
        # absent in some released configs; transformers' default for every family here is False
        tie_word_embeddings=bool(config.optional("tie_word_embeddings", False)),
        bos_token_id=bos,
        eos_token_ids=eos,
    )


def check_supported_basics(config: HFConfig) -> None:
    config.require_value("hidden_act", ("silu",))
    config.require_value("attention_bias", (False,), value_when_absent=False)


def glu(reader: TensorReader, prefixes: tuple[str, ...], hidden: int, width: int) -> GLUWeights:
    """A SiLU-GLU MLP under the first of `prefixes` that holds it."""
    prefix = next((p for p in prefixes if f"{p}gate_proj.weight" in reader), prefixes[0])
    gate = reader.matrix(f"{prefix}gate_proj.weight", shape=(width, hidden))
    up = reader.matrix(f"{prefix}up_proj.weight", shape=(width, hidden))
    down = reader.matrix(f"{prefix}down_proj.weight", shape=(hidden, width))
    return GLUWeights(gate_up=fuse_rows([gate, up]), down=down)


def embeddings(reader: TensorReader, vocab: int, hidden: int, tied: bool) -> tuple[np.ndarray, np.ndarray]:
    """(embed [V, H], lm_head [V, H]), each as bf16 bits when its values are bf16 (`keep_bf16`), or Q8_0 / MXFP4
    bytes where the source stores them so or the reader's trunk precision quantizes them; a tied model reuses the
    embedding."""
    # held as `matrix` holds a trunk matrix (a GGUF Q8_0 file's embedding was widened before: 1.2 GB as float32 at
    # a 150k vocabulary); the lookup decodes its rows (`QuantizedMatrix.rows`). An untied GGUF Q8_0 embedding stays
    # in the mapped file, as llama.cpp leaves it: only the rows a prompt looks up become resident (315 MB at
    # Qwen3-30B-A3B's 151,936 x 2048 when copied)
    embed = reader.matrix("model.embed_tokens.weight", shape=(vocab, hidden), mapped=not tied)
    if tied:
        return embed, embed
    return embed, reader.matrix("lm_head.weight", shape=(vocab, hidden))


def _read_slice(reader: TensorReader, name: str, index: int, shape: tuple[int, int]) -> np.ndarray:
    """Slice `index` of a [E, R, C] tensor, by byte range."""
    info = reader.index.info(name)
    if len(info.shape) != 3 or tuple(info.shape[1:]) != shape:
        raise CheckpointError(f"{reader.family} checkpoint {reader.path}: tensor {name!r} has shape "
                              f"{list(info.shape)}, expected [E, {shape[0]}, {shape[1]}]")
    stored = STORAGE_DTYPES[info.dtype]
    size = math.prod(shape) * stored.itemsize
    raw = np.frombuffer(reader.index.read_range(name, index * size, size), dtype=stored).reshape(shape)
    if info.dtype == "BF16":
        return bf16_bits_to_f32(raw)
    return raw.astype(np.float32)


def expert_reader(reader: TensorReader, moe_prefix: Callable[[int], str], matrix_names: tuple[str, str, str],
                  hidden: int, width: int) -> ExpertReader:
    """(layer, expert) -> float32 (gate [I, H], up [I, H], down [H, I]) from whichever layout is present, or a
    GGUF's MXFP4 / Q8_0 matrices as stored (`MXFP4Matrix`, `Int8Matrix` with block scales).

    `matrix_names` are the per-expert module names of gate, up and down (("gate_proj", "up_proj", "down_proj"),
    or Kimi's ("w1", "w3", "w2"))."""
    gate_name, up_name, down_name = matrix_names

    def read(layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        prefix = moe_prefix(layer)
        per_expert = f"{prefix}experts.{expert}."
        if f"{per_expert}{gate_name}.weight" in reader or f"{prefix}experts.gate_up_proj" not in reader:
            names = [f"{per_expert}{m}.weight" for m in matrix_names]
            gate, up, down = (reader.kept(n) for n in names)
            if gate is not None and up is not None and down is not None and gate[0] == up[0] == down[0]:
                # a GGUF's MXFP4 or Q8_0 experts, as stored
                matrix = MXFP4Matrix if gate[0] == "mxfp4" else Int8Matrix
                return matrix(gate[1], gate[2]), matrix(up[1], up[2]), matrix(down[1], down[2])
            return (reader.f32(f"{per_expert}{gate_name}.weight", shape=(width, hidden)),
                    reader.f32(f"{per_expert}{up_name}.weight", shape=(width, hidden)),
                    reader.f32(f"{per_expert}{down_name}.weight", shape=(hidden, width)))
        gate_up = _read_slice(reader, f"{prefix}experts.gate_up_proj", expert, (2 * width, hidden))
        down = _read_slice(reader, f"{prefix}experts.down_proj", expert, (hidden, width))
        return gate_up[:width], gate_up[width:], down

    return read
