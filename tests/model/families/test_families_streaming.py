"""Every family streams: `k3serve pack` writes a family store (trunk + checksummed expert blobs at the chosen
precision), and a model opened from it under a RAM budget small enough to force evictions gives exactly the
resident model's greedy tokens, alone and batched in the engine, with and without next-layer prefetch.

Precisions covered: float32 experts (the tiny checkpoints' "native"), bf16 experts (a bf16 checkpoint), int8 and
MXFP4; shared experts (DeepSeek-V3, Kimi Linear, Qwen3-Next), dense first layers (Kimi Linear, DeepSeek-V3),
a dense middle layer (Qwen3-MoE), KDA / DeltaNet layers (Kimi Linear, Qwen3-Next)."""

from __future__ import annotations

import numpy as np
import pytest

import _hf_tiny
from _hf_tiny import prompt
from k3serve.cli.main import main
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.loading import load_model
from k3serve.model.families import load_family
from k3serve.model.families.expert_blobs import BlobPart, expert_arrays, view_expert
from k3serve.stream.budget import BudgetError
from k3serve.stream.family_source import StreamingExperts, trunk_float32_bytes
from k3serve.stream.options import StreamOptions
from k3serve.weights.family_store import FamilyStore

# family -> (expert precision packed, blob kind, source checkpoint in bf16)
CASES = {
    "kimi_linear": ("mxfp4", "mxfp4", False),
    "deepseek_v3": ("int8", "int8", False),
    "qwen3_moe": ("native", "bf16", True),
    "qwen3_next": ("native", "f32", False),
}
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def packed(tiny_hf, tmp_path_factory):
    """family -> (source folder, store folder), packed through the CLI."""
    done: dict = {}

    def get(family: str):
        if family not in done:
            precision, _, bf16 = CASES[family]
            if bf16:
                source = tmp_path_factory.mktemp(f"bf16-{family}")
                _hf_tiny.build_tiny(family, source, bf16=True)
            else:
                source = tiny_hf(family)[1]
            out = tmp_path_factory.mktemp(f"store-{family}")
            assert main(["pack", str(source), str(out), "--expert-precision", precision]) == 0
            done[family] = (source, out)
        return done[family]

    return get


def _tight_budget(store: FamilyStore, spare_slots: int) -> int:
    globals_bytes, layers = trunk_float32_bytes(store.trunk_path)
    return globals_bytes + sum(layers.values()) + (store.top_k + spare_slots) * store.expert_stride


def _engine_tokens(model, prompts) -> list[list[int]]:
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=128, max_batch_tokens=16), stop_ids=())
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        engine.check_integrity()
        model.experts.check_integrity()
    return [final[i] for i in ids]


@pytest.mark.parametrize("family", list(CASES))
def test_pack_round_trip_gives_the_resident_experts(packed, family):
    source, out = packed(family)
    precision, kind, _ = CASES[family]
    store = FamilyStore(out)
    assert (store.model_type, store.precision, store.kind) == (family, precision, kind)
    resident = load_family(source, expert_precision=precision)
    parts = [BlobPart.from_json(p) for p in store.parts_json]
    raw = np.fromfile(store.expert_path, dtype=np.uint8)
    for layer in store.moe_layers:
        for expert in (0, store.num_experts - 1):
            offset = store.expert_offset(layer, expert)
            streamed = view_expert(store.kind, parts, raw[offset:offset + store.expert_stride])
            want_kind, want = expert_arrays(resident.experts.get(layer, expert))
            got_kind, got = expert_arrays(streamed)
            assert got_kind == want_kind == kind
            for name in want:
                assert np.array_equal(got[name], want[name]), (layer, expert, name)
    assert (out / "config.json").read_bytes() == (source / "config.json").read_bytes()


@pytest.mark.parametrize("family", list(CASES))
def test_streaming_under_a_tight_budget_gives_the_resident_tokens(packed, family):
    source, out = packed(family)
    precision = CASES[family][0]
    resident = load_family(source, expert_precision=precision)
    prompts = [prompt(6, seed=1), prompt(9, seed=2), prompt(4, seed=3)]
    want = [resident.greedy(p, GREEDY.max_tokens) for p in prompts]
    store = FamilyStore(out)
    for prefetch in ("none", "next-layer"):
        options = StreamOptions(ram_budget=_tight_budget(store, 2), prefetch=prefetch, io="pread")
        loaded = load_model(out, stream=options)
        model = loaded.model
        assert isinstance(model.experts, StreamingExperts)
        assert model.experts.plan.expert_slots == store.top_k + 2 < store.num_experts_total
        assert [model.greedy(p, GREEDY.max_tokens) for p in prompts] == want, prefetch
        assert _engine_tokens(model, prompts) == want, prefetch
        stats = model.experts.stats().stream
        assert stats.expert_evictions > 0 and stats.expert_misses > store.top_k + 2, stats
        assert stats.expert_bytes_read >= stats.expert_misses * store.expert_blob_size
        if prefetch == "next-layer":
            assert stats.prefetch_issued > 0, stats
        model.experts.close()


def test_family_budget_and_flags_are_checked(packed):
    _, out = packed("qwen3_moe")
    store = FamilyStore(out)
    minimum = _tight_budget(store, 0)
    with pytest.raises(BudgetError, match=f"use --ram-budget {minimum} or more"):
        load_model(out, stream=StreamOptions(ram_budget=minimum - 1))
    with pytest.raises(Exception, match="--pin-trunk applies to K3 stores only"):
        load_model(out, stream=StreamOptions(ram_budget=minimum, pin_trunk_bytes=0))
    unlimited = load_model(out, stream=StreamOptions()).model
    assert unlimited.experts.plan.expert_slots == store.num_experts_total
    unlimited.experts.close()


def test_cli_generate_streams_a_family_store_and_a_plain_folder_says_to_pack(packed, capsys):
    source, out = packed("qwen3_next")
    assert main(["generate", "--model", str(out), "--ram-budget", "64M", "--prompt-ids", "5,6,7",
                 "--max-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "experts=native" in err and "trunk=resident" in err, err
    assert main(["generate", "--model", str(source), "--ram-budget", "64M", "--prompt-ids", "5,6",
                 "--max-tokens", "2"]) == 2
    assert f"run `k3serve pack {source} PACKED_DIR`" in capsys.readouterr().err


def test_pack_stripe_of_a_family_checkpoint_is_refused(tiny_hf, tmp_path, capsys):
    drive = tmp_path / "drive"
    drive.mkdir()
    source = tiny_hf("qwen3_moe")[1]
    assert main(["pack", str(source), str(tmp_path / "out"), "--stripe", str(drive)]) == 2
    assert "--stripe (several drives) is built for K3 stores" in capsys.readouterr().err
    assert list(drive.iterdir()) == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_a_q8_0_trunk_store_streams_what_the_resident_q8_0_trunk_computes(family, tiny_hf, tmp_path):
    """`pack --trunk-precision q8_0` of a family folder stores each matrix the loader quantizes as its Q8_0 blocks:
    streamed under a tight budget, the same logits and greedy tokens as `--trunk-precision q8_0` resident; the
    trunk file is smaller. A GGUF source and an MXFP4 trunk are refused."""
    source = tiny_hf(family)[1]
    out = tmp_path / "store"
    assert main(["pack", str(source), str(out), "--expert-precision", "int8", "--trunk-precision", "q8_0"]) == 0
    store = FamilyStore(out)
    resident = load_family(source, expert_precision="int8", trunk_precision="q8_0")
    loaded = load_model(out, stream=StreamOptions(ram_budget=_tight_budget(store, 2), io="pread"))
    ids = prompt(8, seed=5)
    assert np.array_equal(loaded.model.logits(ids), resident.logits(ids))
    assert loaded.model.greedy(ids, 4) == resident.greedy(ids, 4)
    loaded.model.experts.close()
    plain = tmp_path / "plain"
    assert main(["pack", str(source), str(plain), "--expert-precision", "int8"]) == 0
    assert store.trunk_path.stat().st_size < 0.6 * FamilyStore(plain).trunk_path.stat().st_size  # 0.25-0.52 (f32)
    assert main(["pack", str(source), str(tmp_path / "mx"), "--trunk-precision", "mxfp4"]) != 0
