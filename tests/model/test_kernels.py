"""The fused MXFP4 matmul against its dequantize-then-multiply twin, on odd shapes, with NaN-scale groups."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from k3serve.model import kernels
from k3serve.model.kernels import mxfp4_matmul, mxfp4_matmul_reference, warmup


def _random_mxfp4(
    rng: np.random.Generator, rows: int, cols: int, num_nan_scales: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    packed = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)  # [R, C/2]
    scales = rng.integers(118, 125, size=(rows, cols // 32), dtype=np.uint8)  # [R, G]
    flat = scales.reshape(-1)
    flat[rng.choice(flat.size, size=min(num_nan_scales, flat.size), replace=False)] = 255
    return packed, scales


def _relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    squared_error = np.mean((got.astype(np.float64) - want) ** 2)
    return float(np.sqrt(squared_error / max(np.mean(want.astype(np.float64) ** 2), 1e-300)))


@pytest.mark.parametrize("num_tokens", [1, 3, 15])
@pytest.mark.parametrize("rows", [1, 13, 37])
@pytest.mark.parametrize("cols", [32, 64, 96])
def test_fused_matches_reference(num_tokens: int, rows: int, cols: int) -> None:
    rng = np.random.default_rng(1000 * num_tokens + 10 * rows + cols)
    packed, scales = _random_mxfp4(rng, rows, cols, num_nan_scales=max(1, rows // 5))
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    got = mxfp4_matmul(packed, scales, x)
    want = mxfp4_matmul_reference(packed, scales, x)
    assert got.shape == (num_tokens, rows) and got.dtype == np.float32
    error = _relative_rms(got, want)
    assert error < 1e-5, f"T={num_tokens} R={rows} C={cols}: relative RMS error {error:.3e}"


def test_full_width_expert_rows() -> None:
    rng = np.random.default_rng(7)
    packed, scales = _random_mxfp4(rng, 19, 3584, num_nan_scales=5)
    x = rng.standard_normal((2, 3584)).astype(np.float32)
    error = _relative_rms(mxfp4_matmul(packed, scales, x), mxfp4_matmul_reference(packed, scales, x))
    assert error < 1e-5, f"relative RMS error {error:.3e}"


def test_exact_when_every_product_and_sum_is_exact() -> None:
    # Small integer inputs and scale byte 128 (x2): every partial sum is an exact float32, so any summation
    # order gives the same bits; a wrong nibble, position or scale shows up as an exact mismatch.
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, size=(11, 48), dtype=np.uint8)  # [11, 96]
    scales = np.full((11, 3), 128, dtype=np.uint8)
    scales[4, 2] = 255
    x = rng.integers(-8, 9, size=(5, 96)).astype(np.float32)
    assert np.array_equal(mxfp4_matmul(packed, scales, x), mxfp4_matmul_reference(packed, scales, x))


def test_scale_255_group_contributes_nothing() -> None:
    packed = np.full((2, 32), 0x77, dtype=np.uint8)  # every element +6
    scales = np.array([[127, 255], [127, 127]], dtype=np.uint8)
    x = np.zeros((1, 64), dtype=np.float32)
    x[0, 32:] = 1.0  # only the second group of inputs is non-zero
    assert mxfp4_matmul(packed, scales, x).tolist() == [[0.0, 192.0]]


@pytest.mark.parametrize("isa", kernels.AVAILABLE_ISAS)
def test_batch_and_thread_count_do_not_change_bits(isa: str) -> None:
    """11 tokens (two 2-row x 4-token passes and 3 left; 29 rows: 14 pairs and one alone) give each token the bits
    it gets alone, on each instruction set."""
    rng = np.random.default_rng(4)
    packed, scales = _random_mxfp4(rng, 29, 256, num_nan_scales=3)
    x = rng.standard_normal((11, 256)).astype(np.float32)
    batched = mxfp4_matmul(packed, scales, x, isa=isa)
    for token in range(11):
        alone = mxfp4_matmul(packed, scales, x[token : token + 1], isa=isa)
        assert np.array_equal(alone[0], batched[token]), f"token {token} differs alone vs batched"
    if isa != kernels.AVAILABLE_ISAS[-1]:
        return
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        single_thread = mxfp4_matmul(packed, scales, x)
    finally:
        numba.set_num_threads(previous)
    assert np.array_equal(single_thread, batched)


@pytest.mark.parametrize(("rows", "cols"), [(37, 3584), (5, 96)])
@pytest.mark.parametrize("isa", kernels.AVAILABLE_ISAS)
def test_serial_and_parallel_paths_give_the_same_bits(rows: int, cols: int, isa: str) -> None:
    rng = np.random.default_rng(rows)
    packed, scales = _random_mxfp4(rng, rows, cols, num_nan_scales=2)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    xp = np.empty_like(x)
    kernels.permute_groups(x, xp)
    outputs = []
    for kernel in (kernels._matmul_serial, kernels._matmul_parallel):
        out = np.empty((3, rows), dtype=np.float32)
        kernel(packed, scales, xp, kernels._HALF_SCALES, kernels.ISA_CODES[isa], out)
        outputs.append(out)
    assert np.array_equal(outputs[0], outputs[1])
    assert np.array_equal(outputs[0], mxfp4_matmul(packed, scales, x, isa=isa))


@pytest.mark.parametrize("isa", kernels.AVAILABLE_ISAS)
@pytest.mark.parametrize(("rows", "cols", "num_tokens"), [(1, 32, 1), (37, 96, 3), (64, 2048, 2)])
def test_every_instruction_set_matches_reference(isa: str, rows: int, cols: int, num_tokens: int) -> None:
    """The AVX-512, AVX2 and portable row dots (whichever this CPU has) against the numpy twin, NaN scales too."""
    rng = np.random.default_rng(rows * cols + num_tokens)
    packed, scales = _random_mxfp4(rng, rows, cols, num_nan_scales=max(1, rows // 7))
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    got = mxfp4_matmul(packed, scales, x, isa=isa)
    error = _relative_rms(got, mxfp4_matmul_reference(packed, scales, x))
    assert error < 1e-5, f"{isa}: relative RMS error {error:.3e}"
    exact_packed = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    exact_scales = np.full((rows, cols // 32), 128, dtype=np.uint8)
    exact_x = rng.integers(-8, 9, size=(num_tokens, cols)).astype(np.float32)
    assert np.array_equal(mxfp4_matmul(exact_packed, exact_scales, exact_x, isa=isa),
                          mxfp4_matmul_reference(exact_packed, exact_scales, exact_x))


def test_permute_groups_puts_even_then_odd() -> None:
    x = np.arange(64, dtype=np.float32)[None]  # [1, 64]
    out = np.empty_like(x)
    kernels.permute_groups(x, out)
    expected = np.concatenate([np.r_[0:32:2, 1:32:2], np.r_[32:64:2, 33:64:2]]).astype(np.float32)
    assert np.array_equal(out[0], expected)


def test_unknown_instruction_set_is_refused() -> None:
    packed, scales = _random_mxfp4(np.random.default_rng(0), 2, 32)
    with pytest.raises(ValueError, match="not available"):
        mxfp4_matmul(packed, scales, np.ones((1, 32), np.float32), isa="neon")


def test_zero_tokens_and_non_contiguous_input() -> None:
    rng = np.random.default_rng(5)
    packed, scales = _random_mxfp4(rng, 9, 64)
    empty = mxfp4_matmul(packed, scales, np.zeros((0, 64), dtype=np.float32))
    assert empty.shape == (0, 9) and empty.dtype == np.float32
    wide = rng.standard_normal((4, 128)).astype(np.float32)
    strided = wide[:, ::2]  # [4, 64], not contiguous
    assert np.array_equal(mxfp4_matmul(packed, scales, strided), mxfp4_matmul(packed, scales, strided.copy()))
    as_float64 = strided.astype(np.float64)
    assert np.array_equal(mxfp4_matmul(packed, scales, as_float64), mxfp4_matmul(packed, scales, strided.copy()))


def test_out_argument_and_shape_errors() -> None:
    rng = np.random.default_rng(6)
    packed, scales = _random_mxfp4(rng, 5, 32)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    out = np.full((2, 5), np.nan, dtype=np.float32)
    returned = mxfp4_matmul(packed, scales, x, out=out)
    assert returned is out and np.array_equal(out, mxfp4_matmul(packed, scales, x))
    with pytest.raises(ValueError, match=r"\[T, 32\]"):
        mxfp4_matmul(packed, scales, np.zeros((2, 64), dtype=np.float32))
    with pytest.raises(ValueError, match="scales"):
        mxfp4_matmul(packed, scales[:, :0], x)
    with pytest.raises(ValueError, match="out must be"):
        mxfp4_matmul(packed, scales, x, out=np.zeros((5, 2), dtype=np.float32))


def test_warmup_runs() -> None:
    warmup()  # compiles or loads from cache; a later call must still be correct
    packed = np.full((1, 16), 0x22, dtype=np.uint8)  # every element 1.0
    assert mxfp4_matmul(packed, np.array([[127]], dtype=np.uint8), np.ones((1, 32), dtype=np.float32))[0, 0] == 32.0


def test_warmup_without_dense_experts_leaves_their_kernels_alone(monkeypatch) -> None:
    """K3's loader warms without the families' bf16 / int8 / float32 expert kernels (most of a cold compile)."""
    import k3serve.model.kernels as kernels

    called: list[str] = []
    for name in ("_dense_experts_serial", "_dense_experts_parallel", "_tiled_experts_parallel"):
        monkeypatch.setattr(kernels, name, lambda *args, name=name: called.append(name))
    kernels.warmup(dense_experts=False)
    assert called == []
    kernels.warmup()
    assert sorted(set(called)) == ["_dense_experts_parallel", "_dense_experts_serial", "_tiled_experts_parallel"]


@pytest.mark.parametrize("latent,inter,tokens", [(64, 96, 1), (128, 128, 5), (512, 384, 3)])
def test_fused_expert_forward_matches_numpy_twin(latent, inter, tokens):
    """The one-call expert (small shapes) and the three-call path (large shapes) both equal the numpy form."""
    from k3serve.model.kernels import PARALLEL_MIN_WEIGHTS, mxfp4_expert_forward
    from k3serve.model.ops import situ_glu
    from k3serve.weights.mxfp4 import quantize_mxfp4

    rng = np.random.default_rng(latent + inter)
    w1 = quantize_mxfp4((4 * rng.normal(size=(inter, latent)) / np.sqrt(latent)).astype(np.float32))
    w3 = quantize_mxfp4((30 * rng.normal(size=(inter, latent)) / np.sqrt(latent)).astype(np.float32))
    w2 = quantize_mxfp4((rng.normal(size=(latent, inter)) / np.sqrt(inter)).astype(np.float32))
    z = rng.normal(size=(tokens, latent)).astype(np.float32)
    hidden = situ_glu(mxfp4_matmul_reference(*w1, z), mxfp4_matmul_reference(*w3, z), 4.0, 25.0)
    expected = mxfp4_matmul_reference(*w2, hidden)
    for isa in kernels.AVAILABLE_ISAS:
        got = mxfp4_expert_forward(w1, w3, w2, z, 4.0, 25.0, isa=isa)
        error = float(np.sqrt(np.mean((got - expected) ** 2) / np.mean(expected ** 2)))
        assert error < 1e-5, f"{isa}: relative RMS {error:.2e} (parallel: {inter * latent >= PARALLEL_MIN_WEIGHTS})"
        # a token's result does not depend on the other tokens in the call
        np.testing.assert_array_equal(mxfp4_expert_forward(w1, w3, w2, z[:1], 4.0, 25.0, isa=isa), got[:1])


def test_experts_spread_over_cores_give_the_same_bits_as_one_by_one():
    from k3serve.model.kernels import mxfp4_expert_accumulate, mxfp4_experts_accumulate
    from k3serve.weights.mxfp4 import quantize_mxfp4

    rng = np.random.default_rng(9)
    latent, inter, tokens_total = 64, 96, 7
    experts = []
    for _ in range(5):
        w1, w3 = (quantize_mxfp4(rng.normal(size=(inter, latent)).astype(np.float32)) for _ in range(2))
        experts.append((w1, w3, quantize_mxfp4(rng.normal(size=(latent, inter)).astype(np.float32))))
    z = rng.normal(size=(tokens_total, latent)).astype(np.float32)
    groups = [np.array(sorted(rng.choice(tokens_total, size=int(n), replace=False))) for n in (1, 3, 7, 2, 4)]
    tokens = np.concatenate(groups).astype(np.int64)
    ends = np.cumsum([len(g) for g in groups]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    weights = rng.uniform(size=len(tokens)).astype(np.float32)
    one_by_one = np.zeros((tokens_total, latent), np.float32)
    for (w1, w3, w2), start, end in zip(experts, starts, ends):
        mxfp4_expert_accumulate(w1, w3, w2, z, tokens[start:end], weights[start:end], 4.0, 25.0, one_by_one)
    together = np.zeros_like(one_by_one)
    mxfp4_experts_accumulate(experts, z, tokens, starts, ends, weights, 4.0, 25.0, together)
    np.testing.assert_array_equal(together, one_by_one)


@pytest.mark.parametrize("latent,inter", [(64, 96), (512, 384)])
def test_stacked_layer_call_matches_numpy_twin_and_threads(latent, inter):
    """One call for a layer's active experts (serial and parallel sizes) equals the numpy form per (token,
    expert), gives the same bits as one call per expert, and does not depend on the thread count."""
    from k3serve.model.kernels import mxfp4_experts_accumulate_stacked, mxfp4_experts_run, stack_expert
    from k3serve.model.ops import situ_glu
    from k3serve.weights.mxfp4 import quantize_mxfp4

    rng = np.random.default_rng(latent)
    num_experts, num_tokens = 6, 5
    mats = [[quantize_mxfp4((s * rng.normal(size=shape)).astype(np.float32)) for s, shape in
             ((2.0, (inter, latent)), (20.0, (inter, latent)), (0.1, (latent, inter)))] for _ in range(num_experts)]
    stacked = tuple(np.stack([m[i][part] for m in mats]) for i in range(3) for part in range(2))
    expert_ids = np.array([1, 4, 5], np.int64)
    groups = [np.array([0, 2, 3]), np.array([1]), np.array([0, 1, 2, 3, 4])]
    tokens = np.concatenate(groups).astype(np.int64)
    ends = np.cumsum([len(g) for g in groups]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    z = rng.normal(size=(num_tokens, latent)).astype(np.float32)
    weights = rng.uniform(size=len(tokens)).astype(np.float32)
    got = mxfp4_experts_run(stacked, expert_ids, z, tokens, starts, ends, 4.0, 25.0)
    for k, e in enumerate(expert_ids):
        w1, w3, w2 = mats[e]
        zk = z[tokens[starts[k]:ends[k]]]
        want = mxfp4_matmul_reference(*w2, situ_glu(mxfp4_matmul_reference(*w1, zk),
                                                    mxfp4_matmul_reference(*w3, zk), 4.0, 25.0))
        assert _relative_rms(got[starts[k]:ends[k]], want) < 1e-5
    together = np.zeros((num_tokens, latent), np.float32)
    mxfp4_experts_accumulate_stacked(stacked, expert_ids, z, tokens, starts, ends, weights, 4.0, 25.0, together)
    one_by_one = np.zeros_like(together)
    for k, e in enumerate(expert_ids):
        mxfp4_experts_accumulate_stacked(stack_expert(*mats[e]), np.zeros(1, np.int64), z, tokens[starts[k]:ends[k]],
                                         np.zeros(1, np.int64), np.array([ends[k] - starts[k]]),
                                         weights[starts[k]:ends[k]], 4.0, 25.0, one_by_one)
    np.testing.assert_array_equal(together, one_by_one)
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        single_thread = mxfp4_experts_run(stacked, expert_ids, z, tokens, starts, ends, 4.0, 25.0)
    finally:
        numba.set_num_threads(previous)
    np.testing.assert_array_equal(single_thread, got)


def _dense_expert_args(dtype, rng: np.random.Generator, hidden: int, inner: int) -> tuple:
    """(gate_up [2I, H], its scales or None, down [H, I], its scales or None) stored as `dtype`."""
    gate_up = rng.standard_normal((2 * inner, hidden)).astype(np.float32)
    down = rng.standard_normal((hidden, inner)).astype(np.float32)
    if dtype == np.uint16:
        return (gate_up.view(np.uint32) >> 16).astype(np.uint16), None, (down.view(np.uint32) >> 16).astype(
            np.uint16), None
    if dtype == np.float32:
        return gate_up, None, down, None
    return (np.clip(np.rint(gate_up * 40), -127, 127).astype(np.int8), rng.uniform(0.01, 0.03, 2 * inner).astype(
        np.float32), np.clip(np.rint(down * 40), -127, 127).astype(np.int8),
        rng.uniform(0.01, 0.03, hidden).astype(np.float32))


@pytest.mark.parametrize("dtype", [np.uint16, np.int8, np.float32])
@pytest.mark.parametrize(("hidden", "inner", "tokens"), [(48, 40, 3), (37, 21, 1), (512, 384, 2)])
def test_dense_expert_matches_numpy_twin(dtype, hidden, inner, tokens):
    """bf16 bits, int8 and float32 experts (odd widths exercise the scalar tail; 512x384 the parallel path)."""
    from k3serve.model.kernels import dense_expert_forward, dense_expert_reference

    args = _dense_expert_args(dtype, np.random.default_rng(hidden + inner), hidden, inner)
    x = np.random.default_rng(tokens).standard_normal((tokens, hidden)).astype(np.float32)
    got = dense_expert_forward(*args, x)
    assert _relative_rms(got, dense_expert_reference(*args, x)) < 1e-5
    np.testing.assert_array_equal(dense_expert_forward(*args, x[:1]), got[:1])


@pytest.mark.parametrize(("dtype", "hidden", "inner"), [(d, h, i) for d in (np.uint16, np.int8, np.float32)
                                                        for h, i in ((40, 24), (512, 256))]
                         + [("q8_0", 64, 32), ("q8_0", 512, 256)])
def test_dense_stacked_layer_call_matches_twin_one_by_one_and_threads(dtype, hidden, inner):
    """A layer's active dense experts in one call over the stack (serial and parallel sizes): each (token, expert)
    row equals the numpy twin, the same bits as one call per expert, whatever the thread count."""
    from k3serve.model.kernels import dense_expert_forward, dense_expert_reference, dense_experts_run

    rng = np.random.default_rng(hidden + inner)
    experts = [_q8_0_expert_args(rng, hidden, inner) if dtype == "q8_0" else _dense_expert_args(dtype, rng, hidden,
                                                                                                inner)
               for _ in range(5)]
    stacked = tuple(None if experts[0][i] is None else np.stack([e[i] for e in experts]) for i in range(4))
    expert_ids = np.array([0, 2, 4], np.int64)
    groups = [np.array([1, 3]), np.array([0, 1, 2, 3]), np.array([2])]
    tokens = np.concatenate(groups).astype(np.int64)
    ends = np.cumsum([len(g) for g in groups]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    x = rng.standard_normal((4, hidden)).astype(np.float32)
    got = dense_experts_run(*stacked, expert_ids, x, tokens, starts, ends)
    for k, e in enumerate(expert_ids):
        rows = x[tokens[starts[k]:ends[k]]]
        assert _relative_rms(got[starts[k]:ends[k]], dense_expert_reference(*experts[e], rows)) < 1e-5
        np.testing.assert_array_equal(got[starts[k]:ends[k]], dense_expert_forward(*experts[e], rows))
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        np.testing.assert_array_equal(dense_experts_run(*stacked, expert_ids, x, tokens, starts, ends), got)
    finally:
        numba.set_num_threads(previous)
    with pytest.raises(ValueError, match="do not fit"):
        dense_experts_run(*stacked, expert_ids, x[:, 1:], tokens, starts, ends)


def _q8_0_expert_args(rng: np.random.Generator, hidden: int, inner: int) -> tuple:
    """(gate_up i8 [2I, H], scales [2I, H/32], down i8 [H, I], scales [H, I/32]): GGUF's Q8_0 blocks of 32."""
    def blocks(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
        return (rng.integers(-127, 128, (rows, cols)).astype(np.int8),
                rng.uniform(0.0005, 0.0015, (rows, cols // 32)).astype(np.float32))

    return (*blocks(2 * inner, hidden), *blocks(hidden, inner))


@pytest.mark.parametrize(("hidden", "inner", "tokens"), [(64, 96, 3), (96, 64, 1), (512, 384, 2)])
def test_q8_0_block_scaled_expert_matches_numpy_twin_and_float32(hidden, inner, tokens):
    """int8 values with one scale per 32-value block: the kernel equals its numpy twin (to summation order) and, bit
    for bit, the float32 kernel on the dequantized values (rows of two blocks or more: a row of one block is a
    per-row scale, applied to the dot); each row's bits do not depend on the other rows."""
    from k3serve.model.kernels import dense_expert_forward, dense_expert_reference

    args = _q8_0_expert_args(np.random.default_rng(hidden + inner), hidden, inner)
    x = np.random.default_rng(tokens).standard_normal((tokens, hidden)).astype(np.float32)
    got = dense_expert_forward(*args, x)
    assert _relative_rms(got, dense_expert_reference(*args, x)) < 1e-5
    gate_up, gate_up_scales, down, down_scales = args
    dequantized = [(w.astype(np.float32).reshape(w.shape[0], -1, 32) * s[:, :, None]).reshape(w.shape)
                   for w, s in ((gate_up, gate_up_scales), (down, down_scales))]
    np.testing.assert_array_equal(got, dense_expert_forward(dequantized[0], None, dequantized[1], None, x))
    np.testing.assert_array_equal(dense_expert_forward(*args, x[:1]), got[:1])
    # one scale per block is not one scale per row: the same values with their first block's scales differ
    first = tuple(a if i % 2 == 0 else np.ascontiguousarray(a[:, :1]) for i, a in enumerate(args))
    assert _relative_rms(dense_expert_forward(*first, x), got) > 1e-2


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_linear_on_bf16_bits_matches_float32(tokens):
    """A trunk matrix kept as bf16 bits gives the float32 product (kernel below 32 tokens, BLAS above)."""
    from k3serve.model.kernels import linear
    from k3serve.model.weights import keep_bf16

    rng = np.random.default_rng(tokens)
    w = rng.standard_normal((300, 129)).astype(np.float32)
    w_bf16 = ((w.view(np.uint32) + np.uint32(0x8000)) & np.uint32(0xFFFF0000)).view(np.float32)
    bits = keep_bf16(w_bf16)
    assert bits.dtype == np.uint16 and keep_bf16(w).dtype == np.float32  # only exact bf16 values are kept so
    x = rng.standard_normal((tokens, 129)).astype(np.float32)
    assert _relative_rms(linear(x, bits), x @ w_bf16.T) < 1e-6
    np.testing.assert_array_equal(linear(x, w), x @ w.T)


@pytest.mark.parametrize(("rows", "cols", "tokens"), [(301, 131, 4), (301, 131, 7), (67, 2048, 9), (1200, 160, 5),
                                                   (1200, 160, 1)])
@pytest.mark.parametrize("parallel", [False, True])
def test_linear_bf16_token_tiles_keep_the_row_dot_bits(rows, cols, tokens, parallel, monkeypatch):
    """From 4 tokens the bf16 kernel runs 2-row x 4-token tiles (decode batches, short prefills): each output has
    the bits of the one-token row dot, whatever T, on odd row counts and a scalar tail (131 columns), on the calling
    thread and over the threads (1200 x 160 runs over several 64-row tasks), and matches the float32 product."""
    from k3serve.model import kernels
    from k3serve.model.kernels import BF16_KERNEL_MAX_TOKENS, linear, widen_bf16

    assert tokens < BF16_KERNEL_MAX_TOKENS
    monkeypatch.setattr(kernels, "BF16_PARALLEL_MIN_WEIGHTS", 1 if parallel else 1 << 40)
    rng = np.random.default_rng(rows + tokens)
    bits = (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    got = linear(x, bits)
    one_by_one = np.concatenate([linear(x[t:t + 1], bits) for t in range(tokens)])
    np.testing.assert_array_equal(got, one_by_one)
    other = np.empty_like(got)  # the other path's bits
    (kernels._bf16_matmul_serial if parallel else kernels._bf16_matmul_parallel)(bits, x, other)
    np.testing.assert_array_equal(got, other)
    assert _relative_rms(got, x @ widen_bf16(bits).T) < 1e-6


def test_linear_bf16_runs_small_matrices_on_the_calling_thread(monkeypatch):
    """The widened K3's trunk matrices (at most 2048 x 128 weights) run serially; full-K3 sizes split."""
    from k3serve.model import kernels

    calls = []
    monkeypatch.setattr(kernels, "_bf16_matmul_serial", lambda w, x, out: calls.append(("serial", w.size)))
    monkeypatch.setattr(kernels, "_bf16_matmul_parallel", lambda w, x, out: calls.append(("parallel", w.size)))
    x = np.ones((1, 128), np.float32)
    kernels.linear(x, np.zeros((2048, 128), np.uint16))
    kernels.linear(x, np.zeros((kernels.BF16_PARALLEL_MIN_WEIGHTS // 128, 128), np.uint16))
    assert calls == [("serial", 2048 * 128), ("parallel", kernels.BF16_PARALLEL_MIN_WEIGHTS)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int8, np.float32, "q8_0"])
@pytest.mark.parametrize("tokens", [4, 6, 9])
def test_dense_expert_token_tiles_keep_the_row_dot_bits(dtype, tokens):
    """An expert with 4-7 tokens (a decode batch, a short prefill) runs the gate/up and down rows in 4-token tiles:
    every token's output has the bits of that token alone through the row dot, and matches the numpy twin."""
    from k3serve.model.kernels import dense_expert_forward, dense_expert_reference

    rng = np.random.default_rng(tokens)
    args = _q8_0_expert_args(rng, 64, 96) if dtype == "q8_0" else _dense_expert_args(dtype, rng, 67, 45)
    x = rng.standard_normal((tokens, args[0].shape[1])).astype(np.float32)
    got = dense_expert_forward(*args, x)
    np.testing.assert_array_equal(got, np.concatenate([dense_expert_forward(*args, x[t:t + 1])
                                                       for t in range(tokens)]))
    assert _relative_rms(got, dense_expert_reference(*args, x)) < 1e-5


@pytest.mark.parametrize(("dtype", "hidden", "inner"), [(np.uint16, 37, 21), (np.int8, 40, 24),
                                                         (np.float32, 37, 21), ("q8_0", 64, 96),
                                                         (np.uint16, 512, 256)])
def test_dense_tiled_experts_match_numpy_twin_on_odd_group_sizes(dtype, hidden, inner):
    """The prefill tile kernel (rows widened once, tokens four at a time): every (token, expert) row within float32
    rounding of the numpy twin, for groups of 1, 3, 4, 15 and 63 tokens (tails of the four-token tile), odd row
    counts, and the same bits as one call per expert and as one thread."""
    from k3serve.model.kernels import dense_expert_reference, dense_experts_tiled

    rng = np.random.default_rng(hidden + inner)
    experts = [_q8_0_expert_args(rng, hidden, inner) if dtype == "q8_0" else _dense_expert_args(dtype, rng, hidden,
                                                                                                inner)
               for _ in range(6)]
    stacked = tuple(None if experts[0][i] is None else np.stack([e[i] for e in experts]) for i in range(4))
    sizes = [1, 3, 4, 15, 63]
    expert_ids = np.array([5, 0, 2, 3, 1], np.int64)
    x = rng.standard_normal((70, hidden)).astype(np.float32)
    tokens = np.concatenate([rng.choice(70, size=n, replace=False) for n in sizes]).astype(np.int64)
    ends = np.cumsum(sizes).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    got = dense_experts_tiled(*stacked, expert_ids, x, tokens, starts, ends)
    for k, e in enumerate(expert_ids):
        rows = x[tokens[starts[k]:ends[k]]]
        assert _relative_rms(got[starts[k]:ends[k]], dense_expert_reference(*experts[e], rows)) < 1e-5, sizes[k]
        alone = dense_experts_tiled(*stacked, expert_ids[k:k + 1], x, tokens[starts[k]:ends[k]], np.zeros(1, np.int64),
                                    np.full(1, sizes[k], np.int64))
        np.testing.assert_array_equal(got[starts[k]:ends[k]], alone)
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        np.testing.assert_array_equal(dense_experts_tiled(*stacked, expert_ids, x, tokens, starts, ends), got)
    finally:
        numba.set_num_threads(previous)
    with pytest.raises(ValueError, match="do not fit"):
        dense_experts_tiled(*stacked, expert_ids, x[:, 1:], tokens, starts, ends)


@pytest.mark.parametrize(("hidden", "inner"), [(64, 96), (512, 256)])
def test_mxfp4_tiled_experts_match_numpy_twin_on_odd_group_sizes(hidden, inner):
    """The MXFP4 prefill tile kernel (rows decoded once, tokens four at a time): each (token, expert) row within
    float32 rounding of the numpy twin on the dequantized matrices, for groups of 1, 3, 4, 17 and 63 tokens;
    `out` is filled on the given experts' rows only, and one thread gives the same bits."""
    from k3serve.model.kernels import dense_expert_reference, mxfp4_experts_tiled
    from k3serve.weights.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    rng = np.random.default_rng(hidden)
    experts = [[quantize_mxfp4(rng.standard_normal(shape).astype(np.float32) * np.float32(0.1))
                for shape in ((inner, hidden), (inner, hidden), (hidden, inner))] for _ in range(5)]
    stacked = tuple(np.stack([e[m][i] for e in experts]) for m in range(3) for i in range(2))
    sizes = [1, 3, 4, 17, 63]
    expert_ids = np.array([4, 0, 2, 3, 1], np.int64)
    x = rng.standard_normal((70, hidden)).astype(np.float32)
    tokens = np.concatenate([rng.choice(70, size=n, replace=False) for n in sizes]).astype(np.int64)
    ends = np.cumsum(sizes).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    got = mxfp4_experts_tiled(stacked, expert_ids, x, tokens, starts, ends)
    for k, e in enumerate(expert_ids):
        gate, up, down = (dequantize_mxfp4(*m) for m in experts[e])
        want = dense_expert_reference(np.concatenate([gate, up]), None, down, None, x[tokens[starts[k]:ends[k]]])
        assert _relative_rms(got[starts[k]:ends[k]], want) < 1e-5, sizes[k]
    marked = np.full_like(got, 7.0)
    mxfp4_experts_tiled(stacked, expert_ids[3:], x, tokens, starts[3:], ends[3:], out=marked)
    assert np.all(marked[:starts[3]] == 7.0)
    np.testing.assert_array_equal(marked[starts[3]:], got[starts[3]:])
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        np.testing.assert_array_equal(mxfp4_experts_tiled(stacked, expert_ids, x, tokens, starts, ends), got)
    finally:
        numba.set_num_threads(previous)


@pytest.mark.parametrize("isa", [i for i in ("avx512", "avx2") if i in kernels.AVAILABLE_ISAS])
def test_mxfp4_row_widening_is_exact_on_every_instruction_set(isa):
    """The prefill tile's row decode (register lookups, nibbles interleaved back into natural order) gives the
    dequantized row bit for bit, a NaN-scale group included, on each vector instruction set the host has."""
    from numba import njit

    from k3serve.weights.mxfp4 import dequantize_mxfp4

    widen = kernels._mxfp4_widen_row_avx512 if isa == "avx512" else kernels._mxfp4_widen_row_avx2

    @njit
    def run(packed, scales, half_scales, out):
        for r in range(packed.shape[0]):
            widen(packed[r], scales[r], half_scales, out[r])

    packed, scales = _random_mxfp4(np.random.default_rng(3), 6, 96, num_nan_scales=2)
    out = np.full((6, 96), 7.0, np.float32)
    run(packed, scales, kernels._HALF_SCALES, out)
    np.testing.assert_array_equal(out, dequantize_mxfp4(packed, scales))


@pytest.mark.parametrize("isa", [i for i in ("avx512", "avx2") if i in kernels.AVAILABLE_ISAS])
def test_mxfp4_two_row_four_token_pass_has_the_one_token_bits(isa):
    """The prefill pass (two rows against four x rows) on each vector instruction set the host has, whichever one
    the kernels compile it for (`_TILE_ISA`): each of its 8 dots has the one-row dot's bits, NaN scales included."""
    from numba import njit

    tile = kernels._row_dots_2x4_avx512 if isa == "avx512" else kernels._row_dots_2x4_avx2
    code = kernels.ISA_CODES[isa]

    @njit
    def run(packed, scales, xp, half_scales, out, alone):
        for r in range(0, packed.shape[0], 2):
            d = tile(packed[r], packed[r + 1], scales[r], scales[r + 1], xp[0], xp[1], xp[2], xp[3], half_scales)
            for j in range(8):
                out[r + j // 4, j % 4] = d[j]  # row-major: row r's 4 dots, then row r + 1's
            for i in range(2):
                for t in range(4):
                    alone[r + i, t] = kernels._row_dot(packed[r + i], scales[r + i], xp[t], half_scales, code)

    rng = np.random.default_rng(13)
    packed, scales = _random_mxfp4(rng, 6, 160, num_nan_scales=2)
    x = rng.standard_normal((4, 160)).astype(np.float32)
    xp = np.empty_like(x)
    kernels.permute_groups(x, xp)
    out, alone = np.full((6, 4), 7.0, np.float32), np.zeros((6, 4), np.float32)
    run(packed, scales, xp, kernels._HALF_SCALES, out, alone)
    np.testing.assert_array_equal(out, alone)


@pytest.mark.parametrize("isa", kernels.AVAILABLE_ISAS)
def test_mxfp4_experts_prefill_tiles_keep_the_one_token_bits(isa):
    """An expert with 9 tokens (on `_TILE_ISA`, 2 x 4 passes and one left; elsewhere one token at a time) gives
    each token the bits it gets alone, gate/up and down stages both, on each instruction set."""
    from k3serve.model.kernels import mxfp4_experts_run
    from k3serve.weights.mxfp4 import quantize_mxfp4

    rng = np.random.default_rng(12)
    latent, inter = 96, 64
    mats = [quantize_mxfp4(rng.standard_normal(shape).astype(np.float32))
            for shape in ((inter, latent), (inter, latent), (latent, inter))]
    stacked = tuple(a[None] for m in mats for a in m)
    z = rng.standard_normal((12, latent)).astype(np.float32)
    tokens = np.array([3, 0, 7, 11, 5, 2, 9, 4, 8], np.int64)
    zero, nine = np.zeros(1, np.int64), np.full(1, 9, np.int64)
    together = mxfp4_experts_run(stacked, zero, z, tokens, zero, nine, 4.0, 25.0, isa=isa, activations="f32")
    for n, t in enumerate(tokens):
        alone = mxfp4_experts_run(stacked, zero, z, np.array([t]), zero, np.ones(1, np.int64), 4.0, 25.0, isa=isa,
                                  activations="f32")
        np.testing.assert_array_equal(alone[0], together[n])


def test_half_bits_widen_exactly_in_compiled_code() -> None:
    """`kernels._block_scale` (the Q8_0 experts' float16 block scales in plain numba, as uint16 bits) on every one
    of the 65536 half-precision bit patterns: numpy's float16 -> float32 bits (NaNs as NaN); and
    `kernel_block_scales` hands float16 scales over as their bits, without a copy, float32 ones as they are."""
    @numba.njit
    def widen(bits, out):
        for i in range(bits.shape[0]):
            out[i] = kernels._block_scale(bits, i)

    bits = np.arange(65536, dtype=np.uint16)
    got = np.empty(65536, np.float32)
    widen(bits, got)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    half = np.ones((3, 4), np.float16)
    assert kernels.kernel_block_scales(half).dtype == np.uint16
    assert np.shares_memory(kernels.kernel_block_scales(half), half)
    wide = np.ones((3, 4), np.float32)
    assert kernels.kernel_block_scales(wide) is wide
