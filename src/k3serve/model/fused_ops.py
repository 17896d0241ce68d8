"""Compiled trunk stages that each replace several numpy calls of the layer loop (issue 33, item 2).

    rms_norm_into(x, w, eps, out):                  out = RMSNorm(x) * w      (`ops.rms_norm` runs it)
    l2_normalize_into(x, eps, out):                 out = x / sqrt(sum(x^2) + eps)      (`ops.l2_normalize`)
    add_rms_norm(h, delta, w, eps, out):            h += delta; out = RMSNorm(h) * w      (pre-norm residual)
    attn_res_norm(sources, query, w, eps, h, x):    h = AttnRes(sources, query); x = RMSNorm(h) * w   (K3)
    route_top_k(scores, bias, renormalize, scale, ids, weights):   K3's router after its sigmoid
    softmax_top_k(exps, normalize, ids, weights):   the families' softmax router after its exp
    rotate_into(x, cos, sin, interleaved, out):     the families' rotary embedding (`Rotary.apply`)

with RMSNorm(x) = x / sqrt(mean(x^2) + eps). A decode step of the embedded K3 made about 2,000 Python calls; each
stage here is one call into compiled code writing into buffers the forward allocates once per step, so no layer
allocates.

The bits are those of the numpy twins (`ops.rms_norm`, `attn_res.attn_res`, `h + delta`, `moe.route_scores`), not
merely close: the squares are summed in numpy's own pairwise order (blocks of 8 lanes, halves above 128 values;
numpy's `pairwise_sum`), then divided, added to eps, square-rooted and divided in float32 as numpy does. So a
model's logits do not move when its loop switches to these stages (tests/model/test_fused_ops.py checks every
stage bit for bit against its twin on odd widths, and the models' parity tests still hold).

Division follows numpy too (`error_model="numpy"`): a zero denominator gives inf or NaN, as the numpy lines did,
never a ZeroDivisionError inside a step.

Shapes: T tokens (rows), H width, S sources, NE experts, TOPK chosen.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from k3serve.model.attn_res import _attn_res


MAX_PAIRWISE_DEPTH = 64  # frames of the pairwise tree's walk: 2 per halving, so widths up to 2^31 values


@njit(cache=True, error_model="numpy")
def _block_sum(a: np.ndarray, start: int, n: int) -> np.float32:
    """sum(a[start:start+n]) for n <= 128 in numpy's order: plain below 8 values, else 8 running lanes, their
    tree, then the tail."""
    if n < 8:
        total = np.float32(0.0)
        for i in range(n):
            total += a[start + i]
        return total
    r0, r1, r2, r3 = a[start], a[start + 1], a[start + 2], a[start + 3]
    r4, r5, r6, r7 = a[start + 4], a[start + 5], a[start + 6], a[start + 7]
    i = 8
    whole = n - n % 8
    while i < whole:
        r0 += a[start + i]
        r1 += a[start + i + 1]
        r2 += a[start + i + 2]
        r3 += a[start + i + 3]
        r4 += a[start + i + 4]
        r5 += a[start + i + 5]
        r6 += a[start + i + 6]
        r7 += a[start + i + 7]
        i += 8
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        total += a[start + i]
        i += 1
    return total


@njit(cache=True, error_model="numpy")
def _pairwise_sum(a: np.ndarray, n: int, frames: np.ndarray, values: np.ndarray) -> np.float32:
    """sum(a[:n]) in float32, added in the order of numpy's pairwise summation (a reduce over a contiguous float32
    row): blocks of at most 128 values (`_block_sum`), and above 128 the sum of two halves, the first a multiple of
    8. The halving is walked with an explicit stack (frames [MAX_PAIRWISE_DEPTH, 3] int64: start, size, state;
    values [MAX_PAIRWISE_DEPTH] float32) because numba's cache cannot reload a recursive function."""
    if n <= 128:
        return _block_sum(a, 0, n)
    depth, num_values = 1, 0
    frames[0, 0], frames[0, 1], frames[0, 2] = 0, n, 0
    while depth:
        start, size, state = frames[depth - 1, 0], frames[depth - 1, 1], frames[depth - 1, 2]
        if size <= 128:
            values[num_values] = _block_sum(a, start, size)
            num_values += 1
            depth -= 1
            continue
        half = size // 2
        half -= half % 8
        if state == 2:  # both halves summed: left + right
            values[num_values - 2] = values[num_values - 2] + values[num_values - 1]
            num_values -= 1
            depth -= 1
            continue
        frames[depth - 1, 2] = state + 1
        if state == 0:
            frames[depth, 0], frames[depth, 1] = start, half
        else:
            frames[depth, 0], frames[depth, 1] = start + half, size - half
        frames[depth, 2] = 0
        depth += 1
    return values[0]


@njit(cache=True, error_model="numpy")
def _norm_row(row: np.ndarray, weight: np.ndarray, eps: np.float32, squares: np.ndarray, frames: np.ndarray,
              values: np.ndarray, out: np.ndarray) -> None:
    """out = row / sqrt(sum(row^2) / H + eps) * weight, one row [H]; `squares` [H], frames and values (see
    `_pairwise_sum`) are scratch."""
    width = row.shape[0]
    for i in range(width):
        squares[i] = row[i] * row[i]
    variance = _pairwise_sum(squares, width, frames, values) / np.float32(width)
    denominator = np.sqrt(variance + eps)
    for i in range(width):
        out[i] = row[i] / denominator * weight[i]


@njit(cache=True, error_model="numpy")
def rms_norm_into(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    """x [T, H] float32, weight [H] -> out [T, H] (may be x)."""
    squares = np.empty(x.shape[1], np.float32)
    frames, values = np.empty((MAX_PAIRWISE_DEPTH, 3), np.int64), np.empty(MAX_PAIRWISE_DEPTH, np.float32)
    for t in range(x.shape[0]):
        _norm_row(x[t], weight, eps, squares, frames, values, out[t])


@njit(cache=True, error_model="numpy")
def l2_normalize_into(x: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    """x [T, D] float32 -> out [T, D] = x / sqrt(sum(x^2) + eps) per row (may be x)."""
    squares = np.empty(x.shape[1], np.float32)
    frames, values = np.empty((MAX_PAIRWISE_DEPTH, 3), np.int64), np.empty(MAX_PAIRWISE_DEPTH, np.float32)
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            squares[i] = x[t, i] * x[t, i]
        denominator = np.sqrt(_pairwise_sum(squares, x.shape[1], frames, values) + eps)
        for i in range(x.shape[1]):
            out[t, i] = x[t, i] / denominator


@njit(cache=True, error_model="numpy")
def add_rms_norm(h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    """h [T, H] += delta [T, H] in place, then out [T, H] = RMSNorm(h) * weight [H]."""
    squares = np.empty(h.shape[1], np.float32)
    frames, values = np.empty((MAX_PAIRWISE_DEPTH, 3), np.int64), np.empty(MAX_PAIRWISE_DEPTH, np.float32)
    for t in range(h.shape[0]):
        for i in range(h.shape[1]):
            h[t, i] += delta[t, i]
        _norm_row(h[t], weight, eps, squares, frames, values, out[t])


@njit(cache=True, error_model="numpy")
def attn_res_norm(sources: np.ndarray, query: np.ndarray, weight: np.ndarray, eps: np.float32, h: np.ndarray,
                  x: np.ndarray) -> None:
    """sources [S, T, H] (the block snapshots then the partial sum), query [H] -> h [T, H] = AttnRes, and
    x [T, H] = RMSNorm(h) * weight [H]: the two calls K3's layer makes before its mixer and before its MLP."""
    _attn_res(sources, query, eps, h)
    rms_norm_into(h, weight, eps, x)


@njit(cache=True, error_model="numpy")
def select_top_k(values: np.ndarray, taken: np.ndarray, ids: np.ndarray) -> None:
    """ids [TOPK] = the ids of the largest of values [NE], largest first, the lower id first among equal values
    (a stable descending sort's first TOPK; NaN counts as the smallest); taken [NE] is scratch."""
    num_experts = values.shape[0]
    taken[:] = False
    for j in range(ids.shape[0]):
        best = -1
        for e in range(num_experts):
            if taken[e] or values[e] != values[e]:
                continue
            if best < 0 or values[e] > values[best]:
                best = e
        if best < 0:  # only NaN left: the lowest id not yet taken
            best = 0
            while taken[best]:
                best += 1
        taken[best] = True
        ids[j] = best


@njit(cache=True, error_model="numpy")
def route_top_k(scores: np.ndarray, bias: np.ndarray, renormalize: bool, scale: np.float32, ids: np.ndarray,
                weights: np.ndarray) -> None:
    """K3's router after sigmoid: scores [T, NE], bias [NE] -> ids [T, TOPK] (the largest scores + bias, as
    `moe.top_k_rows`) and weights [T, TOPK] = the chosen scores, divided by their sum when `renormalize` (summed in
    numpy's order), times `scale`."""
    num_experts, top_k = scores.shape[1], ids.shape[1]
    biased = np.empty(num_experts, np.float32)
    taken = np.empty(num_experts, np.bool_)
    chosen = np.empty(top_k, np.float32)
    frames, values = np.empty((MAX_PAIRWISE_DEPTH, 3), np.int64), np.empty(MAX_PAIRWISE_DEPTH, np.float32)
    for t in range(scores.shape[0]):
        for e in range(num_experts):
            biased[e] = scores[t, e] + bias[e]
        select_top_k(biased, taken, ids[t])
        for j in range(top_k):
            chosen[j] = scores[t, ids[t, j]]
        if renormalize:
            total = _pairwise_sum(chosen, top_k, frames, values)
            for j in range(top_k):
                weights[t, j] = chosen[j] / total * scale
        else:
            for j in range(top_k):
                weights[t, j] = chosen[j] * scale


@njit(cache=True, error_model="numpy")
def shift_by_row_max(logits: np.ndarray) -> None:
    """logits [T, NE] -= each row's max, in place (NaN in a row makes the row NaN, as np.max propagates it)."""
    for t in range(logits.shape[0]):
        top = logits[t, 0]
        for e in range(1, logits.shape[1]):
            if top != top:
                break
            value = logits[t, e]
            if value > top or value != value:
                top = value
        for e in range(logits.shape[1]):
            logits[t, e] -= top


@njit(cache=True, error_model="numpy")
def softmax_top_k(exps: np.ndarray, normalize: bool, ids: np.ndarray, weights: np.ndarray) -> None:
    """The families' softmax router after its exp: exps [T, NE] = exp(logits - row max) (numpy's exp, so its bits)
    -> probabilities p = exps / sum(exps) (in place), ids [T, TOPK] of the largest p (ties to the lower id), and
    weights [T, TOPK] = the chosen p, divided by their sum when `normalize`. Sums in numpy's pairwise order."""
    num_experts, top_k = exps.shape[1], ids.shape[1]
    taken = np.empty(num_experts, np.bool_)
    chosen = np.empty(top_k, np.float32)
    frames, values = np.empty((MAX_PAIRWISE_DEPTH, 3), np.int64), np.empty(MAX_PAIRWISE_DEPTH, np.float32)
    for t in range(exps.shape[0]):
        total = _pairwise_sum(exps[t], num_experts, frames, values)
        for e in range(num_experts):
            exps[t, e] = exps[t, e] / total
        select_top_k(exps[t], taken, ids[t])
        for j in range(top_k):
            chosen[j] = exps[t, ids[t, j]]
        if normalize:
            total = _pairwise_sum(chosen, top_k, frames, values)
            for j in range(top_k):
                weights[t, j] = chosen[j] / total
        else:
            for j in range(top_k):
                weights[t, j] = chosen[j]


@njit(cache=True, error_model="numpy")
def rotate_into(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool, out: np.ndarray) -> None:
    """Rotary embedding: x [T, NH, D], cos and sin [T, d/2] -> out [T, NH, D] = [x1 c - x2 s | x2 c + x1 s | rest]
    with (x1, x2) the two halves of x's first d channels (interleaved: the even and odd channels)."""
    half = cos.shape[1]
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            for i in range(half):
                if interleaved:
                    first, second = x[t, h, 2 * i], x[t, h, 2 * i + 1]
                else:
                    first, second = x[t, h, i], x[t, h, half + i]
                out[t, h, i] = first * cos[t, i] - second * sin[t, i]
                out[t, h, half + i] = second * cos[t, i] + first * sin[t, i]
            for i in range(2 * half, x.shape[2]):
                out[t, h, i] = x[t, h, i]
