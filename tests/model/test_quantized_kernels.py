"""Dense trunk kernels on quantized bytes: Q8_0 x Q8_0 (every instruction set) against its numpy twin, the Q8_0
format against gguf-py's encoder, and `linear` on a `QuantizedMatrix` of each precision."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.model import kernels
from k3serve.model.kernels import (linear, mxfp4_matmul, q8_0_heads_matmul, q8_0_heads_matmul_reference, q8_0_matmul,
                                   q8_0_matmul_reference)
from k3serve.weights.q8_0 import dequantize_q8_0, quantize_q8_0, quantize_rows, split_q8_0
from k3serve.weights.quantized import QuantizedMatrix


def _relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    err = np.mean((got.astype(np.float64) - want) ** 2)
    return float(np.sqrt(err / max(np.mean(np.asarray(want, np.float64) ** 2), 1e-300)))


def _matrix(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[:, :32] *= 40.0  # blocks of very different scales
    if rows > 2:
        w[1, 32:64] = 0.0  # an all-zero block: d = 0
    return w


@pytest.mark.parametrize("isa", kernels.AVAILABLE_ISAS)
@pytest.mark.parametrize(("rows", "cols", "tokens"), [(1, 32, 1), (37, 96, 3), (64, 2048, 2), (17, 7168, 15)])
def test_q8_0_matmul_matches_numpy_twin_on_every_instruction_set(isa, rows, cols, tokens):
    rng = np.random.default_rng(rows * 1000 + cols + tokens)
    blocks = quantize_q8_0(_matrix(rng, rows, cols))
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    got = q8_0_matmul(blocks, x, isa=isa)
    want = q8_0_matmul_reference(blocks, x)
    assert got.shape == (tokens, rows) and got.dtype == np.float32
    assert _relative_rms(got, want) < 1e-6, isa


def test_q8_0_exact_when_every_block_sum_fits():
    """Integer weights and activations, unit scales: every float step is exact, so every path gives the twin."""
    rng = np.random.default_rng(3)
    q = rng.integers(-127, 128, size=(5, 64)).astype(np.float32)
    q[:, 0] = 127  # each block's max |q| is 127, so d = 1 and q is kept as is
    q[:, 32] = -127
    x = q[:2].copy()
    blocks = quantize_q8_0(q)
    assert np.array_equal(dequantize_q8_0(blocks), q)
    want = (x.astype(np.float64) @ q.T.astype(np.float64)).astype(np.float32)
    for isa in kernels.AVAILABLE_ISAS:
        assert np.array_equal(q8_0_matmul(blocks, x, isa=isa), want), isa


def test_q8_0_rows_do_not_depend_on_the_batch_or_the_threads():
    rng = np.random.default_rng(4)
    blocks = quantize_q8_0(_matrix(rng, 600, 512))  # 600 * 544 bytes: the parallel path
    x = rng.standard_normal((13, 512)).astype(np.float32)  # one padded 16-token tile (VNNI), or 8 and a padded 5
    batched = q8_0_matmul(blocks, x)
    for t in range(len(x)):
        assert np.array_equal(q8_0_matmul(blocks, x[t:t + 1])[0], batched[t])
    xq, xd = quantize_rows(x)
    for isa in kernels.AVAILABLE_ISAS:
        code = kernels.ISA_CODES[isa]
        xt, dt = kernels._q8_0_tiles(xq, xd, code, aligned=True)
        serial, parallel = (np.empty((13, 600), np.float32) for _ in range(2))
        kernels._q8_0_matmul_serial(blocks, xq, xd, xt, dt, kernels._F16_TO_F32, code, serial)
        kernels._q8_0_matmul_parallel(blocks, xq, xd, xt, dt, kernels._F16_TO_F32, code, parallel)
        assert np.array_equal(serial, parallel), isa
        assert np.array_equal(serial, batched) or code != kernels.ISA_CODES[kernels.ISA], isa


def test_a_long_prompt_keeps_each_tokens_bits():
    """45 tokens at C = 7168 (224 blocks): whole tiles, then a padded one (VNNI: 16, 16 and 13 of 16 lanes), each
    token with the bits of its own one-token dot."""
    rng = np.random.default_rng(6)
    cols = 7168
    blocks = quantize_q8_0(_matrix(rng, 17, cols))
    x = rng.standard_normal((45, cols)).astype(np.float32)
    for isa in kernels.AVAILABLE_ISAS:
        batched = q8_0_matmul(blocks, x, isa=isa)
        singles = np.concatenate([q8_0_matmul(blocks, x[t:t + 1], isa=isa) for t in range(len(x))])
        assert np.array_equal(batched, singles), isa


@pytest.mark.parametrize("cols", [32, 96, 128, 256])
def test_short_q8_0_rows_four_at_a_time_give_the_one_row_bits(cols):
    """At 1-3 tokens, rows of at most Q8_0_ROWS_MAX_GROUPS blocks go 4 at a time (`_q8_0_rows4_*`); each of their
    dots is the one-row dot's operations: the same bits as the multi-token passes (whose last tokens run the one-row
    dot), on both vector instruction sets, with tails of 1-3 rows."""
    assert cols // 32 <= kernels.Q8_0_ROWS_MAX_GROUPS
    rng = np.random.default_rng(cols)
    blocks = quantize_q8_0(_matrix(rng, 39, cols))  # 16 + 16 + 7 rows: 4-row passes, then 3 alone
    x = rng.standard_normal((13, cols)).astype(np.float32)
    for isa in [isa for isa in kernels.AVAILABLE_ISAS if isa != "portable"]:
        batched = q8_0_matmul(blocks, x, isa=isa)
        for t in range(len(x)):
            assert np.array_equal(q8_0_matmul(blocks, x[t:t + 1], isa=isa)[0], batched[t]), (isa, t)
        assert np.array_equal(q8_0_matmul(blocks, x[3:6], isa=isa), batched[3:6]), isa  # 3 tokens: 4 rows a pass
        assert _relative_rms(batched, q8_0_matmul_reference(blocks, x)) < 1e-6, isa


@pytest.mark.parametrize("cols", [96, 256, 288, 7168])
def test_q8_0_tiles_give_every_token_its_one_token_bits(cols):
    """From Q8_0_TILE_MIN_TOKENS tokens a row runs tiles (lanes = tokens, the activations laid out + 128 for VNNI);
    at 1-3 one dot per token (lanes = the 8 accumulators). Both keep one float order, so every token count (tiles,
    padded tiles, tiles then 1-3 single dots) gives each token the bits of the token alone, on both vector
    instruction sets and between them. Rows of G = 3 and 8 blocks run one dot per token at every count
    (`_q8_0_dots_only`); 9 and 224 blocks run tiles, with and without a tail of fewer than 8 blocks."""
    rng = np.random.default_rng(cols + 1)
    blocks = quantize_q8_0(_matrix(rng, 21, cols))
    x = rng.standard_normal((41, cols)).astype(np.float32)
    x[5] = 0.0  # a zero row: d = 0 in every block
    singles = {isa: np.concatenate([q8_0_matmul(blocks, x[t:t + 1], isa=isa) for t in range(len(x))])
               for isa in kernels.AVAILABLE_ISAS if isa != "portable"}
    for isa, want in singles.items():
        for count in (4, 5, 8, 15, 16, 17, 19, 20, 24, 33, 41):  # 8-lane, 16-lane, padded, then 8 lanes or 1-3 alone
            assert np.array_equal(q8_0_matmul(blocks, x[:count], isa=isa), want[:count]), (isa, count)
        assert _relative_rms(want, q8_0_matmul_reference(blocks, x)) < 1e-6, isa
    assert all(np.array_equal(want, singles["avx2"]) for want in singles.values())


def test_the_portable_q8_0_dot_follows_the_vector_paths_order():
    """Plain numba takes the block sums into the same 8 accumulators, with a float64 add for the FMA: on these
    matrices (none hits a double rounding) its bits are the vector paths'."""
    rng = np.random.default_rng(11)
    for rows, cols, tokens in [(40, 256, 1), (33, 320, 20), (17, 7168, 15)]:
        blocks = quantize_q8_0(_matrix(rng, rows, cols))
        x = rng.standard_normal((tokens, cols)).astype(np.float32)
        assert np.array_equal(q8_0_matmul(blocks, x, isa="portable"), q8_0_matmul(blocks, x))


@pytest.mark.parametrize("isa", kernels.AVAILABLE_ISAS)
@pytest.mark.parametrize(("heads", "rows", "cols", "tokens"), [(3, 40, 128, 1), (4, 17, 512, 3), (2, 512, 128, 9)])
def test_q8_0_heads_matmul_is_q8_0_matmul_head_by_head(isa, heads, rows, cols, tokens):
    """MLA's per-head Q8_0 matrices in one call: each head's output has `q8_0_matmul`'s bits for that head, whatever
    the token count, serial or parallel, and matches the numpy twin."""
    rng = np.random.default_rng(heads * rows + cols + tokens)
    blocks = quantize_q8_0(_matrix(rng, heads * rows, cols)).reshape(heads, rows, -1)
    x = rng.standard_normal((heads, tokens, cols)).astype(np.float32)
    got = q8_0_heads_matmul(blocks, x, isa=isa)
    assert got.shape == (heads, tokens, rows) and got.dtype == np.float32
    for h in range(heads):
        assert np.array_equal(got[h], q8_0_matmul(blocks[h], x[h], isa=isa)), (isa, h)
    assert np.array_equal(q8_0_heads_matmul(blocks, x[:, -1:], isa=isa), got[:, -1:])
    assert _relative_rms(got, q8_0_heads_matmul_reference(blocks, x)) < 1e-6, isa
    xq, xd = quantize_rows(x.reshape(heads * tokens, cols))
    xq, xd = xq.reshape(heads, tokens, cols), xd.reshape(heads, tokens, -1)
    serial, parallel = (np.empty((heads, tokens, rows), np.float32) for _ in range(2))
    code = kernels.ISA_CODES[isa]
    tiles = [kernels._q8_0_tiles(xq[h], xd[h], code, aligned=True) for h in range(heads)]
    xt, dt = np.stack([t[0] for t in tiles]), np.stack([t[1] for t in tiles])
    kernels._q8_0_heads_serial(blocks, xq, xd, xt, dt, kernels._F16_TO_F32, code, serial)
    kernels._q8_0_heads_parallel(blocks, xq, xd, xt, dt, kernels._F16_TO_F32, code, parallel)
    assert np.array_equal(serial, got) and np.array_equal(parallel, got), isa


def test_q8_0_heads_matmul_refuses_mismatched_shapes():
    blocks = np.zeros((2, 8, 4 * 34), np.uint8)  # 2 heads of [8, 128]
    with pytest.raises(ValueError, match="x must be"):
        q8_0_heads_matmul(blocks, np.zeros((3, 1, 128), np.float32))  # 3 heads
    with pytest.raises(ValueError, match="x must be"):
        q8_0_heads_matmul(blocks, np.zeros((2, 1, 96), np.float32))
    with pytest.raises(ValueError, match="per-head Q8_0 blocks"):
        q8_0_heads_matmul(blocks.reshape(16, -1), np.zeros((2, 1, 128), np.float32))


def test_q8_0_vector_paths_give_the_same_bits():
    """AVX-512 (VNNI's vpdpbusd) and AVX2 (vpmaddubsw, vpmaddwd) sum each lane's 4 products exactly and run the
    same float operations, so they agree bit for bit, at 1 token and in the 4-token passes."""
    vector = [isa for isa in kernels.AVAILABLE_ISAS if isa != "portable"]
    if len(vector) < 2:
        pytest.skip("needs AVX-512 and AVX2 (this CPU has " + ", ".join(kernels.AVAILABLE_ISAS) + ")")
    rng = np.random.default_rng(8)
    w = _matrix(rng, 41, 7168 + 32)  # an odd number of blocks: the last one folds into the even chain
    blocks = quantize_q8_0(w)
    blocks[3, 2:34] = 0x80  # q_w = -128 (not llama.cpp's encoder, but a file may hold it): |q_w| = 128
    x = rng.standard_normal((9, w.shape[1])).astype(np.float32)
    outs = [q8_0_matmul(blocks, x, isa=isa) for isa in vector]
    assert all(np.array_equal(outs[0], out) for out in outs[1:])
    assert _relative_rms(outs[0], q8_0_matmul_reference(blocks, x)) < 1e-6


def test_q8_0_encoder_is_llama_cpp_s():
    """gguf-py (llama.cpp's Python package) quantizes to the same bytes."""
    import gguf  # the test extra carries it (the GGUF tests write their files with it)
    rng = np.random.default_rng(5)
    w = _matrix(rng, 9, 160)
    w[2, 64:96] = np.float32(0.5) * np.arange(32, dtype=np.float32) / 127 * 7  # ties at .5 steps
    theirs = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(quantize_q8_0(w), theirs)
    assert np.array_equal(dequantize_q8_0(theirs), gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType.Q8_0))


def test_q8_0_error_against_float_activations_is_small():
    """The activation quantization costs about half a percent of relative RMS on Gaussian rows; the weight
    quantization about as much again (both measured here, bounded at 1%)."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((256, 1024)).astype(np.float32)
    x = rng.standard_normal((8, 1024)).astype(np.float32)
    blocks = quantize_q8_0(w)
    got = q8_0_matmul(blocks, x)
    float_activations = x @ dequantize_q8_0(blocks).T
    assert 1e-4 < _relative_rms(got, float_activations) < 1e-2
    assert _relative_rms(got, x @ w.T) < 1e-2
    q, d = split_q8_0(blocks)  # |error| <= d / 2, plus 127 times d's half rounding (2^-11 relative)
    ratio = np.abs(q.reshape(256, -1, 32) * d[:, :, None] - w.reshape(256, -1, 32)) / d[:, :, None]
    assert float(ratio.max()) <= 0.5 + 127 * 2.0**-11


def test_compiled_activation_quantizer_is_quantize_rows_bit_for_bit():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((7, 320)) * np.exp(rng.uniform(-8, 8, (7, 1)))).astype(np.float32)
    x[2, 32:64] = 0.0
    x[3, 64:96] = np.float32(0.5) * np.arange(32) / 127  # halfway cases
    q, d = kernels.quantize_activations(x)
    want_q, want_d = quantize_rows(x)
    assert np.array_equal(q, want_q) and np.array_equal(d, want_d)
    x[4, 5] = np.nan  # propagates as float activations would, in its row only
    out = q8_0_matmul(quantize_q8_0(np.ones((3, 320), np.float32)), x)
    assert np.all(np.isnan(out[4])) and np.all(np.isfinite(np.delete(out, 4, axis=0)))


def test_q8_0_shapes_and_bad_input_are_refused():
    with pytest.raises(ValueError, match="C % 32"):
        quantize_rows(np.zeros((2, 33), np.float32))
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_q8_0(np.full((1, 32), np.inf, np.float32))
    blocks = quantize_q8_0(np.ones((3, 64), np.float32))
    with pytest.raises(ValueError, match=r"x must be \[T, 64\]"):
        q8_0_matmul(blocks, np.ones((1, 32), np.float32))
    assert q8_0_matmul(blocks, np.ones((0, 64), np.float32)).shape == (0, 3)
    with pytest.raises(ValueError, match="not available"):
        q8_0_matmul(blocks, np.ones((1, 64), np.float32), isa="sse9")


@pytest.mark.parametrize("precision", ["q8_0", "mxfp4"])
def test_linear_reads_a_quantized_matrix_from_its_bytes(precision):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((48, 256)).astype(np.float32)
    matrix = QuantizedMatrix.quantize(w, precision)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    got = linear(x, matrix)
    if precision == "q8_0":
        assert np.array_equal(got, q8_0_matmul(matrix.data, x))
    else:
        assert np.array_equal(got, mxfp4_matmul(matrix.data, matrix.scales, x))
    assert _relative_rms(got, x @ w.T) < (1e-2 if precision == "q8_0" else 0.2)
    assert matrix.nbytes == 48 * 256 * (34 if precision == "q8_0" else 17) // 32


@pytest.mark.parametrize("precision", ["q8_0", "mxfp4"])
def test_quantized_matrix_bytes_rows_and_stack(precision):
    rng = np.random.default_rng(8)
    a, b = (QuantizedMatrix.quantize(rng.standard_normal((n, 64)).astype(np.float32), precision) for n in (3, 5))
    again = QuantizedMatrix.from_bytes(a.store_dtype, np.frombuffer(a.to_bytes(), np.uint8), a.shape)
    assert np.array_equal(again.dequantize(), a.dequantize())
    stacked = QuantizedMatrix.stack([a, b])
    assert stacked.shape == (8, 64)
    assert np.array_equal(stacked.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    assert np.array_equal(stacked.rows(np.array([4, 0])), stacked.dequantize()[[4, 0]])
    with pytest.raises(ValueError, match="needs"):
        QuantizedMatrix.from_bytes(a.store_dtype, np.zeros(3, np.uint8), a.shape)


@pytest.mark.parametrize("isa", kernels.AVAILABLE_ISAS)
def test_mxfp4_rows_layout_is_multiplied_in_place_bit_for_bit(isa):
    """An MXFP4 trunk entry laid out by rows (store format 3: each row's nibbles, then its scales) decodes to two
    strided views; the kernel multiplies them without a copy and gives the bits of the contiguous matrix, and two
    such entries back to back are one fused matrix (`adjacent_quantized_view`). The planar layout (format 2) still
    round-trips, and its parts are never one view."""
    from k3serve.model.weights import adjacent_quantized_view

    rng = np.random.default_rng(9)
    a, b = (QuantizedMatrix.quantize(_matrix(rng, n, 96), "mxfp4") for n in (37, 5))
    raw = np.frombuffer(a.to_bytes() + b.to_bytes(), np.uint8)
    first = QuantizedMatrix.from_bytes("MXFP4", raw[:a.nbytes], a.shape)
    second = QuantizedMatrix.from_bytes("MXFP4", raw[a.nbytes:], b.shape)
    assert first.data.strides == (48 + 3, 1) and np.shares_memory(first.data, raw)
    assert kernels._rows_contiguous(first.data) is first.data and kernels._rows_contiguous(first.scales) is first.scales
    x = rng.standard_normal((3, 96)).astype(np.float32)

    def same(got, want):
        # NOTE: the portable row dot is plain numba with fastmath reassoc, compiled once per array layout; LLVM may
        # vectorize the strided and the contiguous compilations differently, so there only the sum order differs
        if isa == "portable":
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
        else:
            assert np.array_equal(got, want)

    same(mxfp4_matmul(first.data, first.scales, x, isa=isa), mxfp4_matmul(a.data, a.scales, x, isa=isa))
    fused = adjacent_quantized_view([first, second])
    assert fused is not None and fused.shape == (42, 96) and np.shares_memory(fused.data, raw)
    stacked = QuantizedMatrix.stack([a, b])
    same(mxfp4_matmul(fused.data, fused.scales, x, isa=isa), mxfp4_matmul(stacked.data, stacked.scales, x, isa=isa))
    assert np.array_equal(fused.rows(np.array([40, 2])), stacked.dequantize()[[40, 2]])
    planar = np.frombuffer(a.to_bytes(rows=False) + b.to_bytes(rows=False), np.uint8)
    old = [QuantizedMatrix.from_bytes("MXFP4", planar[:a.nbytes], a.shape, rows=False),
           QuantizedMatrix.from_bytes("MXFP4", planar[a.nbytes:], b.shape, rows=False)]
    assert np.array_equal(old[0].dequantize(), a.dequantize())
    assert adjacent_quantized_view(old) is None
