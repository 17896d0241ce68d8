"""`k3serve pack FILE.gguf OUT` for the families: the store is written through the reader `--model FILE.gguf` uses,
and the model streamed from it under a RAM budget small enough to force evictions gives the resident GGUF model's
greedy tokens, alone and batched in the engine. Cases: Q8_0 trunk and experts (Qwen3-MoE: the trunk widened to
float32, the experts kept as Q8_0 blocks), MXFP4 experts kept packed (DeepSeek-V3), BF16 experts kept as bf16 with
KDA layers (Kimi Linear), and int8 experts requantized at pack time (Qwen3-Next)."""

from __future__ import annotations

import pytest

from _gguf_writer import write_gguf
from _hf_tiny import build_tiny, prompt
from k3serve.cli.main import main
from k3serve.loading import load_model
from k3serve.model.families.loading import load_family_gguf
from k3serve.stream.family_source import StreamingExperts, trunk_float32_bytes
from k3serve.stream.options import StreamOptions
from k3serve.weights.family_store import FamilyStore
from k3serve.weights.quantized import QuantizedMatrix
from k3serve.weights.safetensors_io import SafetensorsIndex
from test_families_gguf import GGUF_SETTINGS, _engine_tokens

# family -> (GGUF tensor type, --expert-precision, the store's blob kind)
CASES = {
    "qwen3_moe": ("Q8_0", "native", "int8"),
    "deepseek_v3": ("MXFP4", "native", "mxfp4"),
    "kimi_linear": ("BF16", "native", "bf16"),
    "qwen3_next": ("F32", "int8", "int8"),
}
NUM_TOKENS = 5


@pytest.mark.parametrize("family", list(CASES))
def test_a_packed_gguf_streams_the_resident_gguf_tokens(family, tmp_path):
    tensor_type, precision, kind = CASES[family]
    folder = tmp_path / "hf"
    build_tiny(family, folder, **GGUF_SETTINGS[family])
    path = write_gguf(folder, tmp_path / "m.gguf", tensor_type)
    out = tmp_path / "store"
    assert main(["pack", str(path), str(out), "--expert-precision", precision]) == 0
    store = FamilyStore(out)
    assert (store.precision, store.kind) == (precision, kind)

    resident = load_family_gguf(path, expert_precision=precision)
    prompts = [prompt(6, seed=1), prompt(9, seed=2), prompt(4, seed=3)]
    want = [resident.greedy(p, NUM_TOKENS) for p in prompts]
    globals_bytes, layers = trunk_float32_bytes(store.trunk_path)
    budget = globals_bytes + sum(layers.values()) + (store.top_k + 2) * store.expert_stride
    model = load_model(out, stream=StreamOptions(ram_budget=budget, io="pread")).model
    assert isinstance(model.experts, StreamingExperts)
    assert model.experts.plan.expert_slots == store.top_k + 2 < store.num_experts_total
    assert [model.greedy(p, NUM_TOKENS) for p in prompts] == want
    assert _engine_tokens(model, prompts, NUM_TOKENS) == want
    stats = model.experts.stats().stream
    assert stats.expert_evictions > 0, stats
    model.experts.close()


def test_a_packed_gguf_keeps_q8_0_mla_heads_as_blocks(tmp_path):
    """DeepSeek-V3 with a Q8_0 trunk and 32-wide heads: attn_k_b / attn_v_b go into the store as their Q8_0 blocks
    (`kv_b_proj.k_b` / `.v_b`, U8), without the joined float32 kv_b (never read), and the model streamed from the
    store multiplies the same blocks: the resident file's greedy tokens."""
    folder = tmp_path / "hf"
    build_tiny("deepseek_v3", folder, qk_nope_head_dim=32, v_head_dim=32, **GGUF_SETTINGS["deepseek_v3"])
    path = write_gguf(folder, tmp_path / "m.gguf", "Q8_0")
    out = tmp_path / "store"
    assert main(["pack", str(path), str(out)]) == 0
    store = FamilyStore(out)
    trunk = SafetensorsIndex.open(store.trunk_path)
    try:
        names = set(trunk)
        layers = [n[:-len("kv_b_proj.k_b")] for n in names if n.endswith("kv_b_proj.k_b")]
        assert layers and not any(n.endswith("kv_b_proj.weight") for n in names)
        assert all(trunk.info(p + "kv_b_proj.k_b").dtype == "U8" and trunk.info(p + "kv_b_proj.v_b").dtype == "U8"
                   for p in layers)
    finally:
        trunk.close()
    resident = load_family_gguf(path)
    prompts = [prompt(6, seed=1), prompt(9, seed=2)]
    want = [resident.greedy(p, NUM_TOKENS) for p in prompts]
    model = load_model(out, stream=StreamOptions(ram_budget=1 << 30, io="pread")).model
    assert all(isinstance(layer.mixer.weights.w_uk, QuantizedMatrix) for layer in model.layers)
    assert [model.greedy(p, NUM_TOKENS) for p in prompts] == want
    model.experts.close()
