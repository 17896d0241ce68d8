"""The int8 tiles of the MXFP4 experts at prefill (kernels section "int8 tiles"): 8 or 4 tokens a pass over
a row decoded once, each output the int8 row dot's bits on every instruction set this CPU has for it (AVX-512 VNNI,
AVX2), on odd token counts (tiles of 8, of 4, then single tails), odd group counts (the masked last step), 255-scale
groups and NaN / inf activation blocks; the families' MXFP4 experts on the int8 path; the float path unchanged. The
families' int8 experts on Q8_0 activations: per-row scales (`int8_experts_q8`, opt-in) and a GGUF's Q8_0 block
scales (`q8_0_experts_run`, the default for them), each against its numpy twin, and the switch that picks them."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.model import kernels
from k3serve.model.families.experts import run_experts
from k3serve.model.routing import ExpertPairs
from k3serve.weights.mxfp4 import dequantize_mxfp4

pytestmark = pytest.mark.skipif(not kernels.Q8_ISAS, reason="no instruction set for the int8 path on this CPU")


def _experts(rng: np.random.Generator, num_experts: int, inter: int, latent: int) -> kernels.StackedExperts:
    """Random stacked MXFP4 experts (w1, w3 [E, MI, LT], w2 [E, LT, MI]) with every 7th scale byte 255 (NaN scale,
    read as 0) and bytes 112-121 elsewhere (values of order 2^-10..1)."""
    parts = []
    for rows, cols in ((inter, latent), (inter, latent), (latent, inter)):
        packed = rng.integers(0, 256, size=(num_experts, rows, cols // 2), dtype=np.uint8)
        scales = rng.integers(112, 122, size=(num_experts, rows, cols // 32), dtype=np.uint8)
        scales.reshape(-1)[3::7] = 255
        parts += [packed, scales]
    return tuple(parts)  # type: ignore[return-value]


def _routing(rng: np.random.Generator, counts: list[int], num_tokens: int):
    """Experts 0, 2, 4, ... with `counts` tokens each (any order, repeats allowed)."""
    expert_ids = np.arange(0, 2 * len(counts), 2, dtype=np.int64)
    ends = np.cumsum(counts).astype(np.int64)
    starts = ends - np.asarray(counts, np.int64)
    tokens = rng.integers(0, num_tokens, size=int(ends[-1])).astype(np.int64)
    return expert_ids, tokens, starts, ends


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("isa", kernels.Q8_ISAS)
@pytest.mark.parametrize(("latent", "inter"), [(96, 160), (256, 64), (2080, 96)])
def test_tiles_keep_the_row_dot_bits(isa: str, latent: int, inter: int) -> None:
    """3, 5, 65 groups (1-3 groups in the masked last step) and 4 to 2 + 1 steps; experts of 0 to 21 tokens: tiles
    of 8 and 4 with tails of 1-3, and the chunk boundary (8 tokens) crossed."""
    rng = np.random.default_rng(latent + inter)
    stacked = _experts(rng, 2 * 12, inter, latent)
    counts = [1, 3, 4, 5, 7, 8, 9, 12, 13, 0, 17, 21]
    expert_ids, tokens, starts, ends = _routing(rng, counts, 29)
    z = rng.standard_normal((29, latent)).astype(np.float32)
    code = kernels.ISA_CODES[isa]
    row_dots = kernels._mxfp4_experts_run_q8(stacked, expert_ids, z, tokens, starts, ends, 4.0, 25.0, "situ", code,
                                             tile_tokens=1)
    assert np.all(np.isfinite(row_dots))
    for tile_tokens in (4, 8):
        tiled = kernels._mxfp4_experts_run_q8(stacked, expert_ids, z, tokens, starts, ends, 4.0, 25.0, "situ", code,
                                              tile_tokens=tile_tokens)
        np.testing.assert_array_equal(_bits(tiled), _bits(row_dots))
    # the default (Q8_TILE_TOKENS) through the public entry point, on the same rows
    public = kernels.mxfp4_experts_run(stacked, expert_ids, z, tokens, starts, ends, 4.0, 25.0, isa=isa,
                                       activations="q8")
    np.testing.assert_array_equal(_bits(public), _bits(row_dots))


@pytest.mark.parametrize("isa", kernels.Q8_ISAS)
def test_tiles_equal_their_exact_twin(isa: str) -> None:
    """One matrix of 37 rows (rows in pairs, the last one alone) through the stage-2 tile kernel (tiles of 8, 4, then
    a single token): the row dot's bits, and against its exact twin (Q8_0-quantized activations times the
    dequantized rows in float64) the only error is float32 summation."""
    rng = np.random.default_rng(11)
    rows, cols, num_tokens = 37, 224, 13  # 7 groups: one full step and a 3-group tail
    packed = rng.integers(0, 256, size=(1, rows, cols // 2), dtype=np.uint8)
    scales = rng.integers(118, 128, size=(1, rows, cols // 32), dtype=np.uint8)
    scales.reshape(-1)[::5] = 255
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    xq, corrections, lane_scales = kernels._q8_vnni_prepare(x)
    out = np.full((num_tokens, rows), np.nan, np.float32)  # [T, R]
    one = np.zeros(1, np.int64)
    kernels._experts_q8_tiled_down(packed, scales, one, xq, corrections, lane_scales, one,
                                   np.full(1, num_tokens, np.int64), kernels.ISA_CODES[isa], 8, out)
    row_dots = np.full_like(out, np.nan)  # the row dot's kernel: 37 rows, so the tiles' odd last row is checked too
    kernels._experts_q8_down(packed, scales, one, xq, corrections, lane_scales, one, np.full(1, num_tokens, np.int64),
                             kernels.ISA_CODES[isa], row_dots)
    np.testing.assert_array_equal(_bits(out), _bits(row_dots))
    q, d = kernels.quantize_activations(x)
    x_decoded = (q.reshape(num_tokens, -1, 32).astype(np.float64) * d[:, :, None]).reshape(x.shape)
    twin = x_decoded @ dequantize_mxfp4(packed[0], scales[0]).astype(np.float64).T  # [T, R]
    error = np.sqrt(np.mean((out - twin) ** 2) / np.mean(twin ** 2))
    assert error < 1e-6, error


@pytest.mark.parametrize("isa", kernels.Q8_ISAS)
def test_nan_and_inf_blocks_stay_in_their_tokens(isa: str) -> None:
    """A NaN in one token's activations and an inf in another's make those tokens' outputs NaN (as the float path
    would), in tiles as in the row dot, and leave the tokens that share their tiles finite and unchanged."""
    rng = np.random.default_rng(5)
    latent, inter = 128, 64
    stacked = _experts(rng, 4, inter, latent)
    expert_ids, starts, ends = np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, 13, np.int64)
    tokens = np.arange(13, dtype=np.int64)  # one expert: a tile of 8, one of 4, one single
    z = rng.standard_normal((13, latent)).astype(np.float32)
    clean = kernels.mxfp4_experts_run(stacked, expert_ids, z, tokens, starts, ends, 0.0, 0.0, isa=isa,
                                      activation="silu", activations="q8")
    z[2, 40] = np.nan
    z[9, 100] = np.inf
    code = kernels.ISA_CODES[isa]
    tiled = kernels._mxfp4_experts_run_q8(stacked, expert_ids, z, tokens, starts, ends, 0.0, 0.0, "silu", code)
    row_dots = kernels._mxfp4_experts_run_q8(stacked, expert_ids, z, tokens, starts, ends, 0.0, 0.0, "silu", code,
                                             tile_tokens=1)
    assert np.all(np.isnan(tiled[[2, 9]]))
    others = [n for n in range(13) if n not in (2, 9)]
    np.testing.assert_array_equal(_bits(tiled[others]), _bits(clean[others]))
    np.testing.assert_array_equal(np.isnan(tiled), np.isnan(row_dots))
    np.testing.assert_array_equal(_bits(tiled[others]), _bits(row_dots[others]))


def test_unknown_tile_width_is_refused() -> None:
    rng = np.random.default_rng(1)
    stacked = _experts(rng, 1, 32, 32)
    one = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="tile_tokens"):
        kernels._mxfp4_experts_run_q8(stacked, one, np.ones((2, 32), np.float32), np.zeros(2, np.int64), one,
                                      np.full(1, 2, np.int64), 0.0, 0.0, "silu",
                                      kernels.ISA_CODES[kernels.Q8_ISAS[-1]], tile_tokens=3)
    with pytest.raises(ValueError, match="activations"):
        kernels.mxfp4_experts_tiled(stacked, one, np.ones((2, 32), np.float32), np.zeros(2, np.int64), one,
                                    np.full(1, 2, np.int64), activations="int4")


def test_families_mxfp4_experts_follow_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under K3SERVE_MXFP4_ACTIVATIONS=q8 the families' MXFP4 experts (few and many tokens alike) are the int8
    path's bits in one call; mxfp4_experts_tiled follows the switch too; under f32 (the default) every expert, the
    17-token one too, has the row dot's bits (its 2 x 4 tiles), within float rounding of the numpy twin, and the
    float tile stays within float rounding of the row dot."""
    rng = np.random.default_rng(2)
    latent, inter = 64, 96
    stacked = _experts(rng, 6, inter, latent)
    stacked[1][...] = np.minimum(stacked[1], 127)  # no NaN scales: the float twin below multiplies them
    stacked[3][...] = np.minimum(stacked[3], 127)
    stacked[5][...] = np.minimum(stacked[5], 127)
    counts = [2, 17, 5]
    expert_ids, tokens, starts, ends = _routing(rng, counts, 20)
    z = rng.standard_normal((20, latent)).astype(np.float32)
    pairs = ExpertPairs(expert_ids, starts, ends, tokens, np.arange(tokens.shape[0]))
    int8 = kernels.mxfp4_experts_run(stacked, expert_ids, z, tokens, starts, ends, 0.0, 0.0, activation="silu",
                                     activations="q8")
    monkeypatch.setattr(kernels, "MXFP4_ACTIVATIONS", "q8")
    np.testing.assert_array_equal(_bits(run_experts("mxfp4", stacked, pairs, z)), _bits(int8))
    many = np.array([1])
    tiled_q8 = np.zeros_like(int8)
    kernels.mxfp4_experts_tiled(stacked, expert_ids[many], z, tokens, starts[many], ends[many], out=tiled_q8)
    np.testing.assert_array_equal(_bits(tiled_q8[2:19]), _bits(int8[2:19]))
    monkeypatch.setattr(kernels, "MXFP4_ACTIVATIONS", "f32")
    float_path = run_experts("mxfp4", stacked, pairs, z)
    one_at_a_time = np.concatenate([kernels.mxfp4_experts_run(
        stacked, expert_ids[k:k + 1], z, tokens[n:n + 1], np.zeros(1, np.int64), np.ones(1, np.int64), 0.0, 0.0,
        activation="silu", activations="f32") for k in range(3) for n in range(starts[k], ends[k])])
    np.testing.assert_array_equal(_bits(float_path), _bits(one_at_a_time))
    tiled_f32 = kernels.mxfp4_experts_tiled(stacked, expert_ids[many], z, tokens, starts[many], ends[many],
                                            activations="f32")
    assert np.sqrt(np.mean((tiled_f32[2:19] - float_path[2:19]) ** 2) / np.mean(float_path[2:19] ** 2)) < 1e-5
    w1, w3, w2 = (dequantize_mxfp4(stacked[2 * i][2], stacked[2 * i + 1][2]).astype(np.float64) for i in range(3))
    x = z[tokens[2:19]].astype(np.float64)
    gate, up = x @ w1.T, x @ w3.T
    twin = (gate / (1 + np.exp(-gate)) * up) @ w2.T
    assert np.sqrt(np.mean((float_path[2:19] - twin) ** 2) / np.mean(twin ** 2)) < 1e-5
    assert 1e-4 < np.sqrt(np.mean((int8[2:19] - twin) ** 2) / np.mean(twin ** 2)) < 5e-2


def _assert_nan_stays_in_its_token(run, x: np.ndarray, tokens: np.ndarray, got: np.ndarray, token: int) -> None:
    """A NaN in one block of x[token] makes every output row of that token NaN and leaves the others' bits as
    `got` (run(x) before the NaN)."""
    x = x.copy()
    x[token, 5] = np.nan
    poisoned = run(x)
    hit = tokens == token
    assert np.all(np.isnan(poisoned[hit])) and np.all(np.isfinite(poisoned[~hit]))
    np.testing.assert_array_equal(_bits(poisoned[~hit]), _bits(got[~hit]))


def _int8_experts(rng: np.random.Generator, num_experts: int, inter: int, hidden: int):
    """Per-row int8 experts (gate_up [E, 2I, H], scales [E, 2I]; down [E, H, I], scales [E, H]); one row of -128."""
    gate_up = rng.integers(-127, 128, size=(num_experts, 2 * inter, hidden), dtype=np.int8)
    gate_up[0, 1] = -128
    down = rng.integers(-127, 128, size=(num_experts, hidden, inter), dtype=np.int8)
    gate_up_scales = (0.002 * (1 + rng.random((num_experts, 2 * inter)))).astype(np.float32)
    down_scales = (0.002 * (1 + rng.random((num_experts, hidden)))).astype(np.float32)
    return gate_up, gate_up_scales, down, down_scales


def _through_q8_0(x: np.ndarray) -> np.ndarray:
    q, d = kernels.quantize_activations(np.asarray(x, np.float32))
    return (q.reshape(x.shape[0], -1, 32).astype(np.float64) * d[:, :, None]).reshape(x.shape)


@pytest.mark.parametrize("isa", kernels.Q8_ISAS)
@pytest.mark.parametrize(("hidden", "inter"), [(160, 96), (64, 32)])
def test_int8_experts_on_q8_activations_equal_their_twin(isa: str, hidden: int, inter: int) -> None:
    """H = 160 (AVX-512's last step half full), I = 96; experts of 1, 3, 4, 9, 17 tokens (tiles of 8, 4, 1); a NaN
    activation poisons its token only; against float64 of the same quantized operands the error is float32
    summation's, and the float path's output is near."""
    rng = np.random.default_rng(hidden + inter)
    stacked = _int8_experts(rng, 11, inter, hidden)
    expert_ids, tokens, starts, ends = _routing(rng, [1, 3, 4, 9, 17], 23)
    x = rng.standard_normal((23, hidden)).astype(np.float32)
    got = kernels.int8_experts_q8(*stacked, expert_ids, x, tokens, starts, ends, isa=isa)
    gate_up, gate_up_scales, down, down_scales = (np.asarray(a, np.float64) for a in stacked)
    for k, e in enumerate(expert_ids):
        xs = _through_q8_0(x[tokens[starts[k]:ends[k]]])
        h = xs @ (gate_up[e] * gate_up_scales[e][:, None]).T  # [n, 2I]
        gate, up = h[:, :inter], h[:, inter:]
        hidden_rows = (gate / (1 + np.exp(-gate)) * up).astype(np.float32)
        want = _through_q8_0(hidden_rows) @ (down[e] * down_scales[e][:, None]).T
        block = got[starts[k]:ends[k]]
        # a hidden value on a rounding edge may quantize one step apart from the twin's: a small tolerance
        assert np.sqrt(np.mean((block - want) ** 2) / np.mean(want ** 2)) < 1e-4
    float_path = kernels.dense_experts_run(*stacked, expert_ids, x, tokens, starts, ends)
    assert 1e-4 < np.sqrt(np.mean((got - float_path) ** 2) / np.mean(float_path ** 2)) < 5e-2
    _assert_nan_stays_in_its_token(lambda x: kernels.int8_experts_q8(*stacked, expert_ids, x, tokens, starts, ends,
                                                                     isa=isa), x, tokens, got, tokens[0])


def test_int8_experts_each_token_has_its_own_bits() -> None:
    """A token's output does not depend on the tile it ran in: one expert with 13 tokens against each token alone."""
    rng = np.random.default_rng(3)
    stacked = _int8_experts(rng, 1, 64, 96)
    x = rng.standard_normal((13, 96)).astype(np.float32)
    one = np.zeros(1, np.int64)
    together = kernels.int8_experts_q8(*stacked, one, x, np.arange(13), one, np.full(1, 13, np.int64))
    for n in (0, 7, 8, 12):
        alone = kernels.int8_experts_q8(*stacked, one, x[n:n + 1], one, one, np.ones(1, np.int64))
        np.testing.assert_array_equal(_bits(alone[0]), _bits(together[n]))


def test_int8_switch_in_the_families(monkeypatch: pytest.MonkeyPatch) -> None:
    """K3SERVE_INT8_ACTIVATIONS: "auto" (the default) keeps the families' per-row int8 experts on the float kernels'
    bits and runs block-scaled ones (a GGUF's Q8_0) on Q8_0 activations (`q8_0_experts_run`); "q8" puts both on
    Q8_0 activations; "f32" both on floats. The per-row int8 kernel refuses block scales."""
    rng = np.random.default_rng(4)
    stacked = _int8_experts(rng, 5, 64, 96)
    expert_ids, tokens, starts, ends = _routing(rng, [2, 9, 70], 40)
    pairs = ExpertPairs(expert_ids, starts, ends, tokens, np.arange(tokens.shape[0]))
    x = rng.standard_normal((40, 96)).astype(np.float32)
    gate_up, _, down, _ = stacked
    block_scales = (rng.uniform(5e-3, 2e-2, (5, 128, 3)).astype(np.float32),
                    rng.uniform(5e-3, 2e-2, (5, 96, 2)).astype(np.float32))
    blocked = (gate_up, block_scales[0], down, block_scales[1])
    assert kernels.INT8_ACTIVATIONS == "auto"
    float_path = run_experts("dense", stacked, pairs, x)
    few = np.array([0])
    np.testing.assert_array_equal(_bits(float_path[:2]), _bits(kernels.dense_experts_run(
        *stacked, expert_ids[few], x, tokens, starts[few], ends[few])[:2]))
    q8_blocked = kernels.q8_0_experts_run(*blocked, expert_ids, x, tokens, starts, ends)
    np.testing.assert_array_equal(_bits(run_experts("dense", blocked, pairs, x)), _bits(q8_blocked))
    monkeypatch.setattr(kernels, "INT8_ACTIVATIONS", "q8")
    np.testing.assert_array_equal(_bits(run_experts("dense", stacked, pairs, x)),
                                  _bits(kernels.int8_experts_q8(*stacked, expert_ids, x, tokens, starts, ends)))
    np.testing.assert_array_equal(_bits(run_experts("dense", blocked, pairs, x)), _bits(q8_blocked))
    with pytest.raises(ValueError, match="per-row scales"):
        kernels.int8_experts_q8(*blocked, expert_ids, x, tokens, starts, ends)
    monkeypatch.setattr(kernels, "INT8_ACTIVATIONS", "f32")
    np.testing.assert_array_equal(_bits(run_experts("dense", stacked, pairs, x)), _bits(float_path))
    float_blocked = run_experts("dense", blocked, pairs, x)  # the float row dot (2 tokens), the float tile (9, 70)
    np.testing.assert_array_equal(_bits(float_blocked[:2]), _bits(kernels.dense_experts_run(
        *blocked, expert_ids[few], x, tokens, starts[few], ends[few])[:2]))
    error = np.sqrt(np.mean((q8_blocked - float_blocked) ** 2) / np.mean(float_blocked ** 2))
    assert 1e-4 < error < 5e-2


def _q8_0_experts(rng: np.random.Generator, num_experts: int, inter: int, hidden: int):
    """A GGUF's Q8_0 experts as the families hold them: int8 values and one half-precision scale per 32 values
    (widened to float32), gate_up [E, 2I, H] / [E, 2I, H/32], down [E, H, I] / [E, H, I/32]."""
    gate_up, _, down, _ = _int8_experts(rng, num_experts, inter, hidden)
    gate_up_scales = rng.uniform(5e-3, 2e-2, (num_experts, 2 * inter, hidden // 32)).astype(np.float16)
    down_scales = rng.uniform(5e-3, 2e-2, (num_experts, hidden, inter // 32)).astype(np.float16)
    return gate_up, gate_up_scales.astype(np.float32), down, down_scales.astype(np.float32)


@pytest.mark.parametrize(("isa", "hidden", "inter"), [
    (isa, hidden, inter) for isa in kernels.AVAILABLE_ISAS for hidden, inter in [(96, 64), (64, 160), (288, 320)]
    if isa != "portable" or hidden < 288])  # short rows run dots; 9-10 blocks run tiles (no tiles on portable)
def test_q8_0_experts_equal_their_twin(isa: str, hidden: int, inter: int) -> None:
    """`q8_0_experts_run` on every instruction set against its numpy twin (`q8_0_experts_reference`: the same
    activation quantization, exact products and block sums in float64), on token counts that take whole and
    padded tiles, one dot per token and a skipped expert; a NaN block poisons its own token's rows only."""
    rng = np.random.default_rng(11)
    stacked = _q8_0_experts(rng, 10, inter, hidden)
    expert_ids, tokens, starts, ends = _routing(rng, [1, 0, 13, 4, 23], 30)
    x = rng.standard_normal((30, hidden)).astype(np.float32)
    got = kernels.q8_0_experts_run(*stacked, expert_ids, x, tokens, starts, ends, isa=isa)
    want = kernels.q8_0_experts_reference(*stacked, expert_ids, x, tokens, starts, ends)
    # a hidden value on a rounding edge may quantize one step apart from the twin's: a small tolerance
    assert np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)) < 1e-5
    float_path = kernels.dense_experts_run(*stacked, expert_ids, x, tokens, starts, ends)
    assert 1e-4 < np.sqrt(np.mean((got - float_path) ** 2) / np.mean(float_path ** 2)) < 5e-2
    if isa != "portable":  # AVX2 and AVX-512 run the same float operations on the same exact integers
        best = kernels.q8_0_experts_run(*stacked, expert_ids, x, tokens, starts, ends)
        np.testing.assert_array_equal(_bits(got), _bits(best))
    _assert_nan_stays_in_its_token(lambda x: kernels.q8_0_experts_run(*stacked, expert_ids, x, tokens, starts,
                                                                      ends, isa=isa), x, tokens, got, tokens[2])


def test_q8_0_experts_each_token_has_its_own_bits() -> None:
    """A token's output does not depend on the pass it ran in (a tile of 16 or 8 tokens, whole or padded, the
    activations offset or not, or one dot per token) or the other tokens of its expert: one expert with 24, 19, 13
    and 8 tokens against each token alone (rows of 9 and 10 blocks: tiles, with a tail of 1-2 blocks)."""
    rng = np.random.default_rng(12)
    stacked = _q8_0_experts(rng, 2, 320, 288)
    x = rng.standard_normal((24, 288)).astype(np.float32)
    one = np.ones(1, np.int64)

    def run(count: int) -> np.ndarray:
        return kernels.q8_0_experts_run(*stacked, one, x, np.arange(count), np.zeros(1, np.int64),
                                        np.full(1, count, np.int64))

    together = run(24)  # 16 lanes, then 8
    for count in (19, 13, 8):  # 16 lanes then 3 dots; 16 lanes padded; 8 lanes on the rows as they are
        np.testing.assert_array_equal(_bits(run(count)), _bits(together[:count]))
    for n in (0, 7, 8, 12, 15, 16, 23):
        alone = kernels.q8_0_experts_run(*stacked, one, x[n:n + 1], np.zeros(1, np.int64), np.zeros(1, np.int64),
                                         one)
        np.testing.assert_array_equal(_bits(alone[0]), _bits(together[n]))


@pytest.mark.parametrize("isa", kernels.AVAILABLE_ISAS)
def test_q8_0_experts_take_half_scales_with_the_float32_bits(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The families hold a GGUF's Q8_0 block scales as the file does (float16, 2 bytes a block): the Q8_0 path
    widens them in the kernel and the float path (`K3SERVE_INT8_ACTIVATIONS=f32`) an expert at a time, each with
    the bits of the same scales widened to float32 beforehand."""
    rng = np.random.default_rng(14)
    hidden, inter = (96, 64) if isa == "portable" else (288, 320)  # rows of 9-10 blocks run tiles (no tiles on
    gate_up, gate_up_scales, down, down_scales = _q8_0_experts(rng, 12, inter, hidden)  # portable: short, faster)
    half = (gate_up, gate_up_scales.astype(np.float16), down, down_scales.astype(np.float16))
    wide = (gate_up, gate_up_scales, down, down_scales)
    expert_ids, tokens, starts, ends = _routing(rng, [1, 0, 9, 4, 2, 5], 12)
    x = rng.standard_normal((12, hidden)).astype(np.float32)
    np.testing.assert_array_equal(
        _bits(kernels.q8_0_experts_run(*half, expert_ids, x, tokens, starts, ends, isa=isa)),
        _bits(kernels.q8_0_experts_run(*wide, expert_ids, x, tokens, starts, ends, isa=isa)))
    pairs = ExpertPairs(expert_ids, starts, ends, tokens, np.arange(tokens.shape[0]))
    monkeypatch.setattr(kernels, "INT8_ACTIVATIONS", "f32")  # the float row dot (1, 2 tokens) and tile (4-9)
    np.testing.assert_array_equal(_bits(run_experts("dense", half, pairs, x)),
                                  _bits(run_experts("dense", wide, pairs, x)))


def test_q8_0_experts_refuse_other_shapes() -> None:
    rng = np.random.default_rng(13)
    gate_up, gate_up_scales, down, down_scales = _q8_0_experts(rng, 2, 64, 96)
    ids, x = np.zeros(1, np.int64), np.zeros((1, 96), np.float32)
    args = (ids, x, np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64))
    with pytest.raises(ValueError, match="block scales"):
        kernels.q8_0_experts_run(gate_up, gate_up_scales[:, :, :1], down, down_scales, *args)  # per row
    with pytest.raises(ValueError, match="block scales"):
        kernels.q8_0_experts_run(gate_up.astype(np.float32), gate_up_scales, down, down_scales, *args)
    assert not kernels.q8_0_experts_on(gate_up, gate_up_scales[:, :, :1], down)
