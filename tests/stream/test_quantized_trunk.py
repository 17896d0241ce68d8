"""A trunk chosen at pack time (`pack --trunk-precision q8_0|mxfp4`): the store holds the big trunk matrices as Q8_0
/ MXFP4 bytes, the model multiplies them from those bytes, streamed or pinned alike; bf16 stays the lossless
default."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.cli.main import main
from k3serve.default_model import default_model_dir
from k3serve.engine.generate import generate
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import UsageError
from k3serve.loading import load_model
from k3serve.model.weights import build_globals, build_layer
from k3serve.stream.budget import minimum_budget_bytes, plan_budget
from k3serve.stream.options import StreamOptions
from k3serve.weights import names
from k3serve.weights.checkpoint import Checkpoint
from k3serve.weights.held import quantized_in_trunk
from k3serve.weights.pack import pack_checkpoint
from k3serve.weights.quantized import QuantizedMatrix
from k3serve.weights.store import StoreError

PROMPT = [32, 325, 32, 88, 88, 88, 58, 595, 111, 367, 299, 327]  # token ids of the embedded model


def _blob_arrays(store, blob):
    raw = np.frombuffer(store.trunk_path.read_bytes()[blob.offset:blob.offset + blob.read_size], np.uint8)
    return blob.decode(raw, keep_bf16=True)


@pytest.mark.parametrize("precision", ["q8_0", "mxfp4"])
def test_pack_round_trip_holds_the_encoded_bytes(tiny_dir, tmp_path, precision):
    store = pack_checkpoint(tiny_dir, tmp_path / precision, trunk_precision=precision)
    assert store.trunk_precision == precision
    checkpoint = Checkpoint(tiny_dir)
    num_quantized = 0
    for layer, blob in [(None, store.globals)] + list(enumerate(store.layers)):
        arrays = _blob_arrays(store, blob)
        for entry in blob.tensors:
            got = arrays[entry.name]
            if quantized_in_trunk(entry.name, entry.shape):
                num_quantized += 1
                want = QuantizedMatrix.quantize(checkpoint.read(entry.name), precision)
                assert isinstance(got, QuantizedMatrix) and got.precision == precision
                assert got.to_bytes() == want.to_bytes() and entry.nbytes == want.nbytes
            else:
                assert not isinstance(got, QuantizedMatrix)
                np.testing.assert_array_equal(np.asarray(got).view(np.uint8).ravel(),
                                              checkpoint.index.read_raw(entry.name).view(np.uint8).ravel())
        if layer is not None:  # built: quantized matrices stay bytes, and the accounting is what they hold
            built = build_layer(store.config, layer, arrays.__getitem__, "bf16")
            assert isinstance(built.attention.o_proj, QuantizedMatrix)
            assert isinstance(built.attention.in_proj, QuantizedMatrix)  # a fused group, stacked as bytes
            assert built.nbytes <= blob.held_bytes("bf16") and built.nbytes >= 0.9 * blob.held_bytes("bf16")
    assert num_quantized > 3 * store.config.num_layers
    globals_ = build_globals(_blob_arrays(store, store.globals).__getitem__, "bf16")
    assert isinstance(globals_.embed, QuantizedMatrix) and isinstance(globals_.lm_head, QuantizedMatrix)


def test_bf16_stays_the_lossless_default_and_unknown_precisions_are_refused(tiny_store, tmp_path, tiny_dir):
    assert tiny_store.trunk_precision == "bf16"
    assert not any(t.dtype in ("Q8_0", "MXFP4") for b in [tiny_store.globals, *tiny_store.layers] for t in b.tensors)
    with pytest.raises(StoreError, match="trunk precision"):
        pack_checkpoint(tiny_dir, tmp_path / "x", trunk_precision="q4_k")


@pytest.fixture(scope="module")
def default_stores(tmp_path_factory):
    out = tmp_path_factory.mktemp("trunk-precision")
    return {p: pack_checkpoint(default_model_dir(), out / p, trunk_precision=p) for p in ("bf16", "q8_0", "mxfp4")}


def _run(store, budget=None):
    loaded = load_model(store.path, stream=StreamOptions(ram_budget=budget, trunk_dtype="bf16"))
    try:
        tokens = generate(loaded.model, PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))[0]
        logits = loaded.model.logits(PROMPT)
        loaded.model.source.check_integrity()
        return tokens, logits, loaded.model.source.plan
    finally:
        loaded.model.source.close()


def test_q8_0_trunk_greedy_output_is_close_to_bf16(default_stores):
    """The embedded trained model: 16 greedy tokens identical; logits within 10% relative RMS (measured 4.6%) and
    the same argmax at every prompt position. MXFP4 is looser (measured 15%): only its error is bounded."""
    tokens, logits, _ = _run(default_stores["bf16"])
    q8_tokens, q8_logits, _ = _run(default_stores["q8_0"])
    assert q8_tokens == tokens
    rms = lambda a: float(np.sqrt(np.mean((a.astype(np.float64) - logits) ** 2) / np.mean(logits ** 2)))  # noqa
    assert 1e-4 < rms(q8_logits) < 0.1
    assert np.array_equal(q8_logits.argmax(-1), logits.argmax(-1))
    _, mx_logits, _ = _run(default_stores["mxfp4"])
    assert rms(q8_logits) < rms(mx_logits) < 0.3


@pytest.mark.parametrize("precision", ["q8_0", "mxfp4"])
def test_streamed_quantized_trunk_equals_pinned_bit_for_bit(default_stores, precision):
    store = default_stores[precision]
    minimum = minimum_budget_bytes(store, trunk_dtype="bf16")
    tokens, logits, plan = _run(store)
    streamed_tokens, streamed_logits, streamed_plan = _run(store, minimum)
    assert streamed_plan.streamed_layers and not plan.streamed_layers
    assert streamed_tokens == tokens and np.array_equal(streamed_logits, logits)


def test_a_quantized_trunk_is_pinned_whole_where_bf16_streams(default_stores):
    bf16, q8 = default_stores["bf16"], default_stores["q8_0"]
    assert q8.trunk_path.stat().st_size < 0.7 * bf16.trunk_path.stat().st_size
    whole = plan_budget(q8, None, trunk_dtype="bf16")  # unlimited: every layer pinned
    budget = (whole.globals_bytes + sum(b.held_bytes("bf16") for b in q8.layers)
              + q8.config.num_experts_per_token * q8.expert_stride) * 5 // 4  # the whole q8_0 trunk, top-k slots
    # and room for the planner, which pins the largest layers first and keeps buffers for the others meanwhile
    plan = plan_budget(q8, budget, trunk_dtype="bf16")
    assert not plan.streamed_layers and plan.pinned_layers == tuple(range(q8.config.num_layers))
    assert plan_budget(bf16, budget, trunk_dtype="bf16").streamed_layers  # bf16 has to stream at that budget


def test_cli_pack_trunk_precision(tmp_path, capsys):
    out = tmp_path / "store"
    assert main(["pack", str(default_model_dir()), str(out), "--trunk-precision", "q8_0"]) == 0
    assert "trunk q8_0" in capsys.readouterr().err
    assert load_model(out, stream=StreamOptions()).model.source.plan is not None


def test_a_striped_q8_0_store_computes_what_the_plain_one_does(default_stores, tmp_path):
    dirs = [tmp_path / "drive0", tmp_path / "drive1"]
    for folder in dirs:
        folder.mkdir()
    striped = pack_checkpoint(default_model_dir(), tmp_path / "store", stripe_dirs=dirs, trunk_precision="q8_0")
    assert striped.trunk_precision == "q8_0" and striped.num_stripes == 2
    tokens, logits, _ = _run(default_stores["q8_0"])
    striped_tokens, striped_logits, _ = _run(striped)
    assert striped_tokens == tokens and np.array_equal(striped_logits, logits)


def test_a_float32_trunk_dtype_charges_quantized_matrices_their_bytes(default_stores):
    """With --trunk-dtype float32 only the tensors that are not quantized widen; the quantized ones are charged as
    held, so the q8_0 store's float32 floor is far under the bf16 store's."""
    bf16, q8 = default_stores["bf16"], default_stores["q8_0"]
    for blob in q8.layers:
        quantized = sum(t.nbytes for t in blob.tensors if t.dtype == "Q8_0")
        assert quantized > 0 and blob.float32_bytes == quantized + sum(
            4 * int(np.prod(t.shape)) for t in blob.tensors if t.dtype != "Q8_0")
    assert minimum_budget_bytes(q8) < 0.5 * minimum_budget_bytes(bf16)
    tokens, logits, _ = _run(q8)
    loaded = load_model(q8.path, stream=StreamOptions(ram_budget=minimum_budget_bytes(q8), trunk_dtype="float32"))
    try:
        assert np.array_equal(loaded.model.logits(PROMPT), logits)  # the same Q8_0 bytes, the same kernel
    finally:
        loaded.model.source.close()


@pytest.mark.parametrize("precision", ["q8_0", "mxfp4"])
def test_a_checkpoint_quantized_at_load_computes_what_its_quantized_store_does(default_stores, precision):
    """`load_model(folder, trunk_precision=...)` (`generate --trunk-precision`): the resident model holds the same
    bytes the store packed at that precision holds, so logits and greedy tokens are the same bits."""
    loaded = load_model(default_model_dir(), trunk_precision=precision)
    source = loaded.model.source
    held = [source.global_weights().embed, source.global_weights().lm_head,
            *(v for layer in range(loaded.model.config.num_layers)
              for part in (source.layer(layer).attention, source.layer(layer).mlp) for v in vars(part).values())]
    quantized = [m for m in held if isinstance(m, QuantizedMatrix)]
    assert len(quantized) >= 2 + 2 * loaded.model.config.num_layers and all(m.precision == precision
                                                                             for m in quantized)
    tokens, logits, _ = _run(default_stores[precision])
    assert np.array_equal(loaded.model.logits(PROMPT), logits)
    assert generate(loaded.model, PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))[0] == tokens


def test_trunk_precision_is_refused_for_a_packed_store_and_unknown_names(default_stores):
    with pytest.raises(UsageError, match="pack --trunk-precision"):
        load_model(default_stores["bf16"].path, trunk_precision="q8_0")
    with pytest.raises(UsageError, match="q4_k"):
        load_model(default_model_dir(), trunk_precision="q4_k")


def test_a_trunk_quantized_at_load_is_not_placed_in_shared_pages():
    """`share_weights` (serve lending its model to the lab's worker) shares only a trunk as stored; quantized at
    load, the model loads as without it."""
    loaded = load_model(default_model_dir(), share_weights=True, trunk_precision="q8_0")
    assert loaded.shared_weights is None
    assert isinstance(loaded.model.source.global_weights().lm_head, QuantizedMatrix)


def test_cli_trunk_precision_on_logits(tmp_path):
    """`k3serve logits --trunk-precision q8_0` computes what load_model(trunk_precision="q8_0") does."""
    out = tmp_path / "q8.npy"
    ids = ",".join(str(t) for t in PROMPT)
    assert main(["logits", "--ids", ids, "--out", str(out), "--trunk-precision", "q8_0"]) == 0
    want = load_model(default_model_dir(), trunk_precision="q8_0").model.logits(PROMPT)
    assert np.array_equal(np.load(out), want)
    assert not np.array_equal(want, load_model(default_model_dir()).model.logits(PROMPT))
