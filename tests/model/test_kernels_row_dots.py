"""The MXFP4 row dot over 2 and 4 rows a pass (`kernels._row_dots2/_row_dots4`, `_rows_dot_into`): every output
has the one-row dot's bits, on every instruction set this CPU has, with odd row counts, tails and 255 scales."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from k3serve.model import kernels

ROWS_PER_DOT = (1, 2, 4)


def _random_mxfp4(rng: np.random.Generator, shape: tuple[int, ...], cols: int) -> tuple[np.ndarray, np.ndarray]:
    packed = rng.integers(0, 256, size=(*shape, cols // 2), dtype=np.uint8)  # [..., R, C/2]
    scales = rng.integers(116, 127, size=(*shape, cols // 32), dtype=np.uint8)  # [..., R, G]
    flat = scales.reshape(-1)
    flat[rng.choice(flat.size, size=max(1, flat.size // 9), replace=False)] = 255
    return packed, scales


@numba.njit
def _dots_of_rows(packed, scales, x, half_scales, isa, num_rows):
    """Each row's dot with x, from the 1-, 2- or 4-row intrinsic (rows 0:num_rows of the matrix)."""
    out = np.empty(num_rows, np.float32)
    if num_rows == 1:
        out[0] = kernels._row_dot(packed[0], scales[0], x, half_scales, isa)
    elif num_rows == 2:
        out[0], out[1] = kernels._row_dots2(packed[0], packed[1], scales[0], scales[1], x, half_scales, isa)
    else:
        out[0], out[1], out[2], out[3] = kernels._row_dots4(packed[0], packed[1], packed[2], packed[3], scales[0],
                                                            scales[1], scales[2], scales[3], x, half_scales, isa)
    return out


def _one_row_dot(packed: np.ndarray, scales: np.ndarray, x: np.ndarray, code: int) -> np.float32:
    """`_row_dot` of the first row of packed / scales and x."""
    return _dots_of_rows(packed, scales, x, kernels._HALF_SCALES, code, 1)[0]


@pytest.mark.parametrize("isa", kernels.AVAILABLE_ISAS)
@pytest.mark.parametrize("cols", [32, 96, 3584])
def test_multi_row_intrinsics_equal_the_one_row_dot(isa: str, cols: int) -> None:
    rng = np.random.default_rng(cols)
    packed, scales = _random_mxfp4(rng, (4,), cols)
    x = rng.standard_normal(cols).astype(np.float32) * np.float32(1e3)
    code = kernels.ISA_CODES[isa]
    one = np.array([_one_row_dot(packed[r:r + 1], scales[r:r + 1], x, code) for r in range(4)], np.float32)
    assert np.array_equal(_dots_of_rows(packed[:2], scales[:2], x, kernels._HALF_SCALES, code, 2), one[:2])
    assert np.array_equal(_dots_of_rows(packed, scales, x, kernels._HALF_SCALES, code, 4), one)
    assert np.isfinite(one).all() and np.any(one != 0)


@pytest.mark.parametrize("isa", kernels.AVAILABLE_ISAS)
@pytest.mark.parametrize(("rows", "cols", "num_tokens"), [(1, 32, 1), (3, 64, 2), (7, 96, 1), (37, 96, 3),
                                                          (50, 2048, 1)])
def test_matmul_rows_per_dot_keeps_the_bits(isa: str, rows: int, cols: int, num_tokens: int) -> None:
    """Rows 1, 2 or 4 a pass, serial and parallel: the same bits (37 and 50 rows leave 2- and 1-row tails in a
    16-row task)."""
    rng = np.random.default_rng(rows * cols)
    packed, scales = _random_mxfp4(rng, (rows,), cols)
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    xp = np.empty_like(x)
    kernels.permute_groups(x, xp)
    outputs = []
    for kernel in (kernels._matmul_serial, kernels._matmul_parallel):
        for rows_per_dot in ROWS_PER_DOT:
            out = np.full((num_tokens, rows), np.nan, dtype=np.float32)
            kernel(packed, scales, xp, kernels._HALF_SCALES, kernels.ISA_CODES[isa], out, rows_per_dot)
            outputs.append(out)
    assert not np.isnan(outputs[0]).any()
    for out in outputs[1:]:
        assert np.array_equal(out, outputs[0])
    assert np.array_equal(outputs[0], kernels.mxfp4_matmul(packed, scales, x, isa=isa))


@pytest.mark.parametrize("isa", kernels.AVAILABLE_ISAS)
@pytest.mark.parametrize(("inner", "latent"), [(32, 64), (96, 37 * 32)])
def test_expert_stages_rows_per_dot_keep_the_bits(isa: str, inner: int, latent: int) -> None:
    """Stage 1 (w1 and w3 rows alone, as a pair, two pairs) and stage 2 (w2 rows 1, 2, 4 a pass, 37 rows: tails)
    give the same bits, serial and parallel, with experts of 1, 3 and 0 tokens."""
    rng = np.random.default_rng(inner + latent)
    num_experts = 3
    w1p, w1s = _random_mxfp4(rng, (num_experts, inner), latent)
    w3p, w3s = _random_mxfp4(rng, (num_experts, inner), latent)
    w2p, w2s = _random_mxfp4(rng, (num_experts, 37), inner)  # [E, 37, MI/2]: 37 output rows
    z = rng.standard_normal((3, latent)).astype(np.float32)
    zp = np.empty_like(z)
    kernels.permute_groups(z, zp)
    expert_ids = np.array([2, 0, 1], np.int64)
    tokens = np.array([1, 0, 1, 2], np.int64)
    starts, ends = np.array([0, 1, 4], np.int64), np.array([1, 4, 4], np.int64)
    hidden = rng.standard_normal((4, inner)).astype(np.float32)
    code = kernels.ISA_CODES[isa]
    stage1, stage2 = [], []
    for gate_up, down in ((kernels._experts_gate_up_serial, kernels._experts_down_serial),
                          (kernels._experts_gate_up_parallel, kernels._experts_down_parallel)):
        for rows_per_dot in ROWS_PER_DOT:
            gate, up = np.full((4, inner), np.nan, np.float32), np.full((4, inner), np.nan, np.float32)
            gate_up(w1p, w1s, w3p, w3s, expert_ids, zp, tokens, starts, ends, kernels._HALF_SCALES, code, gate, up,
                    rows_per_dot)
            out = np.full((4, 37), np.nan, np.float32)
            down(w2p, w2s, expert_ids, starts, ends, kernels._HALF_SCALES, code, hidden, out, rows_per_dot)
            stage1.append((gate, up))
            stage2.append(out)
    assert not np.isnan(stage1[0][0]).any() and not np.isnan(stage2[0]).any()
    for (gate, up), out in zip(stage1[1:], stage2[1:]):
        assert np.array_equal(gate, stage1[0][0]) and np.array_equal(up, stage1[0][1])
        assert np.array_equal(out, stage2[0])
    # the one-row dot, row by row, is the reference for every value
    expect_gate = np.array([[_one_row_dot(w1p[e, r:r + 1], w1s[e, r:r + 1], zp[1], code) for r in range(inner)]
                            for e in (2,)], np.float32)
    assert np.array_equal(stage1[0][0][0, [_permuted(r) for r in range(inner)]], expect_gate[0])


def _permuted(i: int) -> int:
    return (i // 32) * 32 + (i % 2) * 16 + (i % 32) // 2
