"""Hot loops: the fused MXFP4 dequantize-and-multiply of the routed experts, with its slow numpy twin; the Q8_0 x
Q8_0 and MXFP4 trunk matrix products of a quantized trunk (`q8_0_matmul`, `quantized_matmul`, section "Q8_0 trunk
matrices"); bf16 / int8 dense kernels for the families' experts and the bf16 trunk (`linear`).

Shape letters: T = tokens (rows of x), R = weight rows (outputs), C = weight columns (inputs), G = C / 32 scale
groups per row, E = stacked experts, K = experts active in one call, N = (token, expert) pairs, LT = latent,
MI = expert intermediate.

    y[t, r] = sum_g m[r, g] * sum_{k < 32} V[nibble(r, 32 g + k)] * x[t, 32 g + k]
    V = 2 * E2M1 = {0, 1, 2, 3, 4, 6, 8, 12, -0, ..., -12},   m[r, g] = 2^(scales[r, g] - 127) / 2  (byte 255 -> 0)

(K3_SPEC section 4; `k3serve.weights.mxfp4` defines the format.) Nothing builds the float matrix. One compiled
routine, the row dot, computes one y[t, r] straight from the row's packed bytes:

- Group order. A byte holds element 2j (low nibble) and 2j+1 (high nibble), so each group of 32 inputs is first
  permuted to [16 even | 16 odd] (`permute_groups`, once per call, O(T C)); the 16 low nibbles of a group then
  meet the 16 even inputs lane by lane, the 16 high nibbles the 16 odd ones.
- Decode. The nibble indexes a 16-entry float table held in a vector register (`vpermd` on AVX-512, one
  instruction per 16 weights; `vpermps` on 8 lanes plus a sign flip on AVX2). Products and sums are exact until
  the dot products: V * m is a power-of-two multiple of a 4-bit integer.
- Arithmetic, per group: t = V_lo * x_even + V_hi * x_odd (one multiply, one FMA, lane-wise), acc = t * m + acc
  (FMA), then a fixed pairwise sum of the lanes. This order is written out in LLVM IR (`numba.extending.
  intrinsic`), so it does not depend on the compiler's vectorizer, on T, on the other tokens or on the threads.

The instruction set is chosen once per process (`ISA`): "avx512", "avx2", or "portable" (plain numba, a
float-arithmetic decode the compiler vectorizes by itself; no hand-written SIMD). Every kernel takes the choice
as an argument, so tests run all the paths the host supports against the numpy twin. A given process and CPU
always compute the same bits; different instruction sets round differently (float32 summation order).

Work is split over weight rows (and over experts); every output is one row dot, so the result is independent of
the number of threads. The routed experts of one layer run as one compiled call (`mxfp4_experts_accumulate`):
stage 1 computes w1 and w3 rows together and applies SiTU-GLU to the pair (writing the hidden vector straight
into the permuted group order), stage 2 multiplies by w2, both spread over the cores across (expert, row block).

The row dot can compute 2 or 4 rows of one matrix against the same x in one pass (`_row_dots2`, `_row_dots4`), each
row with its own accumulator and the one-row operation order, so with the same bits; stage 1 uses it for the w1
and w3 rows of one index. An opt-in path (section "MXFP4 x int8") quantizes the activations to Q8_0 and sums int8
products exactly (AVX-512 VNNI or AVX2), llama.cpp's arithmetic: about twice the float path's speed, other bits.
At prefill that path runs in tiles (section "int8 tiles": two rows decoded once, 8 or 4 tokens a pass, the int8
row dot's bits), and the families' per-row int8 experts have the same kind of tiles on Q8_0 activations (opt-in,
K3SERVE_INT8_ACTIVATIONS=q8). A GGUF's Q8_0 experts multiply Q8_0 activations by default, as the file's Q8_0 trunk
matrices do (section "a GGUF's Q8_0 experts on Q8_0 activations"; K3SERVE_INT8_ACTIVATIONS=f32 keeps them on floats).
MLA's per-head W_uk / W_uv of a Q8_0 GGUF go through `q8_0_heads_matmul` (the same Q8_0 dot, every head in one call).
Every Q8_0 x Q8_0 product (trunk, heads, experts) keeps one float order whatever the token count: exact int32 block
sums into 8 accumulators by block; one token runs with the accumulators as lanes, 4 or more with the tokens as
lanes (16 a vector on AVX-512 VNNI, the weight bytes broadcast), so each token has its one-token bits.

TODO: the float path's prefill re-decodes a row for every token routed to it (cheap: the row stays in L1 and decode
is one instruction per 16 weights); a register-blocked multi-token row dot would save the remaining decode work.
"""

from __future__ import annotations

import logging
import os

# How OpenMP workers wait between parallel regions is set before numba starts its pool: by default libgomp's own
# spin-then-sleep, with the kernels' thread count steered step by step (k3serve/threads.py); K3SERVE_WAIT_POLICY=
# passive or active fixes it, and an explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT wins (benchmarks/bench_wait_policy.py).
from k3serve.threads import configure_wait_policy  # noqa: E402

configure_wait_policy()

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.core import config as numba_config  # noqa: E402
from numba.extending import intrinsic, overload, register_jitable  # noqa: E402

from k3serve.model.ops import silu, situ_glu  # noqa: E402
from k3serve.weights.mxfp4 import E2M1_VALUES, check_mxfp4_shapes, dequantize_mxfp4, scale_bytes_to_f32  # noqa: E402
from k3serve.weights.q8_0 import dequantize_q8_0, quantize_rows  # noqa: E402
from k3serve.weights.quantized import QuantizedMatrix  # noqa: E402

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
BYTES_PER_GROUP = GROUP_SIZE // 2
ROWS_PER_TASK = 16  # weight rows one parallel task computes (for every token routed to it)
# Rows the MXFP4 row dot computes in one pass over x (1, 2 or 4; `_rows_dot_into`, `_gate_up_task`). Each row keeps
# its own accumulator, so the bits do not depend on it; the compiled kernels take it as an argument, which callers
# pass explicitly (numba's specialization for the omitted default ran ~15% slower on the widened experts).
# The loop is bound by its vector uops (~7 zmm ops a group, double-pumped on Zen 4), not by the accumulator's FMA
# latency, so more rows a pass gain little: the w1 and w3 rows of one index together (same x) ran ~1.1x as fast
# as apart; consecutive w2 rows in pairs or quads were slower (docs/BENCHMARKS.md, "The MXFP4 expert row dot on
# Zen 4").
MXFP4_GATE_UP_ROWS_PER_DOT = 2
MXFP4_ROWS_PER_DOT = 1
# x rows from which the MXFP4 row dot runs 2 rows x 4 tokens a pass (`_row_dots_2x4`; the same bits per dot)
MXFP4_TILE_TOKENS = 4
# Below this many weights (K * R * C) one thread is faster than waking the pool (the tiny model's 64x64
# experts take microseconds); both paths run the same row dot and give the same bits.
PARALLEL_MIN_WEIGHTS = 2**17

ISA_CODES = {"portable": 0, "avx2": 1, "avx512": 2}

_DOUBLED_E2M1 = (2.0 * E2M1_VALUES).astype(np.float32)  # [16] V, exact integers
_HALF_SCALES = (scale_bytes_to_f32(np.arange(256, dtype=np.uint8)) * np.float32(0.5)).astype(np.float32)  # [256]


def _host_features() -> set[str]:
    """CPU features numba compiles for: the host's, unless numba was told to target another CPU."""
    if numba_config.CPU_NAME is not None or numba_config.CPU_FEATURES is not None:
        return set()
    import llvmlite.binding as llvm

    return {name for name, present in llvm.get_host_cpu_features().items() if present}


_FEATURES = _host_features()
AVAILABLE_ISAS: tuple[str, ...] = tuple(
    name for name, needs in (("portable", ()), ("avx2", ("avx2", "fma", "f16c")), ("avx512", ("avx512f", "avx512bw", "fma", "f16c")))
    if all(feature in _FEATURES for feature in needs)
)
ISA: str = os.environ.get("K3SERVE_MXFP4_ISA", AVAILABLE_ISAS[-1])  # debug toggle: force a slower path
if ISA not in AVAILABLE_ISAS:
    raise RuntimeError(f"K3SERVE_MXFP4_ISA={ISA!r} is not available on this CPU (available: {AVAILABLE_ISAS})")


# ------------------------------------------------------------------------------------------- the row dot
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I8 = ir.IntType(8)


def _vector(element: ir.Type, count: int) -> ir.VectorType:
    return ir.VectorType(element, count)


def _splat(builder: ir.IRBuilder, value: ir.Value, count: int) -> ir.Value:
    undef = ir.Constant(_vector(value.type, count), ir.Undefined)
    first = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(first, undef, ir.Constant(_vector(_I32, count), [0] * count))


def _opaque(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """`v` through an empty inline asm (no instruction): LLVM cannot see that it is a splat, so it keeps a vector
    operation on it as one (instcombine rewrites a binary operation on two splats as a scalar one, then a broadcast)."""
    return builder.asm(ir.FunctionType(v.type, [v.type]), "", "=v,0", [v], False)


def _pairwise_sum(builder: ir.IRBuilder, v: ir.Value, count: int) -> ir.Value:
    """Sum of the lanes as a fixed tree: (lanes [0, n/2) + lanes [n/2, n)) recursively."""
    while count > 1:
        half = count // 2
        low = builder.shuffle_vector(v, v, ir.Constant(_vector(_I32, half), list(range(half))))
        high = builder.shuffle_vector(v, v, ir.Constant(_vector(_I32, half), list(range(half, count))))
        v, count = builder.fadd(low, high), half
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _load(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value, vector_type: ir.VectorType, align: int):
    return builder.load(builder.bitcast(builder.gep(base, [offset]), vector_type.as_pointer()), align=align)


def _nibble_lookup(builder: ir.IRBuilder, lanes: int):
    """A function of `builder` that maps i32 lanes holding MXFP4 nibbles (bits above the 4th ignored) to float32
    lanes V[nibble] (the doubled E2M1 values): AVX-512's vpermps over the 16-entry table, or AVX2's over its 8
    magnitudes with the nibble's sign bit moved into the float's."""
    vf, vi = _vector(_F32, lanes), _vector(_I32, lanes)
    if lanes == 16:
        permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vi]),
                                                 "llvm.x86.avx512.permvar.sf.512")
        table = ir.Constant(vf, [float(v) for v in _DOUBLED_E2M1])
    else:
        permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vi]), "llvm.x86.avx2.permps")
        table = ir.Constant(vf, [float(v) for v in _DOUBLED_E2M1[:8]])

    def lookup(nibbles):
        values = builder.call(permute, [table, nibbles])
        if lanes == 16:
            return values
        sign = builder.shl(builder.and_(nibbles, ir.Constant(vi, [8] * lanes)), ir.Constant(vi, [28] * lanes))
        return builder.bitcast(builder.xor(builder.bitcast(values, vi), sign), vf)

    return lookup


def _row_dot_codegen(lanes: int, num_rows: int = 1, num_tokens: int = 1):
    """IR of the row dot with `lanes` float32 lanes (16: AVX-512 vpermd, 8: AVX2 vpermps and a sign flip), for
    `num_rows` rows of the same matrix against `num_tokens` permuted x rows in one pass (args: the rows' packed
    bytes, their scale bytes, the x rows, half_scales; results row-major: row 0 against each x, then row 1...). Each
    (row, x) keeps its own accumulator with exactly the one-row operation order, so every dot has the bits of the
    one-row dot; the independent FMA chains overlap (one row alone waits ~4 cycles a group on its accumulator), x is
    loaded once for all rows and each row is decoded once for all x (the prefill tile: 2 rows x 4 tokens)."""

    def codegen(context, builder, signature, args):
        prow_ts, srow_ts = signature.args[:num_rows], signature.args[num_rows:2 * num_rows]
        prows = [context.make_array(t)(context, builder, a) for t, a in zip(prow_ts, args[:num_rows])]
        srows = [context.make_array(t)(context, builder, a) for t, a in zip(srow_ts, args[num_rows:2 * num_rows])]
        xs = [context.make_array(t)(context, builder, a)
              for t, a in zip(signature.args[2 * num_rows:2 * num_rows + num_tokens],
                              args[2 * num_rows:2 * num_rows + num_tokens])]
        last = 2 * num_rows + num_tokens
        half_scales = context.make_array(signature.args[last])(context, builder, args[last])
        (num_groups,) = cgutils.unpack_tuple(builder, srows[0].shape, 1)
        module = builder.module
        vf, vi, vb = _vector(_F32, lanes), _vector(_I32, lanes), _vector(_I8, lanes)
        fma = cgutils.get_or_insert_function(module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{lanes}f32")
        lookup = _nibble_lookup(builder, lanes)
        acc_slots = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * lanes)) for _ in range(num_tokens)]
                     for _ in range(num_rows)]
        index_type = ir.IntType(64)
        parts = BYTES_PER_GROUP // lanes  # 1 part of 16 lanes, or 2 parts of 8
        with cgutils.for_range(builder, num_groups) as loop:
            group = loop.index
            byte_base = builder.mul(group, ir.Constant(index_type, BYTES_PER_GROUP))
            x_base = builder.mul(group, ir.Constant(index_type, GROUP_SIZE))
            x_parts = [[tuple(_load(builder, x.data, builder.add(x_base, ir.Constant(index_type, half + p * lanes)),
                                    vf, 4) for half in (0, BYTES_PER_GROUP)) for p in range(parts)] for x in xs]
            for prow, srow, row_slots in zip(prows, srows, acc_slots):
                scale_byte = builder.load(builder.gep(srow.data, [group]))
                multiplier = _splat(builder, builder.load(builder.gep(half_scales.data,
                                                                      [builder.zext(scale_byte, index_type)])), lanes)
                accs = [builder.load(slot) for slot in row_slots]
                for part in range(parts):
                    offset = part * lanes
                    packed = builder.zext(_load(builder, prow.data,
                                                builder.add(byte_base, ir.Constant(index_type, offset)), vb, 1), vi)
                    low = lookup(packed)
                    high = lookup(builder.lshr(packed, ir.Constant(vi, [4] * lanes)))
                    for t in range(num_tokens):
                        x_even, x_odd = x_parts[t][part]
                        pair = builder.call(fma, [high, x_odd, builder.fmul(low, x_even)])
                        accs[t] = builder.call(fma, [pair, multiplier, accs[t]])
                for slot, acc in zip(row_slots, accs):
                    builder.store(acc, slot)
        totals = [_pairwise_sum(builder, builder.load(slot), lanes) for row_slots in acc_slots for slot in row_slots]
        if num_rows * num_tokens == 1:
            return totals[0]
        return context.make_tuple(builder, signature.return_type, totals)

    return codegen


def _unavailable_codegen(context, builder, signature, args):
    # never executed: kernels route around an instruction set the host lacks (see `_row_dot`)
    return ir.Constant(_F32, float("nan"))


@intrinsic
def _row_dot_avx512(typingctx, prow, srow, x, half_scales):
    """sum_c W[r, c] x[c] for one MXFP4 row: prow u8 [C/2], srow u8 [G], x f32 [C] permuted, 16 lanes."""
    codegen = _row_dot_codegen(16) if "avx512" in AVAILABLE_ISAS else _unavailable_codegen
    return types.float32(prow, srow, x, half_scales), codegen


@intrinsic
def _row_dot_avx2(typingctx, prow, srow, x, half_scales):
    """The same row dot on 8 lanes (AVX2)."""
    codegen = _row_dot_codegen(8) if "avx2" in AVAILABLE_ISAS else _unavailable_codegen
    return types.float32(prow, srow, x, half_scales), codegen


@njit(cache=True, fastmath={"reassoc", "contract", "nsz"})
def _row_dot_portable(prow: np.ndarray, srow: np.ndarray, x: np.ndarray, half_scales: np.ndarray) -> np.float32:
    """The row dot in plain numba: V[n] from float arithmetic (|V| for n & 7 = m is m + max(m - 4, 0) +
    2 max(m - 6, 0)), which the compiler vectorizes without a table lookup."""
    total = np.float32(0.0)
    for group in range(srow.shape[0]):
        byte_base = group * BYTES_PER_GROUP
        x_base = group * GROUP_SIZE
        partial = np.float32(0.0)
        for j in range(BYTES_PER_GROUP):
            byte = np.float32(prow[byte_base + j])
            high = np.floor(byte * np.float32(0.0625))
            low = byte - np.float32(16.0) * high
            partial += _nibble_value(low) * x[x_base + j] + _nibble_value(high) * x[x_base + BYTES_PER_GROUP + j]
        total += partial * half_scales[srow[group]]
    return total


@njit(inline="always", fastmath={"reassoc", "contract", "nsz"})
def _nibble_value(nibble: np.float32) -> np.float32:
    negative = nibble >= np.float32(8.0)
    m = nibble - np.float32(8.0) if negative else nibble
    magnitude = m + max(m - np.float32(4.0), np.float32(0.0)) + np.float32(2.0) * max(m - np.float32(6.0),
                                                                                     np.float32(0.0))
    return -magnitude if negative else magnitude


@njit(inline="always")
def _row_dot(prow: np.ndarray, srow: np.ndarray, x: np.ndarray, half_scales: np.ndarray, isa: int) -> np.float32:
    if isa == 2:
        return _row_dot_avx512(prow, srow, x, half_scales)
    if isa == 1:
        return _row_dot_avx2(prow, srow, x, half_scales)
    return _row_dot_portable(prow, srow, x, half_scales)


def _unavailable_rows_codegen(context, builder, signature, args):
    # never executed, as `_unavailable_codegen`
    nan = ir.Constant(_F32, float("nan"))
    return context.make_tuple(builder, signature.return_type, [nan] * signature.return_type.count)


def _row_dots_intrinsic(isa: str, num_rows: int, num_tokens: int = 1):
    """Typer of the `num_rows`-row dot on `isa`: (prow_0, .., prow_{n-1}, srow_0, .., srow_{n-1}, x_0, ..,
    x_{t-1}, half_scales) -> num_rows x num_tokens float32 (row-major), each with the bits of the one-row dot."""
    lanes = {"avx512": 16, "avx2": 8}[isa]

    def typer(typingctx, *arrays):
        if len(arrays) != 2 * num_rows + num_tokens + 1:
            return None
        codegen = (_row_dot_codegen(lanes, num_rows, num_tokens) if isa in AVAILABLE_ISAS
                   else _unavailable_rows_codegen)
        return types.UniTuple(types.float32, num_rows * num_tokens)(*arrays), codegen

    return typer


@intrinsic
def _row_dots2_avx512(typingctx, p0, p1, s0, s1, x, half_scales):
    """Two MXFP4 rows . the same permuted x, 16 lanes: (row 0 dot, row 1 dot)."""
    return _row_dots_intrinsic("avx512", 2)(typingctx, p0, p1, s0, s1, x, half_scales)


@intrinsic
def _row_dots2_avx2(typingctx, p0, p1, s0, s1, x, half_scales):
    """The same two dots on 8 lanes (AVX2)."""
    return _row_dots_intrinsic("avx2", 2)(typingctx, p0, p1, s0, s1, x, half_scales)


@intrinsic
def _row_dots4_avx512(typingctx, p0, p1, p2, p3, s0, s1, s2, s3, x, half_scales):
    """Four MXFP4 rows . the same permuted x, 16 lanes."""
    return _row_dots_intrinsic("avx512", 4)(typingctx, p0, p1, p2, p3, s0, s1, s2, s3, x, half_scales)


@intrinsic
def _row_dots4_avx2(typingctx, p0, p1, p2, p3, s0, s1, s2, s3, x, half_scales):
    """The same four dots on 8 lanes (AVX2)."""
    return _row_dots_intrinsic("avx2", 4)(typingctx, p0, p1, p2, p3, s0, s1, s2, s3, x, half_scales)


@intrinsic
def _row_dots_2x4_avx512(typingctx, p0, p1, s0, s1, x0, x1, x2, x3, half_scales):
    """Two MXFP4 rows . four permuted x rows, 16 lanes: (p0.x0, p0.x1, p0.x2, p0.x3, p1.x0, .., p1.x3)."""
    return _row_dots_intrinsic("avx512", 2, 4)(typingctx, p0, p1, s0, s1, x0, x1, x2, x3, half_scales)


@intrinsic
def _row_dots_2x4_avx2(typingctx, p0, p1, s0, s1, x0, x1, x2, x3, half_scales):
    """The same eight dots on 8 lanes (AVX2)."""
    return _row_dots_intrinsic("avx2", 2, 4)(typingctx, p0, p1, s0, s1, x0, x1, x2, x3, half_scales)


# The instruction set the prefill tiles are compiled for: the host's best vector one (0: none, no tiles). Other
# instruction sets (a debug toggle, the tests) run their one-token dots at every count, so each still gives a
# token the same bits at every count; compiling the tile for all three cost ~25 s of a cold start.
_TILE_ISA = ISA_CODES[AVAILABLE_ISAS[-1]]


@njit(inline="always")
def _row_dots_2x4(p0, p1, s0, s1, x0, x1, x2, x3, half_scales):
    """The `_row_dot` of two rows against four x rows in one pass (row-major results), on `_TILE_ISA`."""
    if _TILE_ISA == 2:
        return _row_dots_2x4_avx512(p0, p1, s0, s1, x0, x1, x2, x3, half_scales)
    return _row_dots_2x4_avx2(p0, p1, s0, s1, x0, x1, x2, x3, half_scales)


@njit(inline="always")
def _row_dots2(p0, p1, s0, s1, x, half_scales, isa):
    """(`_row_dot` of row 0, of row 1) in one pass over x; the portable path runs the one-row dot twice."""
    if isa == 2:
        return _row_dots2_avx512(p0, p1, s0, s1, x, half_scales)
    if isa == 1:
        return _row_dots2_avx2(p0, p1, s0, s1, x, half_scales)
    return _row_dot_portable(p0, s0, x, half_scales), _row_dot_portable(p1, s1, x, half_scales)


@njit(inline="always")
def _row_dots4(p0, p1, p2, p3, s0, s1, s2, s3, x, half_scales, isa):
    """The `_row_dot` of four rows in one pass over x."""
    if isa == 2:
        return _row_dots4_avx512(p0, p1, p2, p3, s0, s1, s2, s3, x, half_scales)
    if isa == 1:
        return _row_dots4_avx2(p0, p1, p2, p3, s0, s1, s2, s3, x, half_scales)
    return (_row_dot_portable(p0, s0, x, half_scales), _row_dot_portable(p1, s1, x, half_scales),
            _row_dot_portable(p2, s2, x, half_scales), _row_dot_portable(p3, s3, x, half_scales))


@njit
def _rows_dot_tiles(packed, scales, xs, half_scales, row, row_end, first, last, out):
    """`_rows_dot_into`'s prefill pass: rows in pairs against four x rows at a time, the last 1-3 x rows a pair at a
    time; returns the first row left (an odd last one). A function of its own, called, not inlined: inlined into
    the one-token loop it cost that loop ~20% (an expert's one-token dots 3.7 -> 4.5 ms at Qwen3-30B-A3B's shape)."""
    while row + 2 <= row_end:
        n = first
        while n + 4 <= last:
            a0, a1, a2, a3, b0, b1, b2, b3 = _row_dots_2x4(packed[row], packed[row + 1], scales[row], scales[row + 1],
                                                           xs[n], xs[n + 1], xs[n + 2], xs[n + 3], half_scales)
            out[n, row], out[n + 1, row], out[n + 2, row], out[n + 3, row] = a0, a1, a2, a3
            out[n, row + 1], out[n + 1, row + 1], out[n + 2, row + 1], out[n + 3, row + 1] = b0, b1, b2, b3
            n += 4
        while n < last:
            out[n, row], out[n, row + 1] = _row_dots2(packed[row], packed[row + 1], scales[row], scales[row + 1],
                                                      xs[n], half_scales, _TILE_ISA)
            n += 1
        row += 2
    return row


@njit(inline="always")
def _rows_dot_into(packed, scales, xs, half_scales, isa, rows_per_dot, row, row_end, first, last, out):
    """out[n, r] = `_row_dot`(row r of packed, xs[n]) for r in row:row_end, n in first:last: `rows_per_dot` rows
    (1, 2 or 4) a pass over xs[n] while that many are left, then pairs, then single rows; rows outer, so a row's
    bytes stay in L1 for all n. From MXFP4_TILE_TOKENS x rows on, rows in pairs against four x rows a pass
    (`_row_dots_2x4`: each row decoded once for four tokens). Every output has the one-row dot's bits."""
    if isa == _TILE_ISA and isa != 0 and last - first >= MXFP4_TILE_TOKENS:
        row = _rows_dot_tiles(packed, scales, xs, half_scales, row, row_end, first, last, out)
    while rows_per_dot >= 4 and row + 4 <= row_end:
        for n in range(first, last):
            a, b, c, d = _row_dots4(packed[row], packed[row + 1], packed[row + 2], packed[row + 3], scales[row],
                                    scales[row + 1], scales[row + 2], scales[row + 3], xs[n], half_scales, isa)
            out[n, row], out[n, row + 1], out[n, row + 2], out[n, row + 3] = a, b, c, d
        row += 4
    while rows_per_dot >= 2 and row + 2 <= row_end:
        for n in range(first, last):
            a, b = _row_dots2(packed[row], packed[row + 1], scales[row], scales[row + 1], xs[n], half_scales, isa)
            out[n, row], out[n, row + 1] = a, b
        row += 2
    for r in range(row, row_end):
        for n in range(first, last):
            out[n, r] = _row_dot(packed[r], scales[r], xs[n], half_scales, isa)


# ------------------------------------------------------------------------------------------- matmul
@njit(cache=True)
def permute_groups(x: np.ndarray, out: np.ndarray) -> None:
    """out[t, 32 g + 16 p + j] = x[t, 32 g + 2 j + p]: each group of 32 as [16 even | 16 odd]. x, out [T, C]."""
    for t in range(x.shape[0]):
        for base in range(0, x.shape[1], GROUP_SIZE):
            for j in range(BYTES_PER_GROUP):
                out[t, base + j] = x[t, base + 2 * j]
                out[t, base + BYTES_PER_GROUP + j] = x[t, base + 2 * j + 1]


@njit(inline="always")
def _permuted_index(i: int) -> int:
    """Where element i of a vector goes under `permute_groups`."""
    return (i // GROUP_SIZE) * GROUP_SIZE + (i % 2) * BYTES_PER_GROUP + (i % GROUP_SIZE) // 2


@njit(inline="always")
def _matmul_task(packed, scales, xp, half_scales, isa, out, task, rows_per_dot):
    row_end = min(packed.shape[0], (task + 1) * ROWS_PER_TASK)
    _rows_dot_into(packed, scales, xp, half_scales, isa, rows_per_dot, task * ROWS_PER_TASK, row_end, 0, xp.shape[0],
                   out)


@njit(cache=True, parallel=True)
def _matmul_parallel(packed, scales, xp, half_scales, isa, out, rows_per_dot=MXFP4_ROWS_PER_DOT):
    """out [T, R] = x W^T; packed u8 [R, C/2], scales u8 [R, G], xp f32 [T, C] permuted. rows_per_dot (1, 2, 4):
    rows a pass of the row dot; every value gives the same bits."""
    for task in prange((packed.shape[0] + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        _matmul_task(packed, scales, xp, half_scales, isa, out, task, rows_per_dot)


@njit(cache=True)
def _matmul_serial(packed, scales, xp, half_scales, isa, out, rows_per_dot=MXFP4_ROWS_PER_DOT):
    for task in range((packed.shape[0] + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        _matmul_task(packed, scales, xp, half_scales, isa, out, task, rows_per_dot)


def _rows_contiguous(array: np.ndarray) -> np.ndarray:
    """`array` itself when each of its rows is contiguous (what the row dot reads: a row's data pointer and
    length), else a C-contiguous copy."""
    array = np.asarray(array)
    if array.ndim == 2 and (array.shape[1] <= 1 or array.strides[1] == array.itemsize) and array.strides[0] >= 0:
        return array
    return np.ascontiguousarray(array)


def _check_operands(packed: np.ndarray, scales: np.ndarray, x: np.ndarray) -> tuple[int, int]:
    rows, cols = check_mxfp4_shapes(packed, scales)
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be [T, {cols}] to multiply an MXFP4 [{rows}, {cols}] matrix, got {x.shape}")
    return rows, cols


def _isa_code(isa: str | None) -> int:
    name = ISA if isa is None else isa
    if name not in AVAILABLE_ISAS:
        raise ValueError(f"instruction set {name!r} is not available here (available: {AVAILABLE_ISAS})")
    return ISA_CODES[name]


def mxfp4_matmul(packed: np.ndarray, scales: np.ndarray, x: np.ndarray, out: np.ndarray | None = None,
                 isa: str | None = None) -> np.ndarray:
    """x @ dequantize_mxfp4(packed, scales).T without building the float matrix.

    packed u8 [R, C/2], scales u8 [R, C/32], x float32 [T, C] (other layouts/dtypes are converted) -> [T, R].
    packed and scales may be row-strided views (each row's bytes contiguous, rows at any stride: an MXFP4 trunk
    matrix laid out by rows, `weights.quantized`), multiplied in place; other layouts are copied. `out`, if given,
    must be a C-contiguous float32 [T, R] array and is filled and returned. `isa` picks the instruction set
    (default: the best this CPU has)."""
    packed = _rows_contiguous(packed)
    scales = _rows_contiguous(scales)
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = _check_operands(packed, scales, x)
    num_tokens = x.shape[0]
    if out is None:
        out = np.empty((num_tokens, rows), dtype=np.float32)  # [T, R]
    elif out.shape != (num_tokens, rows) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(
            f"out must be a C-contiguous float32 [{num_tokens}, {rows}] array, got {out.dtype} {out.shape}"
        )
    if num_tokens == 0 or rows == 0:
        return out
    code = _isa_code(isa)
    xp = np.empty_like(x)  # [T, C]
    permute_groups(x, xp)
    kernel = _matmul_parallel if rows * cols >= PARALLEL_MIN_WEIGHTS else _matmul_serial
    kernel(packed, scales, xp, _HALF_SCALES, code, out, MXFP4_ROWS_PER_DOT)
    return out


def mxfp4_matmul_reference(packed: np.ndarray, scales: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The slow twin of `mxfp4_matmul`: dequantize to float32 [R, C], then one numpy matmul. -> f32 [T, R]."""
    x = np.asarray(x, dtype=np.float32)
    _check_operands(np.asarray(packed), np.asarray(scales), x)
    return x @ dequantize_mxfp4(packed, scales).T  # [T, R]


# ------------------------------------------------------------------------------------------- Q8_0 trunk matrices
# A dense trunk matrix in llama.cpp's Q8_0 bytes (`k3serve.weights.q8_0`: per row, blocks of 34 bytes, an f16
# scale d_w then 32 int8 q_w), multiplied as llama.cpp multiplies it: the activation row is quantized to Q8_0 too
# (blocks of 32, scale d_x = max|x| / 127 rounded to half, q_x = roundf(x / d_x)), then
#
#     y[t, r] = sum_g (d_w[r, g] d_x[t, g]) * S[t, r, g],    S[t, r, g] = sum_{k < 32} q_w[r, 32 g + k] q_x[t, 32 g + k]
#
# Each block sum S is an exact int32, so its order is free; the float order is fixed, the same on every path:
# eight accumulators, block g into accumulator g mod 8 by one FMA, a_m = fma(float(S), d_w d_x, a_m) in increasing
# g (the product d_w d_x rounded to float32 first), then ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)). Hence a
# token's output has the same bits whatever T, the other tokens, rows and threads, and the instruction set.
# - One token (decode; `_q8_0_dot_codegen`): the lanes are the 8 accumulators. A block's 32 products go into 8
#   int32 lanes (|q_w| times q_x with q_w's sign: AVX-512 VNNI's vpdpbusd, or AVX2's vpmaddubsw then vpmaddwd by
#   ones; |q_w| <= 128 and |q_x| <= 127 never saturate); 8 blocks' lanes are summed into one vector of 8 block
#   sums (a transpose by shuffles and integer adds), then one FMA scales them by 8 products at once.
# - Several tokens (prefill, decode batches; `_q8_0_tile_codegen`): the lanes are tokens, 16 (AVX-512 VNNI) or 8.
#   The activations are laid out [G, 9, N, 4] (`_q8_0_tiles`): 4 bytes of each token side by side, so that
#   4 weight bytes, broadcast to every lane from memory, multiply 16 tokens at once, and a block's sum for every
#   token is 8 vpdpbusd with no lane sum; one convert, one multiply and one FMA a block then serve all the lanes
#   (the previous layout spent the scale product d_w d_x on every token and block: a fifth of its time). vpdpbusd
#   multiplies unsigned by signed bytes, so in a call of more than 8 tokens the activations are stored + 128 and
#   each block's 128 sum q_w (`_q8_0_row_prepare`, once a row and call) is taken off before the conversion; in a
#   call of 8 or fewer (a decode batch) the 8-lane tile multiplies the weight bytes + 128 by q_x as it is and takes
#   off -128 sum q_x (the layout's 9th word), with nothing to prepare. AVX2 multiplies |q_w| by q_x with q_w's sign
#   (vpmaddubsw). Two rows a pass share each activation load (one row alone took ~1.8x as long a row from L2); a
#   matrix's 8 tokens, in L1, run a row a pass. From Q8_0_TILE_MIN_TOKENS tokens, rows of more than 8 blocks
#   (`_q8_0_dots_only`); the rest run one dot per token.
# Plain numba (portable) takes each block's integer sum, then the same 8 accumulators with a separate multiply and
# an add in float64 (the same bits as the vector paths unless the float64 sum rounds onto a float32 tie).
Q8_0_BLOCK_BYTES = 34
Q8_0_LANES = 8  # accumulators (float order, above)
_F16_TO_F32 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)  # [65536] scale table
_Q8_0_VNNI = "avx512vnni" in _FEATURES and "avx512vl" in _FEATURES
Q8_0_TILE_MIN_TOKENS = 4  # from this many tokens a row runs tiles (the last one padded) rather than one dot each
# An expert's run of pairs from which its rows run tiles: runs of 4-7 (64 tokens over 128 experts) ran 1.13x the
# previous kernels as one dot per token and 0.88x as a padded tile, whose rows' prepared sums serve one tile only
# (in-process A/B, docs/BENCHMARKS.md); a run's last 4-7 tokens after whole tiles still take a tile.
Q8_0_EXPERT_TILE_MIN_TOKENS = 8


def _q8_0_isa_ops(builder: ir.IRBuilder, vnni: bool, lanes: int):
    """(lane_sums(acc, unsigned, signed) -> acc + int32 lanes of 4 products each, absolute, psign) on `lanes` int32
    lanes; absolute and psign (declared at their first use) exist for 32-byte vectors only."""
    module = builder.module
    vb, vi = _vector(_I8, 4 * lanes), _vector(_I32, lanes)

    def absolute(v):
        fn = cgutils.get_or_insert_function(module, ir.FunctionType(vb, [vb, ir.IntType(1)]), "llvm.abs.v32i8")
        return builder.call(fn, [v, ir.Constant(ir.IntType(1), 0)])

    def psign(x, w):
        fn = cgutils.get_or_insert_function(module, ir.FunctionType(vb, [vb, vb]), "llvm.x86.avx2.psign.b")
        return builder.call(fn, [x, w])

    if vnni:
        dpbusd = cgutils.get_or_insert_function(module, ir.FunctionType(vi, [vi, vi, vi]),
                                                f"llvm.x86.avx512.vpdpbusd.{32 * lanes}")

        def lane_sums(acc, unsigned, signed):
            return builder.call(dpbusd, [acc, builder.bitcast(unsigned, vi), builder.bitcast(signed, vi)])
    else:
        vw = _vector(ir.IntType(16), 2 * lanes)
        maddubs = cgutils.get_or_insert_function(module, ir.FunctionType(vw, [vb, vb]), "llvm.x86.avx2.pmadd.ub.sw")
        maddwd = cgutils.get_or_insert_function(module, ir.FunctionType(vi, [vw, vw]), "llvm.x86.avx2.pmadd.wd")
        ones = ir.Constant(vw, [1] * (2 * lanes))

        def lane_sums(acc, unsigned, signed):
            return builder.add(acc, builder.call(maddwd, [builder.call(maddubs, [unsigned, signed]), ones]))
    return lane_sums, absolute, psign


def _combine_accumulators(builder: ir.IRBuilder, accs: list) -> ir.Value:
    """((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)): `_pairwise_sum`'s tree over 8 lanes, on 8 values."""
    half = [builder.fadd(accs[i], accs[i + 4]) for i in range(4)]
    quarter = [builder.fadd(half[i], half[i + 2]) for i in range(2)]
    return builder.fadd(quarter[0], quarter[1])


def _block_sums8(builder: ir.IRBuilder, parts: list) -> ir.Value:
    """8 vectors of 8 int32 lanes -> one vector whose lane b is the sum of vector b's lanes (exact: any order)."""
    def level(a, b, first, second):
        return builder.add(builder.shuffle_vector(a, b, ir.Constant(_vector(_I32, 8), first)),
                           builder.shuffle_vector(a, b, ir.Constant(_vector(_I32, 8), second)))
    pairs = [level(parts[i], parts[i + 1], [0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15])
             for i in range(0, 8, 2)]  # lanes: b0 b1 b0 b1 ... (pair sums)
    quads = [level(pairs[i], pairs[i + 1], [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])
             for i in range(0, 4, 2)]  # b0 b1 b2 b3 (lanes 0-3 of each), b0 b1 b2 b3 (lanes 4-7)
    return level(quads[0], quads[1], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])


def _q8_0_dot_codegen(isa: str, split: bool = False, num_rows: int = 1):
    """IR of sum_c W[r, c] x[c] for one token (see above: lanes = the 8 accumulators). Arguments (wrow_0 ..
    wrow_{n-1}, xq int8 [C], xd f32 [G]): rows of 34-byte blocks; with `split` (wrow int8 [C], wscales [G] float32
    or half-precision bits uint16, xq, xd), a GGUF's Q8_0 experts as the families hold them (the same operations on
    the same numbers). `num_rows` > 1: n rows against one activation row, its bytes loaded once a block for all."""
    lanes = Q8_0_LANES
    first_x = 2 if split else num_rows
    assert num_rows == 1 or not split

    def codegen(context, builder, signature, args):
        wrows = [context.make_array(signature.args[r])(context, builder, args[r]) for r in range(num_rows)]
        wscales = context.make_array(signature.args[1])(context, builder, args[1]) if split else None
        half_scales = split and signature.args[1].dtype == types.uint16
        xq, xd = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (first_x, first_x + 1))
        (num_groups,) = cgutils.unpack_tuple(builder, xd.shape, 1)
        index_type = ir.IntType(64)
        i16, half = ir.IntType(16), ir.HalfType()
        vb, vi, vf = _vector(_I8, 32), _vector(_I32, lanes), _vector(_F32, lanes)
        lane_sums, absolute, psign = _q8_0_isa_ops(builder, isa == "avx512" and _Q8_0_VNNI, lanes)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), "llvm.fma.v8f32")
        x_ptr = builder.bitcast(xq.data, _I8.as_pointer())
        zero_i, zero_f = ir.Constant(vi, [0] * lanes), ir.Constant(vf, [0.0] * lanes)
        acc_slots = [cgutils.alloca_once_value(builder, zero_f) for _ in range(num_rows)]

        def const(v):
            return ir.Constant(index_type, v)

        def block_sums(row, group, x):
            """int32 lanes of row's block `group` against x (32 bytes), 4 products each."""
            if split:
                weights = _load(builder, builder.bitcast(row.data, _I8.as_pointer()),
                                builder.mul(group, const(GROUP_SIZE)), vb, 1)
            else:
                weights = _load(builder, row.data, builder.add(builder.mul(group, const(Q8_0_BLOCK_BYTES)),
                                                                const(2)), vb, 1)
            return lane_sums(zero_i, absolute(weights), psign(x, weights))

        def scale_bits(row, group):
            """The block's half-precision scale bits (i16) of a row of 34-byte blocks."""
            return builder.load(builder.bitcast(builder.gep(row.data, [builder.mul(group, const(Q8_0_BLOCK_BYTES))]),
                                                i16.as_pointer()), align=1)

        def fold(slot, sums, w_scales, x_scales):
            products = builder.fmul(w_scales, x_scales)
            builder.store(builder.call(fma, [builder.sitofp(_block_sums8(builder, sums), vf), products,
                                             builder.load(slot)]), slot)

        def widen(bits):  # <8 x i16> half bits -> <8 x float>
            return builder.fpext(builder.bitcast(bits, _vector(half, lanes)), vf)

        eights = builder.udiv(num_groups, const(lanes))
        with cgutils.for_range(builder, eights) as loop:
            first = builder.mul(loop.index, const(lanes))
            groups = [builder.add(first, const(b)) for b in range(lanes)]
            xs = [_load(builder, x_ptr, builder.mul(g, const(GROUP_SIZE)), vb, 1) for g in groups]
            x_scales = _load(builder, xd.data, first, vf, 4)
            for row, slot in zip(wrows, acc_slots):
                sums = [block_sums(row, g, x) for g, x in zip(groups, xs)]
                if split and half_scales:
                    w_scales = widen(_load(builder, wscales.data, first, _vector(i16, lanes), 2))
                elif split:
                    w_scales = _load(builder, wscales.data, first, vf, 4)
                else:
                    bits = ir.Constant(_vector(i16, lanes), ir.Undefined)
                    for b, g in enumerate(groups):
                        bits = builder.insert_element(bits, scale_bits(row, g), ir.Constant(_I32, b))
                    w_scales = widen(bits)
                fold(slot, sums, w_scales, x_scales)
        # the last G mod 8 blocks, branch-free: lane b takes block min(done + b, G - 1), and a lane past G gets the
        # activation scale 0, so its product d_w * 0 is 0 and fma(S, 0, a) = a + 0 = a (a is never -0; a NaN or inf
        # d_w is block G - 1's own, which makes the row's dot NaN anyway)
        done = builder.mul(eights, const(lanes))
        last = builder.sub(num_groups, const(1))

        def tail(count: int) -> None:  # lanes 0 .. count - 1 read blocks (clamped), the others zero sums and scales
            groups, valid = [], []
            for b in range(count):
                group = builder.add(done, const(b))
                inside = builder.icmp_unsigned("<", group, num_groups)
                groups.append(builder.select(inside, group, last))
                valid.append(inside)
            xs = [_load(builder, x_ptr, builder.mul(g, const(GROUP_SIZE)), vb, 1) for g in groups]
            x_scales = ir.Constant(vf, [0.0] * lanes)
            for b, (g, inside) in enumerate(zip(groups, valid)):
                scale = builder.select(inside, builder.load(builder.gep(xd.data, [g])), ir.Constant(_F32, 0.0))
                x_scales = builder.insert_element(x_scales, scale, ir.Constant(_I32, b))
            for row, slot in zip(wrows, acc_slots):
                sums = [block_sums(row, g, x) for g, x in zip(groups, xs)] + [zero_i] * (lanes - count)
                if split and not half_scales:  # float32 scales
                    w_scales = ir.Constant(vf, [0.0] * lanes)
                    for b, g in enumerate(groups):
                        w_scales = builder.insert_element(w_scales, builder.load(builder.gep(wscales.data, [g])),
                                                          ir.Constant(_I32, b))
                else:  # half-precision bits, the split array's or the blocks' own
                    bits = ir.Constant(_vector(i16, lanes), [0] * lanes)
                    for b, g in enumerate(groups):
                        scale = builder.load(builder.gep(wscales.data, [g])) if split else scale_bits(row, g)
                        bits = builder.insert_element(bits, scale, ir.Constant(_I32, b))
                    w_scales = widen(bits)
                fold(slot, sums, w_scales, x_scales)

        with builder.if_then(builder.icmp_unsigned("!=", done, num_groups)):  # 1-7 blocks: 4 or 8 lanes' work
            with builder.if_else(builder.icmp_unsigned("<=", builder.sub(num_groups, done), const(4))) as (few, more):
                with few:
                    tail(4)
                with more:
                    tail(lanes)
        totals = [_pairwise_sum(builder, builder.load(slot), lanes) for slot in acc_slots]
        if num_rows == 1:
            return totals[0]
        return context.make_tuple(builder, signature.return_type, totals)

    return codegen


def _q8_0_tile_codegen(isa: str, split: bool = False, num_rows: int = 1, lanes: int = 16, offset: bool = True):
    """IR of `num_rows` Q8_0 rows against `lanes` tokens t0 .. t0 + lanes - 1 (see above: lanes = tokens).
    Arguments (wrow_0 .., wscale_0 .., wcorr_0 .., xt u8 [G, 9, N, 4], dt f32 [G, N], t0, res): each row's 34-byte
    blocks (`split`: its int8 values), its block scales f32 [G] and -128 sum q_w per block i32 [G]
    (`_q8_0_row_prepare`), the activations' tile layout (`_q8_0_tiles`: + 128 with `offset`), res f32 [>= 16
    rows]: row i's dots go to res[16 i:16 i + lanes]. The rows share each activation load (one row alone ran ~1.8x
    as long a row from L2: the loads bound it; running the blocks in L1-sized ranges for all of a task's rows gained
    nothing more, in-process timing 2026-12-07). `lanes`: 16 or 8 with AVX-512 VNNI, 8 otherwise. `offset` False
    (8 lanes): the activations as they are, multiplied on VNNI by the weight bytes + 128 (broadcast) with xt's 9th
    word, -128 sum q_x, as the correction, on AVX2 by the weight bytes' magnitudes with their sign; nothing to
    prepare (a call of 8 tokens or fewer). -> lanes (int64)"""
    chains = 2  # independent integer sums a row and block (exact: 2, 4 or 8 gave the same bits and the same time)
    vnni = isa == "avx512" and _Q8_0_VNNI
    lanes = lanes if vnni and offset else 8
    offset = offset and vnni

    def codegen(context, builder, signature, args):
        arrays = [context.make_array(signature.args[k])(context, builder, args[k]) for k in range(3 * num_rows + 2)]
        wrows, wscales, wcorrs = arrays[:num_rows], arrays[num_rows:2 * num_rows], arrays[2 * num_rows:3 * num_rows]
        xt, dt = arrays[3 * num_rows:]
        t0 = args[3 * num_rows + 2]
        res = context.make_array(signature.args[3 * num_rows + 3])(context, builder, args[3 * num_rows + 3])
        num_groups, words, padded, _ = cgutils.unpack_tuple(builder, xt.shape, 4)
        index_type = ir.IntType(64)
        vb, vi, vf = _vector(_I8, 4 * lanes), _vector(_I32, lanes), _vector(_F32, lanes)
        lane_sums, absolute, psign = _q8_0_isa_ops(builder, vnni, lanes)
        flip = ir.Constant(vi, [-0x7F7F7F80] * lanes)  # 0x80808080: + 128 in each byte
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]),
                                             f"llvm.fma.v{lanes}f32")
        w_ptrs = [builder.bitcast(w.data, _I8.as_pointer()) for w in wrows]
        x_ptr = builder.bitcast(xt.data, _I8.as_pointer())
        stride, skip = (GROUP_SIZE, 0) if split else (Q8_0_BLOCK_BYTES, 2)

        def const(v):
            return ir.Constant(index_type, v)

        zero = ir.Constant(vf, [0.0] * lanes)
        acc_slots = [[cgutils.alloca_once_value(builder, zero) for _ in range(Q8_0_LANES)] for _ in range(num_rows)]

        def block(group, m: int) -> None:
            w_base = builder.add(builder.mul(group, const(stride)), const(skip))
            row_base = builder.mul(group, words)

            def x_at(k: int):
                word_row = builder.mul(builder.add(row_base, const(k)), padded)
                return _load(builder, x_ptr, builder.mul(builder.add(word_row, t0), const(4)), vi, 1)

            zeros = ir.Constant(vi, [0] * lanes)
            if offset:  # the weights' correction, per row
                starts = [_splat(builder, builder.load(builder.gep(wcorr.data, [group])), lanes) for wcorr in wcorrs]
            elif vnni:  # the activations' correction, per token (xt's 9th word)
                starts = [x_at(Q8_0_LANES)] * num_rows
            else:
                starts = [zeros] * num_rows
            sums = [[start] + [zeros] * (chains - 1) for start in starts]
            for k in range(Q8_0_LANES):
                x = x_at(k)
                for r, w_ptr in enumerate(w_ptrs):
                    w = _splat(builder, builder.load(builder.bitcast(
                        builder.gep(w_ptr, [builder.add(w_base, const(4 * k))]), _I32.as_pointer()), align=1), lanes)
                    c = k % chains
                    if offset:  # unsigned activations (+ 128), the weights signed, broadcast
                        sums[r][c] = lane_sums(sums[r][c], x, w)
                    elif vnni:  # unsigned weights (+ 128, broadcast; flipped as a vector: LLVM would flip the
                        # scalar, then broadcast from a register), the activations signed
                        sums[r][c] = lane_sums(sums[r][c], builder.xor(_opaque(builder, w), flip), x)
                    else:  # |w| unsigned, the activations with w's sign
                        wb = builder.bitcast(w, vb)
                        sums[r][c] = lane_sums(sums[r][c], absolute(wb), psign(builder.bitcast(x, vb), wb))
            x_scales = _load(builder, dt.data, builder.add(builder.mul(group, padded), t0), vf, 4)
            for r in range(num_rows):
                parts = sums[r]
                while len(parts) > 1:
                    parts = [builder.add(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
                products = builder.fmul(x_scales, _splat(builder, builder.load(builder.gep(wscales[r].data, [group])),
                                                         lanes))
                slot = acc_slots[r][m]
                builder.store(builder.call(fma, [builder.sitofp(parts[0], vf), products, builder.load(slot)]), slot)

        eights = builder.udiv(num_groups, const(Q8_0_LANES))
        with cgutils.for_range(builder, eights) as loop:
            first = builder.mul(loop.index, const(Q8_0_LANES))
            for m in range(Q8_0_LANES):
                block(builder.add(first, const(m)), m)
        done = builder.mul(eights, const(Q8_0_LANES))
        for m in range(Q8_0_LANES - 1):
            group = builder.add(done, const(m))
            with builder.if_then(builder.icmp_unsigned("<", group, num_groups)):
                block(group, m)
        for r in range(num_rows):
            total = _combine_accumulators(builder, [builder.load(slot) for slot in acc_slots[r]])
            builder.store(total, builder.bitcast(builder.gep(res.data, [const(r * 16)]), vf.as_pointer()), align=4)
        return ir.Constant(ir.IntType(64), lanes)

    return codegen


def _q8_0_prepare_codegen(isa: str, split: bool = False):
    """IR of a row's tile operands for its first G - G mod 8 blocks (`_q8_0_row_prepare` does the rest): the block
    scales as float32 and, for AVX-512 VNNI's tile, -128 sum q_w of each block (8 blocks' sums at once, as the
    one-token dot sums its lanes). Arguments (wrow, wscale f32 [G], wcorr i32 [G]), split (wrow, wscales, wscale,
    wcorr). -> the blocks done (int64)"""
    vnni = isa == "avx512" and _Q8_0_VNNI
    lanes = Q8_0_LANES

    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args)]
        wrow = arrays[0]
        wscales = arrays[1] if split else None
        wscale, wcorr = arrays[-2:]
        half_scales = split and signature.args[1].dtype == types.uint16
        (num_groups,) = cgutils.unpack_tuple(builder, wscale.shape, 1)
        index_type = ir.IntType(64)
        i16, half = ir.IntType(16), ir.HalfType()
        vb, vi, vf = _vector(_I8, 32), _vector(_I32, lanes), _vector(_F32, lanes)
        lane_sums, _, _ = _q8_0_isa_ops(builder, isa == "avx512" and _Q8_0_VNNI, lanes)
        ones = ir.Constant(vb, [1] * 32)

        def const(v):
            return ir.Constant(index_type, v)

        eights = builder.udiv(num_groups, const(lanes))
        with cgutils.for_range(builder, eights) as loop:
            first = builder.mul(loop.index, const(lanes))
            groups = [builder.add(first, const(b)) for b in range(lanes)]
            if split and half_scales:
                bits = _load(builder, wscales.data, first, _vector(i16, lanes), 2)
                scales = builder.fpext(builder.bitcast(bits, _vector(half, lanes)), vf)
            elif split:
                scales = _load(builder, wscales.data, first, vf, 4)
            else:
                bits = ir.Constant(_vector(i16, lanes), ir.Undefined)
                for b, g in enumerate(groups):
                    block_start = builder.gep(wrow.data, [builder.mul(g, const(Q8_0_BLOCK_BYTES))])
                    scale = builder.load(builder.bitcast(block_start, i16.as_pointer()), align=1)
                    bits = builder.insert_element(bits, scale, ir.Constant(_I32, b))
                scales = builder.fpext(builder.bitcast(bits, _vector(half, lanes)), vf)
            builder.store(scales, builder.bitcast(builder.gep(wscale.data, [first]), vf.as_pointer()), align=4)
            if vnni:
                w_ptr = builder.bitcast(wrow.data, _I8.as_pointer())
                sums = []
                for g in groups:
                    offset = (builder.mul(g, const(GROUP_SIZE)) if split else
                              builder.add(builder.mul(g, const(Q8_0_BLOCK_BYTES)), const(2)))
                    sums.append(lane_sums(ir.Constant(vi, [0] * lanes), ones, _load(builder, w_ptr, offset, vb, 1)))
                corrections = builder.mul(_block_sums8(builder, sums), ir.Constant(vi, [-128] * lanes))
                builder.store(corrections, builder.bitcast(builder.gep(wcorr.data, [first]), vi.as_pointer()),
                              align=4)
        return builder.mul(eights, const(lanes))

    return codegen


def _unavailable_tuple_codegen(context, builder, signature, args):
    """NaN for every element of the tuple the signature returns (an instruction set this CPU lacks)."""
    nan = ir.Constant(_F32, float("nan"))
    return context.make_tuple(builder, signature.return_type, [nan] * signature.return_type.count)


def _unavailable_lanes_codegen(context, builder, signature, args):
    """0 lanes computed (an instruction set this CPU lacks; never called there)."""
    return ir.Constant(ir.IntType(64), 0)


def _q8_0_typer(isa: str, split: bool = False, num_rows: int = 1, tile: int = 0, prepare: bool = False,
                offset: bool = True):
    """The typer of a Q8_0 intrinsic: float32 (one dot) or a tuple of `num_rows`; a tile of `tile` lanes or the
    prepare step, which return int64 and write their outputs. NaN (0) where this CPU lacks `isa` (never called
    there: the drivers pick the instruction set)."""
    def typer(typingctx, *operands):
        if tile:  # a row of 34-byte blocks (uint8) or of int8 values (a GGUF's Q8_0 experts as the families hold them)
            values = operands[0].dtype == types.int8
            codegen = (_q8_0_tile_codegen(isa, values, num_rows, tile, offset) if isa in AVAILABLE_ISAS
                       else _unavailable_lanes_codegen)
            return types.int64(*operands), codegen
        if prepare:
            codegen = _q8_0_prepare_codegen(isa, split) if isa in AVAILABLE_ISAS else _unavailable_lanes_codegen
            return types.int64(*operands), codegen
        if num_rows == 1:
            codegen = _q8_0_dot_codegen(isa, split) if isa in AVAILABLE_ISAS else _unavailable_codegen
            return types.float32(*operands), codegen
        codegen = (_q8_0_dot_codegen(isa, num_rows=num_rows) if isa in AVAILABLE_ISAS
                   else _unavailable_tuple_codegen)
        return types.UniTuple(types.float32, num_rows)(*operands), codegen
    return typer


@intrinsic
def _q8_0_row_dot_avx512(typingctx, wrow, xq, xd):
    """One Q8_0 row u8 [G * 34] . activation q int8 [C] with scales f32 [G] (AVX-512 VNNI's vpdpbusd, or the AVX2
    instructions on an AVX-512 CPU without VNNI)."""
    return _q8_0_typer("avx512")(typingctx, wrow, xq, xd)


@intrinsic
def _q8_0_row_dot_avx2(typingctx, wrow, xq, xd):
    """The same row dot (AVX2)."""
    return _q8_0_typer("avx2")(typingctx, wrow, xq, xd)


Q8_0_ROWS_PER_DOT = 4  # weight rows one call of the multi-row dot serves (one token: decode)
# Rows of at most this many blocks go 4 at a time at decode (`_q8_0_matmul_task`): a row of 4 blocks (MLA's W_uk,
# 128 wide) cost ~17 ns alone, the reduction and the call, not its bytes; 4 at a time ran 2-4x faster, hot or
# from memory (8 blocks: 1.9x serial, 1.1x on 2 threads). Longer rows ran 2-3x slower 4 at a time from memory
# (16-64 blocks: four streams 0.5-2 KB apart), so they stay one at a time. In-process A/B, docs/BENCHMARKS.md.
Q8_0_ROWS_MAX_GROUPS = 8


@intrinsic
def _q8_0_rows4_avx512(typingctx, w0, w1, w2, w3, xq, xd):
    """4 Q8_0 rows against one activation row (q int8 [C], scales f32 [G]): 4 dots."""
    return _q8_0_typer("avx512", num_rows=Q8_0_ROWS_PER_DOT)(typingctx, w0, w1, w2, w3, xq, xd)


@intrinsic
def _q8_0_rows4_avx2(typingctx, w0, w1, w2, w3, xq, xd):
    """The same 4 dots (AVX2)."""
    return _q8_0_typer("avx2", num_rows=Q8_0_ROWS_PER_DOT)(typingctx, w0, w1, w2, w3, xq, xd)


@intrinsic
def _q8_0_tile_avx512_8(typingctx, wrow, wscale, wcorr, xt, dt, t0, res):
    """One Q8_0 row (34-byte blocks, or int8 values) against tokens t0 .. t0 + 7, offset activations (AVX-512 VNNI,
    8 lanes: a longer call's last 4-8 tokens)."""
    return _q8_0_typer("avx512", tile=8)(typingctx, wrow, wscale, wcorr, xt, dt, t0, res)


@intrinsic
def _q8_0_tile_avx512_s8(typingctx, wrow, wscale, wcorr, xt, dt, t0, res):
    """One Q8_0 row against tokens t0 .. t0 + 7, the activations as they are (AVX-512 VNNI, 8 lanes: a call of 8
    tokens or fewer)."""
    return _q8_0_typer("avx512", tile=8, offset=False)(typingctx, wrow, wscale, wcorr, xt, dt, t0, res)


@intrinsic
def _q8_0_tile_avx512(typingctx, wrow, wscale, wcorr, xt, dt, t0, res):
    """One Q8_0 row against the tile's tokens t0 .. t0 + 15 (AVX-512 VNNI; 8 without VNNI)."""
    return _q8_0_typer("avx512", tile=16)(typingctx, wrow, wscale, wcorr, xt, dt, t0, res)


@intrinsic
def _q8_0_tile_avx2(typingctx, wrow, wscale, wcorr, xt, dt, t0, res):
    """One Q8_0 row against the tile's tokens t0 .. t0 + 7 (AVX2)."""
    return _q8_0_typer("avx2", tile=16)(typingctx, wrow, wscale, wcorr, xt, dt, t0, res)


@intrinsic
def _q8_0_tile2_avx512_8(typingctx, w0, w1, s0, s1, c0, c1, xt, dt, t0, res):
    """Two Q8_0 rows against tokens t0 .. t0 + 7, offset activations (AVX-512 VNNI, 8 lanes)."""
    return _q8_0_typer("avx512", tile=8, num_rows=2)(typingctx, w0, w1, s0, s1, c0, c1, xt, dt, t0, res)


@intrinsic
def _q8_0_tile2_avx512_s8(typingctx, w0, w1, s0, s1, c0, c1, xt, dt, t0, res):
    """Two Q8_0 rows against tokens t0 .. t0 + 7, the activations as they are (AVX-512 VNNI, 8 lanes)."""
    return _q8_0_typer("avx512", tile=8, num_rows=2, offset=False)(typingctx, w0, w1, s0, s1, c0, c1, xt, dt, t0, res)


@intrinsic
def _q8_0_tile2_avx512(typingctx, w0, w1, s0, s1, c0, c1, xt, dt, t0, res):
    """Two Q8_0 rows against the tile's tokens t0 .. t0 + 15 (AVX-512 VNNI; 8 without VNNI), sharing the loads."""
    return _q8_0_typer("avx512", tile=16, num_rows=2)(typingctx, w0, w1, s0, s1, c0, c1, xt, dt, t0, res)


@intrinsic
def _q8_0_tile2_avx2(typingctx, w0, w1, s0, s1, c0, c1, xt, dt, t0, res):
    """Two Q8_0 rows against the tile's tokens t0 .. t0 + 7 (AVX2)."""
    return _q8_0_typer("avx2", tile=16, num_rows=2)(typingctx, w0, w1, s0, s1, c0, c1, xt, dt, t0, res)


@intrinsic
def _q8_0_prepare_avx512(typingctx, wrow, wscale, wcorr):
    """A row's block scales and VNNI corrections, 8 blocks at a time (`_q8_0_prepare_codegen`)."""
    return _q8_0_typer("avx512", prepare=True)(typingctx, wrow, wscale, wcorr)


@intrinsic
def _q8_0_prepare_avx2(typingctx, wrow, wscale, wcorr):
    """A row's block scales, 8 blocks at a time (AVX2's tile takes no correction)."""
    return _q8_0_typer("avx2", prepare=True)(typingctx, wrow, wscale, wcorr)


@njit(inline="always")
def _q8_0_dot_portable(wrow, wscales, xq, xd, stored):
    """The dot in plain numba: each block's exact int32 sum, then the 8 accumulators (a float32 product d_w d_x, a
    float64 multiply and add for the FMA). `stored`: wrow is a row of 34-byte blocks (wscales unused), else int8
    values with their block scales."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for group in range(xd.shape[0]):
        block_sum = np.int32(0)
        if stored:
            base = group * Q8_0_BLOCK_BYTES
            scale = _F16_TO_F32[np.int64(wrow[base]) | (np.int64(wrow[base + 1]) << 8)] * xd[group]
            for k in range(GROUP_SIZE):
                w = np.int32(wrow[base + 2 + k])
                block_sum += (w - np.int32(256) if w >= 128 else w) * np.int32(xq[group * GROUP_SIZE + k])
        else:
            scale = _block_scale(wscales, group) * xd[group]
            for k in range(GROUP_SIZE):
                block_sum += np.int32(wrow[group * GROUP_SIZE + k]) * np.int32(xq[group * GROUP_SIZE + k])
        # the block's accumulator (g mod 8) is always a0: added to, then rotated to the back
        a0, a1, a2, a3, a4, a5, a6, a7 = a1, a2, a3, a4, a5, a6, a7, np.float32(a0 + np.float64(block_sum) *
                                                                                   np.float64(scale))
    for _ in range((Q8_0_LANES - xd.shape[0] % Q8_0_LANES) % Q8_0_LANES):  # back to a_m in position m
        a0, a1, a2, a3, a4, a5, a6, a7 = a1, a2, a3, a4, a5, a6, a7, a0
    return ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))


@njit(cache=True)
def _q8_0_row_dot_portable(wrow: np.ndarray, xq: np.ndarray, xd: np.ndarray, f16_table: np.ndarray) -> np.float32:
    """The row dot of a row of 34-byte blocks in plain numba (`_q8_0_dot_portable`)."""
    return _q8_0_dot_portable(wrow, f16_table, xq, xd, True)


@njit(inline="always")
def _q8_0_row_dot(wrow, xq, xd, f16_table, isa):
    if isa == 2:
        return _q8_0_row_dot_avx512(wrow, xq, xd)
    if isa == 1:
        return _q8_0_row_dot_avx2(wrow, xq, xd)
    return _q8_0_row_dot_portable(wrow, xq, xd, f16_table)


@njit(inline="always")
def _q8_0_rows4(w0, w1, w2, w3, xq, xd, isa):
    if isa == 2:
        return _q8_0_rows4_avx512(w0, w1, w2, w3, xq, xd)
    return _q8_0_rows4_avx2(w0, w1, w2, w3, xq, xd)


@register_jitable
def _q8_0_dots_only(isa, tokens, groups):
    """Whether a matrix's rows run one dot per token: portable, under Q8_0_TILE_MIN_TOKENS tokens, or rows of at most
    Q8_0_ROWS_MAX_GROUPS blocks (MLA's 128-wide W_uk: 4 rows a pass per token ran 4x the tiles at 8 tokens, whose
    per-row costs 4 blocks do not repay)."""
    return isa == 0 or tokens < Q8_0_TILE_MIN_TOKENS or groups <= Q8_0_ROWS_MAX_GROUPS


@register_jitable
def _q8_0_offset(isa, tokens):
    """Whether the tiles of a call with `tokens` activation rows take them + 128 (AVX-512 VNNI, more than 8 rows:
    16-lane tiles, whose sums of q_w a row, `_q8_0_row_prepare`, serve the call's tiles) or as they are (8-lane
    tiles on the weights + 128: no sums of q_w to prepare; a decode batch)."""
    return isa == 2 and _Q8_0_VNNI and tokens > 8


def _q8_0_tiles(xq: np.ndarray, xd: np.ndarray, isa: int, aligned: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The tiles' activation layout for instruction set `isa` (a code), of xq [..., T, C] and xd [..., T, G]: xt u8
    [..., G, 9, N, 4] and dt f32 [..., G, N] (`_q8_0_tile_codegen`; the leading axes: MLA's heads), or empty arrays
    where the tokens run one dot each (`_q8_0_dots_only`). `aligned`: every tile starts at a
    multiple of its width (a matrix's tokens, not the experts' runs), so N is T rounded up to it (8 tokens of a
    decode batch: 32 bytes a word row, 20 KB at C = 2304, in L1), else T + the width; a long N that is a multiple
    of 16 gets one width more."""
    *lead, tokens, groups = xd.shape
    if _q8_0_dots_only(isa, tokens, groups):
        return np.zeros((*lead, 0, Q8_0_LANES + 1, 0, 4), np.uint8), np.zeros((*lead, 0, 0), np.float32)
    offset = _q8_0_offset(isa, tokens)
    width = 16 if offset else 8
    padded = -(-tokens // width) * width if aligned else tokens + width
    if padded >= 64 and padded % 16 == 0:  # word rows 4 * N bytes apart: not a multiple of 64 lines (L1's sets;
        padded += width  # 512 tokens exactly ran the prefill tile at 0.7x)
    flip = 0x80808080 if offset else 0  # + 128 in each byte (mod 256: the top bit flipped)
    # xt[g, k, t] (k < 8) = bytes 4 k .. 4 k + 3 of token t's block g (a transpose of the rows' 4-byte words), +
    # 128 each with `offset`; xt[g, 8, t] = -128 sum_k q_x (int32), the correction of the unsigned weights (AVX-512
    # VNNI without `offset`). Tokens T .. N - 1 are padding (q_x 0, d_x 0).
    words = np.empty((*lead, groups, Q8_0_LANES + 1, padded), np.uint32)  # [..., G, 9, N]
    source = np.ascontiguousarray(xq).view(np.uint32).swapaxes(-1, -2)  # [..., C / 4, T]
    np.bitwise_xor(source.reshape(*lead, groups, Q8_0_LANES, tokens), np.uint32(flip),
                   out=words[..., :Q8_0_LANES, :tokens])
    words[..., :Q8_0_LANES, tokens:] = flip
    words[..., Q8_0_LANES, :] = 0
    if isa == 2 and _Q8_0_VNNI and not offset:
        sums = xq.reshape(*lead, tokens, groups, GROUP_SIZE).sum(axis=-1, dtype=np.int32)  # [..., T, G]
        words[..., Q8_0_LANES, :tokens] = (sums * np.int32(-128)).swapaxes(-1, -2).view(np.uint32)
    dt = np.zeros((*lead, groups, padded), np.float32)  # [..., G, N]
    dt[..., :tokens] = xd.swapaxes(-1, -2)
    return words.view(np.uint8).reshape(*lead, groups, Q8_0_LANES + 1, padded, 4), dt


@njit(inline="always")
def _q8_0_row_prepare(wrow, f16_table, wscale, wcorr, isa, offset):
    """A row of 34-byte blocks -> its block scales (float32) and -128 sum q_w per block (the VNNI tile's
    correction, where the activations are offset): 8 blocks at a time compiled, the last G mod 8 here."""
    done = 0
    if isa == 2 and offset:
        done = _q8_0_prepare_avx512(wrow, wscale, wcorr)
    elif isa > 0:
        done = _q8_0_prepare_avx2(wrow, wscale, wcorr)
    for group in range(done, wscale.shape[0]):
        base = group * Q8_0_BLOCK_BYTES
        wscale[group] = f16_table[np.int64(wrow[base]) | (np.int64(wrow[base + 1]) << 8)]
        total = np.int32(0)
        for k in range(GROUP_SIZE):
            w = np.int32(wrow[base + 2 + k])
            total += w - np.int32(256) if w >= 128 else w
        wcorr[group] = np.int32(-128) * total


@njit(inline="always")
def _q8_0_tile(wrow, wscale, wcorr, xt, dt, t0, res, isa, narrow, offset):
    """One row's tile (`narrow`: 8 lanes; a row of 34-byte blocks or of int8 values) -> its lanes."""
    if isa == 2:
        if narrow and not offset:
            return _q8_0_tile_avx512_s8(wrow, wscale, wcorr, xt, dt, t0, res)
        if narrow:
            return _q8_0_tile_avx512_8(wrow, wscale, wcorr, xt, dt, t0, res)
        return _q8_0_tile_avx512(wrow, wscale, wcorr, xt, dt, t0, res)
    return _q8_0_tile_avx2(wrow, wscale, wcorr, xt, dt, t0, res)


@njit(inline="always")
def _q8_0_tile2(w0, w1, s0, s1, c0, c1, xt, dt, t0, res, isa, narrow, offset):
    """Two rows' tile (`narrow`: 8 lanes) -> its lanes (row 1's dots at res[16:])."""
    if isa == 2:
        if narrow and not offset:
            return _q8_0_tile2_avx512_s8(w0, w1, s0, s1, c0, c1, xt, dt, t0, res)
        if narrow:
            return _q8_0_tile2_avx512_8(w0, w1, s0, s1, c0, c1, xt, dt, t0, res)
        return _q8_0_tile2_avx512(w0, w1, s0, s1, c0, c1, xt, dt, t0, res)
    return _q8_0_tile2_avx2(w0, w1, s0, s1, c0, c1, xt, dt, t0, res)


@njit(inline="always")
def _q8_0_matmul_task(blocks, xq, xd, xt, dt, f16_table, isa, out, task):
    first, last = task * ROWS_PER_TASK, min(blocks.shape[0], (task + 1) * ROWS_PER_TASK)
    tokens, groups = xd.shape
    if _q8_0_dots_only(isa, tokens, groups):  # one dot per token (decode; short rows)
        # short rows: 4 rows a pass for each token (see Q8_0_ROWS_MAX_GROUPS)
        row = first
        if isa > 0 and groups <= Q8_0_ROWS_MAX_GROUPS:
            while row + Q8_0_ROWS_PER_DOT <= last:
                for t in range(tokens):
                    out[t, row], out[t, row + 1], out[t, row + 2], out[t, row + 3] = _q8_0_rows4(
                        blocks[row], blocks[row + 1], blocks[row + 2], blocks[row + 3], xq[t], xd[t], isa)
                row += Q8_0_ROWS_PER_DOT
        for row in range(row, last):
            for t in range(tokens):
                out[t, row] = _q8_0_row_dot(blocks[row], xq[t], xd[t], f16_table, isa)
        return
    offset = _q8_0_offset(isa, tokens)
    lanes = 16 if offset else 8
    rows = last - first
    wscale = np.empty((rows, groups), np.float32)
    wcorr = np.empty((rows, groups), np.int32)
    res = np.empty(16 * (rows + 1), np.float32)  # row i's dots at res[16 i:]
    for row in range(first, last):
        _q8_0_row_prepare(blocks[row], f16_table, wscale[row - first], wcorr[row - first], isa, offset)
    t = 0
    while tokens - t >= Q8_0_TILE_MIN_TOKENS:  # a tile (the last one padded) against the task's rows
        count = min(lanes, tokens - t)
        narrow = count <= 8
        width = lanes
        single = tokens <= 8  # one tile, its layout in L1: a row a pass (two ran ~12% slower); from L2 two
        for i in range(0, rows, 1 if single else 2):
            if i + 1 < rows and not single:
                width = _q8_0_tile2(blocks[first + i], blocks[first + i + 1], wscale[i], wscale[i + 1], wcorr[i],
                                    wcorr[i + 1], xt, dt, t, res[16 * i:], isa, narrow, offset)
            else:
                width = _q8_0_tile(blocks[first + i], wscale[i], wcorr[i], xt, dt, t, res[16 * i:], isa, narrow,
                                   offset)
        for i in range(rows):
            for j in range(count):
                out[t + j, first + i] = res[16 * i + j]
        t += width
    for row in range(first, last):  # the last 1-3 tokens
        for u in range(t, tokens):
            out[u, row] = _q8_0_row_dot(blocks[row], xq[u], xd[u], f16_table, isa)


@njit(cache=True, parallel=True)
def _q8_0_matmul_parallel(blocks, xq, xd, xt, dt, f16_table, isa, out):
    """out [T, R] = x W^T; blocks u8 [R, G * 34], xq int8 [T, C], xd f32 [T, G], (xt, dt) their tile layout."""
    for task in prange((blocks.shape[0] + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        _q8_0_matmul_task(blocks, xq, xd, xt, dt, f16_table, isa, out, task)


@njit(cache=True)
def _q8_0_matmul_serial(blocks, xq, xd, xt, dt, f16_table, isa, out):
    for task in range((blocks.shape[0] + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        _q8_0_matmul_task(blocks, xq, xd, xt, dt, f16_table, isa, out, task)


def _block_scale(scales, index):
    """scales[index] as float32: float32 scales as they are, half-precision bits (uint16) widened (compiled only)."""
    raise NotImplementedError("compiled code only")


@overload(_block_scale, inline="always")
def _block_scale_overload(scales, index):
    if scales.dtype == types.uint16:  # the trunk's half table (a constant of the compiled code), exact
        return lambda scales, index: _F16_TO_F32[scales[index]]
    return lambda scales, index: scales[index]


def kernel_block_scales(scales: np.ndarray) -> np.ndarray:
    """Block scales as the Q8_0 expert kernels take them: float32 as they are, float16 (a GGUF's Q8_0 experts as
    stored, 2 bytes a block) as their uint16 bits (a view, no copy)."""
    if scales.dtype == np.float16:
        return np.ascontiguousarray(scales).view(np.uint16)
    return np.ascontiguousarray(scales, np.float32)


# ------------------------------------------------------------ a GGUF's Q8_0 experts on Q8_0 activations
# The families hold a GGUF's Q8_0 experts as their int8 values [E, R, C] and block scales [E, R, C / 32], float16
# as the file stores them (`families.experts.Int8Matrix`, what a streaming store's blobs hold too; passed to the
# kernels as their uint16 bits, `kernel_block_scales`) or float32. The same dots and tiles as the trunk's Q8_0
# matrices (above: exact int32 block sums, the 8 accumulators), reading each block's scale from the scales array
# instead of the block's first two bytes: llama.cpp's ggml_vec_dot_q8_0_q8_0 arithmetic on the file's numbers
# (half-precision scales widened in the kernel, exactly).
@intrinsic
def _q8s_row_dot_avx512(typingctx, wrow, wscales, xq, xd):
    """One Q8_0 row as values int8 [C] and block scales [G] . activation q int8 [C] with scales f32 [G]."""
    return _q8_0_typer("avx512", split=True)(typingctx, wrow, wscales, xq, xd)


@intrinsic
def _q8s_row_dot_avx2(typingctx, wrow, wscales, xq, xd):
    """The same row dot on AVX2."""
    return _q8_0_typer("avx2", split=True)(typingctx, wrow, wscales, xq, xd)


@intrinsic
def _q8s_prepare_avx512(typingctx, wrow, wscales, wscale, wcorr):
    """A split row's block scales and VNNI corrections, 8 blocks at a time."""
    return _q8_0_typer("avx512", split=True, prepare=True)(typingctx, wrow, wscales, wscale, wcorr)


@intrinsic
def _q8s_prepare_avx2(typingctx, wrow, wscales, wscale, wcorr):
    """A split row's block scales, 8 blocks at a time."""
    return _q8_0_typer("avx2", split=True, prepare=True)(typingctx, wrow, wscales, wscale, wcorr)


@njit(cache=True)
def _q8s_row_dot_portable(wrow, wscales, xq, xd):
    """The split row dot in plain numba (`_q8_0_dot_portable`)."""
    return _q8_0_dot_portable(wrow, wscales, xq, xd, False)


@njit(inline="always")
def _q8s_row_prepare(wrow, wscales, wscale, wcorr, isa, offset):
    """A split row -> its block scales (float32) and -128 sum q_w per block (the VNNI tile's correction, where
    the activations are offset)."""
    done = 0
    if isa == 2 and offset:
        done = _q8s_prepare_avx512(wrow, wscales, wscale, wcorr)
    elif isa > 0:
        done = _q8s_prepare_avx2(wrow, wscales, wscale, wcorr)
    for group in range(done, wscale.shape[0]):
        wscale[group] = _block_scale(wscales, group)
        total = np.int32(0)
        for k in range(GROUP_SIZE):
            total += np.int32(wrow[group * GROUP_SIZE + k])
        wcorr[group] = np.int32(-128) * total


@njit(inline="always")
def _q8s_dot(wrow, wscales, xq, xd, isa):
    if isa == 2:
        return _q8s_row_dot_avx512(wrow, wscales, xq, xd)
    if isa == 1:
        return _q8s_row_dot_avx2(wrow, wscales, xq, xd)
    return _q8s_row_dot_portable(wrow, wscales, xq, xd)


@njit(inline="always")
def _q8s_block_dots(w, scales, begin, end, shift, xq, xd, xt, dt, first, last, isa, out):
    """out[t, r - shift] = w[r] . activation row t for rows begin:end and t in first:last: with 4 tokens or more,
    one tile of tokens (16 KB at C = 2048: in L1) against every row of the block (in L2) before the next tile, so
    that neither side is read from farther than L2 more than once; fewer run one dot per token. A tile's lanes
    past `last` (the next expert's tokens, or padding) are computed and dropped."""
    if _q8_0_dots_only(isa, xq.shape[0], xd.shape[1]) or last - first < Q8_0_EXPERT_TILE_MIN_TOKENS:
        for row in range(begin, end):
            for t in range(first, last):
                out[t, row - shift] = _q8s_dot(w[row], scales[row], xq[t], xd[t], isa)
        return
    offset = _q8_0_offset(isa, xq.shape[0])
    lanes = 16 if offset else 8
    groups = xd.shape[1]
    rows = end - begin
    wscale = np.empty((rows, groups), np.float32)
    wcorr = np.empty((rows, groups), np.int32)
    res = np.empty(16 * (rows + 1), np.float32)  # row i's dots at res[16 i:]
    for row in range(begin, end):
        _q8s_row_prepare(w[row], scales[row], wscale[row - begin], wcorr[row - begin], isa, offset)
    t = first
    while last - t >= Q8_0_TILE_MIN_TOKENS:  # a tile (the last one padded) against the block's rows
        count = min(lanes, last - t)
        narrow = count <= 8
        width = lanes
        for i in range(0, rows, 2):  # two rows a pass (the runs' activations come from L2: one row alone ran
            if i + 1 < rows:  # ~1.8x as long a row; a matrix's 8 tokens, in L1, run a row a pass)
                width = _q8_0_tile2(w[begin + i], w[begin + i + 1], wscale[i], wscale[i + 1], wcorr[i], wcorr[i + 1],
                                    xt, dt, t, res[16 * i:], isa, narrow, offset)
            else:
                width = _q8_0_tile(w[begin + i], wscale[i], wcorr[i], xt, dt, t, res[16 * i:], isa, narrow, offset)
        for i in range(rows):
            for j in range(count):
                out[t + j, begin + i - shift] = res[16 * i + j]
        t += width
    for row in range(begin, end):  # the last 1-3 tokens
        for u in range(t, last):
            out[u, row - shift] = _q8s_dot(w[row], scales[row], xq[u], xd[u], isa)


@njit(inline="always")
def _q8s_gate_up_task(gate_up, scales, expert_ids, xq, xd, xt, dt, starts, ends, isa, projected, task, blocks):
    """Rows block * 16 .. of expert k's gate_up [2I, H] (gate rows, then up rows: one contiguous stream a task)."""
    k = task // blocks
    e = expert_ids[k]
    begin, end = (task % blocks) * ROWS_PER_TASK, min(projected.shape[1], (task % blocks + 1) * ROWS_PER_TASK)
    _q8s_block_dots(gate_up[e], scales[e], begin, end, 0, xq, xd, xt, dt, starts[k], ends[k], isa, projected)


@njit(inline="always")
def _q8s_glu(projected, starts, ends, hidden, k):
    """hidden[n, i] = SiLU(gate) * up from projected [N, 2I] (gate columns, then up), on expert k's pairs."""
    width = hidden.shape[1]
    for n in range(starts[k], ends[k]):
        for i in range(width):
            hidden[n, i] = _silu_glu(projected[n, i], projected[n, width + i])


@njit(inline="always")
def _q8s_down_task(down, scales, expert_ids, hq, hd, ht, hdt, starts, ends, isa, out, task, blocks):
    k = task // blocks
    e = expert_ids[k]
    begin, end = (task % blocks) * ROWS_PER_TASK, min(out.shape[1], (task % blocks + 1) * ROWS_PER_TASK)
    _q8s_block_dots(down[e], scales[e], begin, end, 0, hq, hd, ht, hdt, starts[k], ends[k], isa, out)


@njit(cache=True, parallel=True)
def _q8s_gate_up_parallel(gate_up, scales, expert_ids, xq, xd, xt, dt, starts, ends, isa, projected, hidden):
    """projected [N, 2I] = gate_up . x over (expert, 16-row block of gate_up) tasks, then hidden [N, I] =
    SiLU-GLU of it. A task streams one run of 16 rows: gate and up rows of the same index in one task (two streams,
    jumping between them) read them at 22 against 28 GB/s (Moonlight's 6 experts, one token, cold)."""
    blocks = (projected.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        _q8s_gate_up_task(gate_up, scales, expert_ids, xq, xd, xt, dt, starts, ends, isa, projected, task, blocks)
    for k in prange(expert_ids.shape[0]):
        _q8s_glu(projected, starts, ends, hidden, k)


@njit(cache=True)
def _q8s_gate_up_serial(gate_up, scales, expert_ids, xq, xd, xt, dt, starts, ends, isa, projected, hidden):
    blocks = (projected.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in range(expert_ids.shape[0] * blocks):
        _q8s_gate_up_task(gate_up, scales, expert_ids, xq, xd, xt, dt, starts, ends, isa, projected, task, blocks)
    for k in range(expert_ids.shape[0]):
        _q8s_glu(projected, starts, ends, hidden, k)


@njit(cache=True, parallel=True)
def _q8s_down_parallel(down, scales, expert_ids, hq, hd, ht, hdt, starts, ends, isa, out):
    """out [N, H] rows of the experts' pairs = down . hidden, over (expert, row block) tasks."""
    blocks = (out.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        _q8s_down_task(down, scales, expert_ids, hq, hd, ht, hdt, starts, ends, isa, out, task, blocks)


@njit(cache=True)
def _q8s_down_serial(down, scales, expert_ids, hq, hd, ht, hdt, starts, ends, isa, out):
    blocks = (out.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in range(expert_ids.shape[0] * blocks):
        _q8s_down_task(down, scales, expert_ids, hq, hd, ht, hdt, starts, ends, isa, out, task, blocks)


def q8_0_experts_run(gate_up: np.ndarray, gate_up_scales: np.ndarray, down: np.ndarray, down_scales: np.ndarray,
                     expert_ids: np.ndarray, x: np.ndarray, tokens: np.ndarray, starts: np.ndarray,
                     ends: np.ndarray, out: np.ndarray | None = None, isa: str | None = None) -> np.ndarray:
    """`dense_experts_run` for a GGUF's Q8_0 experts (gate_up int8 [E, 2I, H], down int8 [E, H, I], block scales
    [E, 2I, H/32] and [E, H, I/32], float16 as the file stores them or float32: the same bits) with x and the
    hidden rows quantized to Q8_0 first, as llama.cpp multiplies them (ggml_vec_dot_q8_0_q8_0): exact int32 block
    sums, not the float path's bits. y[n] = down_e
    SiLU-GLU(gate_up_e x[tokens[n]]) for expert k's pairs starts[k]:ends[k]; `out` [N, H], when given, is filled on
    those rows only. Each y[n] has the same bits whatever the other pairs, experts and threads of the call. `isa`
    picks the instruction set (default the best here; "portable" is plain numba)."""
    code = _isa_code(isa)
    x = np.ascontiguousarray(x, dtype=np.float32)
    num_experts, hidden_size, width = down.shape
    if (gate_up.dtype != np.int8 or down.dtype != np.int8 or gate_up.shape != (num_experts, 2 * width, hidden_size)
            or x.ndim != 2 or x.shape[1] != hidden_size or hidden_size % GROUP_SIZE or width % GROUP_SIZE
            or np.shape(gate_up_scales) != (num_experts, 2 * width, hidden_size // GROUP_SIZE)
            or np.shape(down_scales) != (num_experts, hidden_size, width // GROUP_SIZE)):
        raise ValueError(f"Q8_0 experts gate_up {gate_up.shape} {gate_up.dtype} / down {down.shape} {down.dtype} with "
                         f"block scales {np.shape(gate_up_scales)} / {np.shape(down_scales)} do not fit x {x.shape} "
                         f"(one scale per {GROUP_SIZE} values)")
    if out is None:
        out = np.empty((tokens.shape[0], hidden_size), np.float32)  # [N, H]
    if tokens.shape[0] == 0 or expert_ids.shape[0] == 0:
        return out
    expert_ids = np.ascontiguousarray(expert_ids, dtype=np.int64)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    ends = np.ascontiguousarray(ends, dtype=np.int64)
    xq, xd = quantize_activations(x)  # [T, H], [T, H / 32]
    tokens = np.asarray(tokens, dtype=np.int64)
    xq, xd = xq[tokens], xd[tokens]  # [N, H], [N, H / 32]: each pair's row, the experts' rows contiguous
    projected = np.empty((tokens.shape[0], 2 * width), np.float32)  # [N, 2I]: gate, then up
    hidden = np.zeros((tokens.shape[0], width), np.float32)  # [N, I]; rows of experts not in this call stay 0
    parallel = expert_ids.shape[0] * gate_up[0].size >= PARALLEL_MIN_WEIGHTS
    xt, dt = _q8_0_tiles(xq, xd, code)  # the tiles' layout (empty under 4 pairs)
    (_q8s_gate_up_parallel if parallel else _q8s_gate_up_serial)(
        np.ascontiguousarray(gate_up), kernel_block_scales(gate_up_scales), expert_ids, xq, xd, xt, dt, starts, ends,
        code, projected, hidden)
    hq, hd = quantize_activations(hidden)  # [N, I], [N, I / 32]
    ht, hdt = _q8_0_tiles(hq, hd, code)
    (_q8s_down_parallel if parallel else _q8s_down_serial)(
        np.ascontiguousarray(down), kernel_block_scales(down_scales), expert_ids, hq, hd, ht, hdt, starts, ends, code,
        out)
    return out


def q8_0_experts_reference(gate_up: np.ndarray, gate_up_scales: np.ndarray, down: np.ndarray,
                           down_scales: np.ndarray, expert_ids: np.ndarray, x: np.ndarray, tokens: np.ndarray,
                           starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The numpy twin of `q8_0_experts_run`: the same activation quantization (`weights.q8_0.quantize_rows`), both
    sides decoded to float64 (every product and block sum exact), float64 matmuls, SiLU-GLU in float32. -> [N, H]"""
    out = np.zeros((tokens.shape[0], down.shape[1]), np.float32)
    for k, e in enumerate(expert_ids):
        rows = np.asarray(x, np.float32)[tokens[starts[k]:ends[k]]]
        if not len(rows):
            continue
        gate_up_e = gate_up[e].astype(np.float64) * np.repeat(gate_up_scales[e].astype(np.float64), GROUP_SIZE, 1)
        down_e = down[e].astype(np.float64) * np.repeat(down_scales[e].astype(np.float64), GROUP_SIZE, 1)
        projected = (_q8_decoded(rows) @ gate_up_e.T).astype(np.float32)  # [n, 2I]
        width = down.shape[2]
        gate, up = projected[:, :width], projected[:, width:]
        hidden = gate / (np.float32(1.0) + np.exp(-gate)) * up
        out[starts[k]:ends[k]] = (_q8_decoded(hidden) @ down_e.T).astype(np.float32)
    return out


def _q8_decoded(x: np.ndarray) -> np.ndarray:
    """x float32 [n, C] quantized to Q8_0 (`quantize_rows`) and decoded back, float64."""
    xq, xd = quantize_rows(x)
    return (xq.reshape(len(x), -1, GROUP_SIZE) * xd[:, :, None].astype(np.float64)).reshape(x.shape)


@njit(cache=True)
def _quantize_activation_rows(x, xq, scales):
    """`weights.q8_0.quantize_rows` compiled (its per-call numpy overhead dominated small models' decode): x f32
    [T, C] -> xq int8 [T, C] and the unrounded scales d = max|x| / 127 f32 [T, G]; the same float32 operations, so
    the same bits (tested). The caller rounds d to half."""
    for t in range(x.shape[0]):
        for group in range(scales.shape[1]):
            base = group * GROUP_SIZE
            amax = np.float32(0.0)
            finite = True
            for k in range(GROUP_SIZE):
                amax = max(amax, abs(x[t, base + k]))
                finite = finite and np.isfinite(x[t, base + k])
            scale = amax / np.float32(127.0)
            inverse = np.float32(1.0) / scale if scale > np.float32(0.0) and finite else np.float32(0.0)
            scales[t, group] = scale if finite else np.float32(np.nan)  # a NaN or inf input gives a NaN output
            for k in range(GROUP_SIZE):
                v = x[t, base + k] * inverse
                xq[t, base + k] = np.int8(np.floor(abs(v) + np.float32(0.5)) * (np.float32(-1.0) if v < 0 else
                                                                                np.float32(1.0)))


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [T, C] -> (q int8 [T, C], d float32 [T, G]): `weights.q8_0.quantize_rows`, bit for bit, compiled.
    A block holding NaN or inf gets scale NaN (its products are NaN, as float activations would make them)."""
    xq = np.empty(x.shape, np.int8)  # [T, C]
    scales = np.empty((x.shape[0], x.shape[1] // GROUP_SIZE), np.float32)  # [T, G]
    _quantize_activation_rows(x, xq, scales)
    return xq, scales.astype(np.float16).astype(np.float32)


def _check_q8_0(blocks: np.ndarray, x: np.ndarray) -> tuple[int, int]:
    if blocks.ndim != 2 or blocks.dtype != np.uint8 or blocks.shape[1] % Q8_0_BLOCK_BYTES:
        raise ValueError(f"Q8_0 blocks must be uint8 [R, G * {Q8_0_BLOCK_BYTES}], got {blocks.dtype} {blocks.shape}")
    rows, cols = blocks.shape[0], blocks.shape[1] // Q8_0_BLOCK_BYTES * GROUP_SIZE
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be [T, {cols}] to multiply a Q8_0 [{rows}, {cols}] matrix, got {x.shape}")
    return rows, cols


def q8_0_matmul(blocks: np.ndarray, x: np.ndarray, isa: str | None = None) -> np.ndarray:
    """x @ dequantize_q8_0(blocks).T with x's rows quantized to Q8_0 first (llama.cpp's Q8_0 x Q8_0 dot), read
    straight from the blocks. blocks u8 [R, G * 34], x float32 [T, C] -> [T, R]. `isa` picks the instruction set."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    blocks = np.ascontiguousarray(blocks)
    rows, _ = _check_q8_0(blocks, x)
    out = np.empty((x.shape[0], rows), np.float32)  # [T, R]
    if x.shape[0] == 0 or rows == 0:
        return out
    code = _isa_code(isa)
    xq, xd = quantize_activations(x)  # [T, C] int8, [T, G] float32
    xt, dt = _q8_0_tiles(xq, xd, code, aligned=True)
    kernel = _q8_0_matmul_parallel if blocks.size >= PARALLEL_MIN_WEIGHTS else _q8_0_matmul_serial
    kernel(blocks, xq, xd, xt, dt, _F16_TO_F32, code, out)
    return out


def q8_0_matmul_reference(blocks: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The numpy twin of `q8_0_matmul`: the same activation quantization, both sides decoded to float, one float64
    matmul (every product and block sum exact), rounded to float32. -> [T, R]"""
    x = np.asarray(x, dtype=np.float32)
    _check_q8_0(np.asarray(blocks), x)
    return (_q8_decoded(x) @ dequantize_q8_0(blocks).astype(np.float64).T).astype(np.float32)


@njit(cache=True, parallel=True)
def _q8_0_heads_parallel(blocks, xq, xd, xt, dt, f16_table, isa, out):
    """out [NA, T, R] = per head h, x[h] W_h^T; blocks u8 [NA, R, G * 34], xq int8 [NA, T, C], xd f32 [NA, T, G],
    (xt, dt) each head's tile layout. One parallel region for every head: a task is 16 rows of one head
    (`_q8_0_matmul_task`)."""
    tasks = (blocks.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for job in prange(blocks.shape[0] * tasks):
        head = job // tasks
        _q8_0_matmul_task(blocks[head], xq[head], xd[head], xt[min(head, xt.shape[0] - 1)],
                          dt[min(head, dt.shape[0] - 1)], f16_table, isa, out[head], job - head * tasks)


@njit(cache=True)
def _q8_0_heads_serial(blocks, xq, xd, xt, dt, f16_table, isa, out):
    tasks = (blocks.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for head in range(blocks.shape[0]):
        for task in range(tasks):
            _q8_0_matmul_task(blocks[head], xq[head], xd[head], xt[min(head, xt.shape[0] - 1)],
                              dt[min(head, dt.shape[0] - 1)], f16_table, isa, out[head], task)


def _check_q8_0_heads(blocks: np.ndarray, x: np.ndarray) -> int:
    if blocks.ndim != 3 or blocks.dtype != np.uint8 or blocks.shape[2] % Q8_0_BLOCK_BYTES:
        raise ValueError(f"per-head Q8_0 blocks must be uint8 [NA, R, G * {Q8_0_BLOCK_BYTES}], got {blocks.dtype} "
                         f"{blocks.shape}")
    cols = blocks.shape[2] // Q8_0_BLOCK_BYTES * GROUP_SIZE
    if x.ndim != 3 or x.shape[0] != blocks.shape[0] or x.shape[2] != cols:
        raise ValueError(f"x must be [{blocks.shape[0]}, T, {cols}] to multiply {blocks.shape[0]} Q8_0 "
                         f"[{blocks.shape[1]}, {cols}] matrices, got {x.shape}")
    return cols


# Block bytes x tokens from which `q8_0_heads_matmul` runs on every thread: MLA's per-head matrices are ~1 MB a layer
# side, and at one token one thread took 0.71 ms a DeepSeek-V3 step for the 8 calls, a parallel region each 1.0 ms
# (waking the workers costs more than half of a call saves; `bench_decode_ops.py`, docs/BENCHMARKS.md).
Q8_0_HEADS_PARALLEL_MIN_WORK = 2**22


def q8_0_heads_matmul(blocks: np.ndarray, x: np.ndarray, isa: str | None = None) -> np.ndarray:
    """Per head h, x[h] @ dequantize_q8_0(blocks[h]).T, each x row quantized to Q8_0 first: `q8_0_matmul` for NA
    matrices of one shape at once (MLA's per-head W_uk / W_uv as a GGUF holds them, llama.cpp's arithmetic), in one
    parallel region. blocks u8 [NA, R, G * 34], x float32 [NA, T, C] -> [NA, T, R]; each output is the bits of
    `q8_0_matmul(blocks[h], x[h])`, whatever T and the threads."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    blocks = np.ascontiguousarray(blocks)
    cols = _check_q8_0_heads(blocks, x)
    heads, tokens = x.shape[0], x.shape[1]
    out = np.empty((heads, tokens, blocks.shape[1]), np.float32)  # [NA, T, R]
    if out.size == 0:
        return out
    xq, xd = quantize_activations(x.reshape(heads * tokens, cols))  # [NA*T, C] int8, [NA*T, G] float32
    parallel = blocks.size * tokens >= Q8_0_HEADS_PARALLEL_MIN_WORK
    kernel = _q8_0_heads_parallel if parallel else _q8_0_heads_serial
    xq, xd, code = xq.reshape(heads, tokens, cols), xd.reshape(heads, tokens, -1), _isa_code(isa)
    xt, dt = _q8_0_tiles(xq, xd, code, aligned=True)  # [NA, G, 9, N, 4], [NA, G, N] (or empty)
    kernel(blocks, xq, xd, xt, dt, _F16_TO_F32, code, out)
    return out


def q8_0_heads_matmul_reference(blocks: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The numpy twin of `q8_0_heads_matmul`: `q8_0_matmul_reference` head by head. -> [NA, T, R]"""
    x = np.asarray(x, dtype=np.float32)
    _check_q8_0_heads(np.asarray(blocks), x)
    if x.shape[1] == 0:
        return np.zeros((blocks.shape[0], 0, blocks.shape[1]), np.float32)
    return np.stack([q8_0_matmul_reference(blocks[h], x[h]) for h in range(blocks.shape[0])]).reshape(
        blocks.shape[0], x.shape[1], blocks.shape[1])


def quantized_matmul(w: QuantizedMatrix, x: np.ndarray, isa: str | None = None) -> np.ndarray:
    """x [T, C] @ w.T for a trunk matrix held in its Q8_0 (activations quantized to Q8_0, as llama.cpp) or MXFP4
    (float activations, the experts' kernel) bytes. -> [T, R]"""
    if w.precision == "q8_0":
        return q8_0_matmul(w.data, x, isa)
    assert w.scales is not None
    return mxfp4_matmul(w.data, w.scales, x, isa=isa)

# ------------------------------------------------------------------------------------------- MXFP4 x int8
# An opt-in decode path that trades the float path's bits for fewer vector ops a weight (`activations="q8"`): the
# activation row is quantized as the Q8_0 trunk quantizes it (`quantize_activations`: blocks of 32, d = max|x| /
# 127 rounded to half, q = round(x / d)), llama.cpp's ggml_vec_dot_mxfp4_q8_0 semantics, and each group's sum is
# an exact int32:
#
#     y[r] = sum_g m[r, g] d[g] * sum_{k < 32} V[nibble(r, 32 g + k)] q[32 g + k]
#
# 4 groups (64 weight bytes) a step: the nibbles index a 16-byte table of V + 12 (unsigned, vpshufb); AVX-512 VNNI's
# vpdpbusd multiplies them with the int8 q and sums 4 products a lane (AVX2: vpmaddubsw, then vpmaddwd by ones, in
# two parts of 2 groups); 12 sum q, which depends on x only, is subtracted once per lane (`_q8_vnni_activations`
# precomputes it). Lane l of a part holds group l // 4, so the float scale m[r, g] d[g] is one vector a part: m from
# the scale byte's exponent bits (byte 255 -> 0; byte 0, a 2^-128 scale, -> 0 too). ~4 zmm ops a group against the
# float path's ~7. The two instruction sets give other bits (lane grouping); the float path stays the default.
Q8_VNNI_GROUPS_PER_STEP = 4
Q8_ISAS: tuple[str, ...] = tuple(name for name, present in (("avx2", "avx2" in AVAILABLE_ISAS),
                                                              ("avx512", "avx512" in AVAILABLE_ISAS
                                                               and "avx512vnni" in _FEATURES)) if present)
# Opt-in (`generate`/`serve --mxfp4-activations q8`, or K3SERVE_MXFP4_ACTIVATIONS=q8): the routed experts
# (`mxfp4_experts_run`) on this path; read at each call. An unknown value, or q8 on a CPU without AVX2, is logged and
# runs the float path.
MXFP4_ACTIVATIONS = os.environ.get("K3SERVE_MXFP4_ACTIVATIONS", "f32").strip().lower() or "f32"
if MXFP4_ACTIVATIONS not in ("f32", "q8") or (MXFP4_ACTIVATIONS == "q8" and not Q8_ISAS):
    logger.warning("K3SERVE_MXFP4_ACTIVATIONS=%r: %s; the routed experts run on float activations (f32)",
                   MXFP4_ACTIVATIONS, "known: f32, q8" if MXFP4_ACTIVATIONS != "q8" else
                   "q8 needs AVX2 or AVX-512 VNNI, which this CPU lacks")
    MXFP4_ACTIVATIONS = "f32"
elif MXFP4_ACTIVATIONS == "q8":
    logger.info("routed MXFP4 experts on Q8_0 activations (int8 dot products, %s)", Q8_ISAS[-1])
_V_OFFSET = 12  # V + 12 >= 0 for every V


@njit(cache=True)
def _q8_vnni_activations(q, d, xq, corrections, lane_scales):
    """Rearrange Q8_0 activations q int8 [T, C], d f32 [T, G] for `_mxfp4_q8_row_dot`: per step of 4 groups
    (S = ceil(G / 4) steps, padded with zeros), xq int8 [T, S * 128] = the 4 groups' 16 even inputs, then their 16
    odd ones; corrections int32 [T, S * 16] = 12 * (the 4 even + 4 odd q of each lane); lane_scales f32 [T, S * 16]
    = d[g] / 2 for lane l of step s (g = 4 s + l // 4; the 1/2 of m = 2^(byte - 127) / 2)."""
    xq[:] = 0
    corrections[:] = 0
    lane_scales[:] = 0
    for t in range(q.shape[0]):
        for g in range(d.shape[1]):
            step, slot = g // Q8_VNNI_GROUPS_PER_STEP, g % Q8_VNNI_GROUPS_PER_STEP
            base = step * 128 + slot * BYTES_PER_GROUP
            for j in range(BYTES_PER_GROUP):
                even, odd = q[t, g * GROUP_SIZE + 2 * j], q[t, g * GROUP_SIZE + 2 * j + 1]
                xq[t, base + j] = even
                xq[t, base + 64 + j] = odd
                lane = step * 16 + slot * 4 + j // 4
                corrections[t, lane] += _V_OFFSET * (np.int32(even) + np.int32(odd))
            for lane in range(4):
                lane_scales[t, step * 16 + slot * 4 + lane] = d[t, g] * np.float32(0.5)


class _MXFP4Q8IR:
    """The IR the int8 row dot and the int8 tiles share, for one function being built: the intrinsics and constants
    of `lanes` int32 lanes (16: AVX-512 VNNI; 8: AVX2), a row's decode (`decode`) and a part's integer dot
    (`dot`). Both kernels call the same code, so a tile's (row, token) makes exactly the row dot's operations."""

    def __init__(self, builder, lanes: int, num_groups):
        self.builder, self.lanes = builder, lanes
        self.part_bytes, self.groups_per_part = 4 * lanes, lanes // 4
        self.parts = Q8_VNNI_GROUPS_PER_STEP // self.groups_per_part
        module = builder.module
        self.index_type = index_type = ir.IntType(64)
        self.vb, self.vi, self.vf = vb, vi, vf = (_vector(_I8, self.part_bytes), _vector(_I32, lanes),
                                                  _vector(_F32, lanes))
        self.fma = cgutils.get_or_insert_function(module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{lanes}f32")
        self.masked_load = cgutils.get_or_insert_function(
            module, ir.FunctionType(vb, [vb.as_pointer(), _I32, _vector(ir.IntType(1), self.part_bytes), vb]),
            f"llvm.masked.load.v{self.part_bytes}i8.p0")
        if lanes == 16:
            self.pshufb = cgutils.get_or_insert_function(module, ir.FunctionType(vb, [vb, vb]),
                                                         "llvm.x86.avx512.pshuf.b.512")
            self.dpbusd = cgutils.get_or_insert_function(module, ir.FunctionType(vi, [vi, vi, vi]),
                                                         "llvm.x86.avx512.vpdpbusd.512")
        else:
            vw = _vector(ir.IntType(16), 16)
            self.pshufb = cgutils.get_or_insert_function(module, ir.FunctionType(vb, [vb, vb]),
                                                         "llvm.x86.avx2.pshuf.b")
            self.maddubs = cgutils.get_or_insert_function(module, ir.FunctionType(vw, [vb, vb]),
                                                          "llvm.x86.avx2.pmadd.ub.sw")
            self.maddwd = cgutils.get_or_insert_function(module, ir.FunctionType(vi, [vw, vw]),
                                                         "llvm.x86.avx2.pmadd.wd")
            self.ones = ir.Constant(vw, [1] * 16)
        self.table = ir.Constant(vb, [int(v) + _V_OFFSET for v in _DOUBLED_E2M1] * (self.part_bytes // 16))
        self.nibble_mask = ir.Constant(vb, [15] * self.part_bytes)
        self.iota = ir.Constant(vb, list(range(self.part_bytes)))
        self.num_groups = num_groups
        self.row_bytes = builder.mul(num_groups, ir.Constant(index_type, BYTES_PER_GROUP))
        self.full_steps = builder.udiv(num_groups, ir.Constant(index_type, Q8_VNNI_GROUPS_PER_STEP))
        self.last_group = builder.sub(num_groups, ir.Constant(index_type, 1))
        self.scale_type = _vector(_I32, self.groups_per_part)
        self.spread = ir.Constant(vi, [lane // 4 for lane in range(lanes)])

    def offset(self, step, per_step: int, within: int):
        """step * per_step + within, an i64 index."""
        builder, index_type = self.builder, self.index_type
        return builder.add(builder.mul(step, ir.Constant(index_type, per_step)), ir.Constant(index_type, within))

    def scale_bits(self, scale_bytes):
        """i32 scale bytes -> float bits of 2^(byte - 127), byte 255 -> 0."""
        builder, scale_type, count = self.builder, self.scale_type, self.groups_per_part
        shifted = builder.shl(scale_bytes, ir.Constant(scale_type, [23] * count))
        is_nan = builder.icmp_unsigned("==", scale_bytes, ir.Constant(scale_type, [255] * count))
        return builder.select(is_nan, ir.Constant(scale_type, [0] * count), shifted)

    def decode(self, prow, srow, step, part: int, tail: bool):
        """One row's weights (V + 12 of the low and high nibbles) and its per-lane m (float) of one part of `step`;
        the tail step masks the row's end (zero nibbles meet zero q)."""
        builder, index_type, vb, part_bytes = self.builder, self.index_type, self.vb, self.part_bytes
        byte_base = self.offset(step, 64, part * part_bytes)
        pointer = builder.bitcast(builder.gep(prow.data, [byte_base]), vb.as_pointer())
        if tail:
            remaining = builder.sub(self.row_bytes, byte_base)
            remaining = builder.select(builder.icmp_signed("<", remaining, ir.Constant(index_type, 0)),
                                       ir.Constant(index_type, 0), remaining)
            remaining = builder.select(builder.icmp_signed(">", remaining, ir.Constant(index_type, part_bytes)),
                                       ir.Constant(index_type, part_bytes), remaining)
            mask = builder.icmp_unsigned("<", self.iota, _splat(builder, builder.trunc(remaining, _I8), part_bytes))
            packed = builder.call(self.masked_load, [pointer, ir.Constant(_I32, 1), mask,
                                                     ir.Constant(vb, [0] * part_bytes)])
        else:
            packed = builder.load(pointer, align=1)
        low = builder.and_(packed, self.nibble_mask)
        high = builder.and_(builder.lshr(packed, ir.Constant(vb, [4] * part_bytes)), self.nibble_mask)
        weights_low, weights_high = builder.call(self.pshufb, [self.table, low]), builder.call(self.pshufb,
                                                                                               [self.table, high])
        first_group = self.offset(step, Q8_VNNI_GROUPS_PER_STEP, part * self.groups_per_part)
        if tail:  # groups past the row's end read the last group's byte (finite; their q and d are 0)
            scale_bytes = ir.Constant(self.scale_type, ir.Undefined)
            for slot in range(self.groups_per_part):
                group = builder.add(first_group, ir.Constant(index_type, slot))
                group = builder.select(builder.icmp_unsigned(">", group, self.last_group), self.last_group, group)
                byte = builder.zext(builder.load(builder.gep(srow.data, [group])), _I32)
                scale_bytes = builder.insert_element(scale_bytes, byte, ir.Constant(_I32, slot))
        else:
            scale_pointer = builder.bitcast(builder.gep(srow.data, [first_group]),
                                            _vector(_I8, self.groups_per_part).as_pointer())
            scale_bytes = builder.zext(builder.load(scale_pointer, align=1), self.scale_type)
        exponents = self.scale_bits(scale_bytes)
        return weights_low, weights_high, builder.bitcast(builder.shuffle_vector(exponents, exponents, self.spread),
                                                          self.vf)

    def dot(self, weights_low, weights_high, x_even, x_odd):
        """The int32 lane sums of a part: 4 products a lane (vpdpbusd twice, or vpmaddubsw then vpmaddwd)."""
        builder, vi = self.builder, self.vi
        if self.lanes == 16:
            sums = builder.call(self.dpbusd, [ir.Constant(vi, [0] * self.lanes), builder.bitcast(weights_low, vi),
                                              builder.bitcast(x_even, vi)])
            return builder.call(self.dpbusd, [sums, builder.bitcast(weights_high, vi), builder.bitcast(x_odd, vi)])
        pairs = builder.add(builder.call(self.maddubs, [weights_low, x_even]),
                            builder.call(self.maddubs, [weights_high, x_odd]))
        return builder.call(self.maddwd, [pairs, self.ones])

    def accumulate(self, slot, sums, correction, row_scale, token_scale):
        """slot += float(sums - correction) * (m * d / 2), one FMA."""
        builder = self.builder
        sums = builder.sub(sums, correction)
        scale = builder.fmul(row_scale, token_scale)
        builder.store(builder.call(self.fma, [builder.sitofp(sums, self.vf), scale, builder.load(slot)]), slot)

    def steps(self, part_step) -> None:
        """part_step(step, part, tail) for every part of every full step, then of the tail step if the row has
        one."""
        builder = self.builder
        with cgutils.for_range(builder, self.full_steps) as loop:
            for part in range(self.parts):
                part_step(loop.index, part, False)
        has_tail = builder.icmp_unsigned(
            "!=", builder.mul(self.full_steps, ir.Constant(self.index_type, Q8_VNNI_GROUPS_PER_STEP)),
            self.num_groups)
        with builder.if_then(has_tail):
            for part in range(self.parts):
                part_step(self.full_steps, part, True)


def _mxfp4_q8_row_dot_codegen(lanes: int):
    """IR of the int8 row dot with `lanes` int32 lanes: 16 (AVX-512 VNNI: a step's 64 weight bytes at once, two
    vpdpbusd) or 8 (AVX2: two parts of 32 bytes, vpmaddubsw then vpmaddwd by ones; the i16 sums stay under 2 x 2 x
    24 x 127 = 12192, no saturation). Lane l of a part holds group l // 4 of it."""

    def codegen(context, builder, signature, args):
        prow, srow, xq, corrections, lane_scales = (context.make_array(t)(context, builder, a)
                                                    for t, a in zip(signature.args, args))
        (num_groups,) = cgutils.unpack_tuple(builder, srow.shape, 1)
        q = _MXFP4Q8IR(builder, lanes, num_groups)
        acc_slot = cgutils.alloca_once_value(builder, ir.Constant(q.vf, [0.0] * lanes))
        x_bytes = builder.bitcast(xq.data, _I8.as_pointer())

        def part_dot(step, part: int, tail: bool):
            weights_low, weights_high, row_scale = q.decode(prow, srow, step, part, tail)
            x_base = q.offset(step, 128, part * q.part_bytes)
            x_even = _load(builder, x_bytes, x_base, q.vb, 1)
            x_odd = _load(builder, x_bytes, builder.add(x_base, ir.Constant(q.index_type, 64)), q.vb, 1)
            lane_base = q.offset(step, 16, part * lanes)
            q.accumulate(acc_slot, q.dot(weights_low, weights_high, x_even, x_odd),
                         _load(builder, corrections.data, lane_base, q.vi, 4), row_scale,
                         _load(builder, lane_scales.data, lane_base, q.vf, 4))

        q.steps(part_dot)
        return _pairwise_sum(builder, builder.load(acc_slot), lanes)

    return codegen


@intrinsic
def _mxfp4_q8_row_dot_avx512(typingctx, prow, srow, xq, corrections, lane_scales):
    """One MXFP4 row . Q8_0 activations in `_q8_vnni_activations`' layout, AVX-512 VNNI."""
    codegen = _mxfp4_q8_row_dot_codegen(16) if "avx512" in Q8_ISAS else _unavailable_codegen
    return types.float32(prow, srow, xq, corrections, lane_scales), codegen


@intrinsic
def _mxfp4_q8_row_dot_avx2(typingctx, prow, srow, xq, corrections, lane_scales):
    """The same dot on AVX2 (vpmaddubsw), 8 lanes: other bits than AVX-512's (another lane grouping)."""
    codegen = _mxfp4_q8_row_dot_codegen(8) if "avx2" in Q8_ISAS else _unavailable_codegen
    return types.float32(prow, srow, xq, corrections, lane_scales), codegen


@njit(inline="always")
def _mxfp4_q8_row_dot(prow, srow, xq, corrections, lane_scales, isa):
    if isa == 2:
        return _mxfp4_q8_row_dot_avx512(prow, srow, xq, corrections, lane_scales)
    return _mxfp4_q8_row_dot_avx2(prow, srow, xq, corrections, lane_scales)


def _q8_isa_code(isa: str | None) -> int:
    """The int8 path's instruction set: `isa`, or the best this CPU has for it."""
    if not Q8_ISAS:
        raise ValueError("the MXFP4 x int8 path needs AVX2 or AVX-512 VNNI, which this CPU (or numba's target) lacks")
    name = Q8_ISAS[-1] if isa is None else isa
    if name not in Q8_ISAS:
        raise ValueError(f"the MXFP4 x int8 path runs on {Q8_ISAS}, not {name!r}")
    return ISA_CODES[name]


@njit(cache=True, parallel=True)
def _matmul_q8_parallel(packed, scales, xq, corrections, lane_scales, isa, out):
    """out [T, R] = the `_mxfp4_q8_row_dot` of every (token, row), over row blocks."""
    for task in prange((packed.shape[0] + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        for row in range(task * ROWS_PER_TASK, min(packed.shape[0], (task + 1) * ROWS_PER_TASK)):
            for t in range(xq.shape[0]):
                out[t, row] = _mxfp4_q8_row_dot(packed[row], scales[row], xq[t], corrections[t], lane_scales[t],
                                                isa)


def _q8_vnni_prepare(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """f32 [T, C] -> (xq int8 [T, S * 128], corrections int32 [T, S * 16], lane scales f32 [T, S * 16])."""
    q, d = quantize_activations(x)  # [T, C] int8, [T, G]
    num_tokens, steps = x.shape[0], (d.shape[1] + Q8_VNNI_GROUPS_PER_STEP - 1) // Q8_VNNI_GROUPS_PER_STEP
    xq = np.empty((num_tokens, steps * 128), np.int8)  # [T, S * 128]
    corrections = np.empty((num_tokens, steps * 16), np.int32)  # [T, S * 16]
    lane_scales = np.empty((num_tokens, steps * 16), np.float32)  # [T, S * 16]
    _q8_vnni_activations(q, d, xq, corrections, lane_scales)
    return xq, corrections, lane_scales


@njit(cache=True, parallel=True)
def _experts_q8_gate_up(w1p, w1s, w3p, w3s, expert_ids, xq, corrections, lane_scales, tokens, starts, ends, isa,
                        gate, up):
    """Stage 1 of `mxfp4_experts_run` on the int8 path: gate, up [N, MI] in natural order."""
    blocks = (w1p.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        k, block = task // blocks, task % blocks
        e = expert_ids[k]
        for row in range(block * ROWS_PER_TASK, min(w1p.shape[1], (block + 1) * ROWS_PER_TASK)):
            for n in range(starts[k], ends[k]):
                t = tokens[n]
                gate[n, row] = _mxfp4_q8_row_dot(w1p[e, row], w1s[e, row], xq[t], corrections[t], lane_scales[t],
                                                 isa)
                up[n, row] = _mxfp4_q8_row_dot(w3p[e, row], w3s[e, row], xq[t], corrections[t], lane_scales[t], isa)


@njit(cache=True, parallel=True)
def _experts_q8_down(w2p, w2s, expert_ids, xq, corrections, lane_scales, starts, ends, isa, out):
    """Stage 2 on the int8 path: xq etc. hold the quantized hidden rows [N, ...]."""
    blocks = (w2p.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        k, block = task // blocks, task % blocks
        e = expert_ids[k]
        for row in range(block * ROWS_PER_TASK, min(w2p.shape[1], (block + 1) * ROWS_PER_TASK)):
            for n in range(starts[k], ends[k]):
                out[n, row] = _mxfp4_q8_row_dot(w2p[e, row], w2s[e, row], xq[n], corrections[n], lane_scales[n],
                                                isa)


def mxfp4_matmul_q8(packed: np.ndarray, scales: np.ndarray, x: np.ndarray, isa: str | None = None) -> np.ndarray:
    """`mxfp4_matmul` with the activations quantized to Q8_0 first (the int8 path above; not the float path's bits:
    llama.cpp's error). packed u8 [R, C/2], scales u8 [R, G], x f32 [T, C] -> f32 [T, R]. `isa`: one of `Q8_ISAS`
    (default the best)."""
    code = _q8_isa_code(isa)
    packed = _rows_contiguous(packed)
    scales = _rows_contiguous(scales)
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, _ = _check_operands(packed, scales, x)
    num_tokens = x.shape[0]
    out = np.empty((num_tokens, rows), dtype=np.float32)  # [T, R]
    if num_tokens == 0 or rows == 0:
        return out
    xq, corrections, lane_scales = _q8_vnni_prepare(x)
    _matmul_q8_parallel(packed, scales, xq, corrections, lane_scales, code, out)
    return out


# ------------------------------------------------------------------ int8 tiles: MXFP4 and int8 experts x Q8_0
# The int8 path at prefill: an expert with several tokens decodes each row's nibbles to int8 once (the vpshufb
# lookup of the row dot above) and multiplies them with Q8_TILE_TOKENS tokens' Q8_0 activations in the same pass,
# each token with its own accumulator and exactly the row dot's operations in the row dot's order (the int32 group
# sums, the correction, m[r, g] d[g] / 2 per lane, one FMA, the same pairwise lane sum), so **every output has the
# row dot's bits**, whatever the number of tokens routed with it (tested). Per token and step of 4 groups the tile
# spends 2 vpdpbusd, a subtract, a convert, a multiply and an FMA; the decode (load, 2 masks, a shift, 2 vpshufb)
# and the scale bytes' exponent bits are paid once a row for all the tokens of the pass. Work is split over
# (expert, row block) as in the row dot's kernels; an expert's last tokens (fewer than a tile) run the row dot.
Q8_TILE_TOKENS = 8  # tokens one pass over a decoded row serves (then 4, then the row dot; docs/BENCHMARKS.md)
Q8_TILE_CHUNK_TOKENS = 8  # tokens whose activations (~4 KB each at C = 2048) stay in L1 while a row block passes


def _q8_token_rows(builder: ir.IRBuilder, xq, corrections, lane_scales, token_rows) -> tuple[list, list, list]:
    """Pointers to rows `token_rows` of the prepared Q8_0 activations (xq int8, corrections int32, lane_scales f32;
    each a C-contiguous 2D array), for the int8 tiles."""
    def row_of(array, element_type, token):
        (stride, _) = cgutils.unpack_tuple(builder, array.strides, 2)
        base = builder.bitcast(array.data, _I8.as_pointer())
        return builder.bitcast(builder.gep(base, [builder.mul(token, stride)]), element_type.as_pointer())

    return ([row_of(xq, _I8, t) for t in token_rows], [row_of(corrections, _I32, t) for t in token_rows],
            [row_of(lane_scales, _F32, t) for t in token_rows])


def _mxfp4_q8_tile_codegen(lanes: int, num_tokens: int):
    """IR of the int8 row dots of two MXFP4 rows (a, b) with `num_tokens` activation rows: args (prow_a, srow_a,
    prow_b, srow_b (u8 [C/2], [G]), xq int8 [T, S * 128], corrections int32 [T, S * 16], lane_scales f32 [T,
    S * 16], then num_tokens row indices t into them) -> a tuple of 2 num_tokens float32 (a's dots, then b's), each
    the bits of `_mxfp4_q8_row_dot` on row t. A token's activations are loaded once for both rows."""

    def codegen(context, builder, signature, args):
        prow_a, srow_a, prow_b, srow_b, xq, corrections, lane_scales = (
            context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:7], args[:7]))
        rows = ((prow_a, srow_a), (prow_b, srow_b))
        token_rows = args[7:]
        (num_groups,) = cgutils.unpack_tuple(builder, srow_a.shape, 1)
        q = _MXFP4Q8IR(builder, lanes, num_groups)
        acc_slots = [cgutils.alloca_once_value(builder, ir.Constant(q.vf, [0.0] * lanes))
                     for _ in range(2 * num_tokens)]

        x_rows, correction_rows, scale_rows = _q8_token_rows(builder, xq, corrections, lane_scales, token_rows)

        def part_dots(step, part: int, tail: bool):
            """Every (row, token) acc += the groups of one part of `step`: each row decoded once, each token's
            activations loaded once."""
            decoded = [q.decode(prow, srow, step, part, tail) for prow, srow in rows]
            x_base = q.offset(step, 128, part * q.part_bytes)
            x_odd_base = builder.add(x_base, ir.Constant(q.index_type, 64))
            lane_base = q.offset(step, 16, part * lanes)
            for j in range(num_tokens):
                x_even = _load(builder, x_rows[j], x_base, q.vb, 1)
                x_odd = _load(builder, x_rows[j], x_odd_base, q.vb, 1)
                correction = _load(builder, correction_rows[j], lane_base, q.vi, 4)
                token_scale = _load(builder, scale_rows[j], lane_base, q.vf, 4)
                for i, (weights_low, weights_high, row_scale) in enumerate(decoded):
                    q.accumulate(acc_slots[i * num_tokens + j], q.dot(weights_low, weights_high, x_even, x_odd),
                                 correction, row_scale, token_scale)

        q.steps(part_dots)
        totals = [_pairwise_sum(builder, builder.load(slot), lanes) for slot in acc_slots]
        return context.make_tuple(builder, signature.return_type, totals)

    return codegen


def _unavailable_tile_codegen(context, builder, signature, args):
    # never executed: the drivers only call a tile on an instruction set in Q8_ISAS
    nan = ir.Constant(_F32, float("nan"))
    return context.make_tuple(builder, signature.return_type, [nan] * len(signature.return_type))


def _q8_tile_signature(num_tokens, rows, activations, token_rows):
    return types.UniTuple(types.float32, 2 * num_tokens)(*rows, *activations, *token_rows)


@intrinsic
def _mxfp4_q8_tile4_avx512(typingctx, pa, sa, pb, sb, xq, corrections, lane_scales, t0, t1, t2, t3):
    """2 MXFP4 rows x 4 tokens (rows t0..t3 of the activations) of int8 row dots, AVX-512 VNNI."""
    codegen = _mxfp4_q8_tile_codegen(16, 4) if "avx512" in Q8_ISAS else _unavailable_tile_codegen
    return _q8_tile_signature(4, (pa, sa, pb, sb), (xq, corrections, lane_scales), (t0, t1, t2, t3)), codegen


@intrinsic
def _mxfp4_q8_tile4_avx2(typingctx, pa, sa, pb, sb, xq, corrections, lane_scales, t0, t1, t2, t3):
    """The same 2 x 4 dots on AVX2 (the AVX2 row dot's bits)."""
    codegen = _mxfp4_q8_tile_codegen(8, 4) if "avx2" in Q8_ISAS else _unavailable_tile_codegen
    return _q8_tile_signature(4, (pa, sa, pb, sb), (xq, corrections, lane_scales), (t0, t1, t2, t3)), codegen


@intrinsic
def _mxfp4_q8_tile8_avx512(typingctx, pa, sa, pb, sb, xq, corrections, lane_scales, t0, t1, t2, t3, t4, t5, t6,
                           t7):
    """2 MXFP4 rows x 8 tokens of int8 row dots, AVX-512 VNNI."""
    codegen = _mxfp4_q8_tile_codegen(16, 8) if "avx512" in Q8_ISAS else _unavailable_tile_codegen
    return _q8_tile_signature(8, (pa, sa, pb, sb), (xq, corrections, lane_scales),
                              (t0, t1, t2, t3, t4, t5, t6, t7)), codegen


@intrinsic
def _mxfp4_q8_tile8_avx2(typingctx, pa, sa, pb, sb, xq, corrections, lane_scales, t0, t1, t2, t3, t4, t5, t6, t7):
    """The same 2 x 8 dots on AVX2."""
    codegen = _mxfp4_q8_tile_codegen(8, 8) if "avx2" in Q8_ISAS else _unavailable_tile_codegen
    return _q8_tile_signature(8, (pa, sa, pb, sb), (xq, corrections, lane_scales),
                              (t0, t1, t2, t3, t4, t5, t6, t7)), codegen


@njit(inline="always")
def _q8_tile_rows(pa, sa, pb, sb, xq, corrections, lane_scales, rows, gathered, start, end, isa, tile_tokens,
                  out_a, out_b, column_a, column_b):
    """out_a[n, column_a], out_b[n, column_b] = the int8 row dots of rows (pa, sa) and (pb, sb) with activation row
    rows[n] (or n when not `gathered`) for n in start:end: tile_tokens (8 or 4; anything else: the row dot) tokens
    a pass, then 4, then one at a time."""
    n = start
    while tile_tokens == 8 and n + 8 <= end:
        if gathered:
            t0, t1, t2, t3, t4, t5, t6, t7 = (rows[n], rows[n + 1], rows[n + 2], rows[n + 3], rows[n + 4],
                                              rows[n + 5], rows[n + 6], rows[n + 7])
        else:
            t0, t1, t2, t3, t4, t5, t6, t7 = n, n + 1, n + 2, n + 3, n + 4, n + 5, n + 6, n + 7
        if isa == 2:
            d = _mxfp4_q8_tile8_avx512(pa, sa, pb, sb, xq, corrections, lane_scales, t0, t1, t2, t3, t4, t5, t6, t7)
        else:
            d = _mxfp4_q8_tile8_avx2(pa, sa, pb, sb, xq, corrections, lane_scales, t0, t1, t2, t3, t4, t5, t6, t7)
        out_a[n, column_a], out_a[n + 1, column_a], out_a[n + 2, column_a], out_a[n + 3, column_a] = d[:4]
        out_a[n + 4, column_a], out_a[n + 5, column_a], out_a[n + 6, column_a], out_a[n + 7, column_a] = d[4:8]
        out_b[n, column_b], out_b[n + 1, column_b], out_b[n + 2, column_b], out_b[n + 3, column_b] = d[8:12]
        out_b[n + 4, column_b], out_b[n + 5, column_b], out_b[n + 6, column_b], out_b[n + 7, column_b] = d[12:]
        n += 8
    while tile_tokens >= 4 and n + 4 <= end:
        if gathered:
            t0, t1, t2, t3 = rows[n], rows[n + 1], rows[n + 2], rows[n + 3]
        else:
            t0, t1, t2, t3 = n, n + 1, n + 2, n + 3
        if isa == 2:
            d = _mxfp4_q8_tile4_avx512(pa, sa, pb, sb, xq, corrections, lane_scales, t0, t1, t2, t3)
        else:
            d = _mxfp4_q8_tile4_avx2(pa, sa, pb, sb, xq, corrections, lane_scales, t0, t1, t2, t3)
        out_a[n, column_a], out_a[n + 1, column_a], out_a[n + 2, column_a], out_a[n + 3, column_a] = d[:4]
        out_b[n, column_b], out_b[n + 1, column_b], out_b[n + 2, column_b], out_b[n + 3, column_b] = d[4:]
        n += 4
    while n < end:
        t = rows[n] if gathered else n
        out_a[n, column_a] = _mxfp4_q8_row_dot(pa, sa, xq[t], corrections[t], lane_scales[t], isa)
        out_b[n, column_b] = _mxfp4_q8_row_dot(pb, sb, xq[t], corrections[t], lane_scales[t], isa)
        n += 1


@njit(cache=True, parallel=True)
def _experts_q8_tiled_gate_up(w1p, w1s, w3p, w3s, expert_ids, xq, corrections, lane_scales, tokens, starts, ends,
                              isa, tile_tokens, gate, up):
    """`_experts_q8_gate_up` in tiles: gate, up [N, MI] (natural order), the same bits."""
    blocks = (w1p.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        k, block = task // blocks, task % blocks
        e = expert_ids[k]
        row_end = min(w1p.shape[1], (block + 1) * ROWS_PER_TASK)
        for chunk in range(starts[k], ends[k], Q8_TILE_CHUNK_TOKENS):
            chunk_end = min(ends[k], chunk + Q8_TILE_CHUNK_TOKENS)
            for row in range(block * ROWS_PER_TASK, row_end):  # the w1 and w3 row of one index together
                _q8_tile_rows(w1p[e, row], w1s[e, row], w3p[e, row], w3s[e, row], xq, corrections, lane_scales,
                              tokens, True, chunk, chunk_end, isa, tile_tokens, gate, up, row, row)


@njit(cache=True, parallel=True)
def _experts_q8_tiled_down(w2p, w2s, expert_ids, xq, corrections, lane_scales, starts, ends, isa, tile_tokens, out):
    """`_experts_q8_down` in tiles (xq etc. hold the quantized hidden rows [N, ...]), the same bits."""
    blocks = (w2p.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        k, block = task // blocks, task % blocks
        e = expert_ids[k]
        row_end = min(w2p.shape[1], (block + 1) * ROWS_PER_TASK)
        for chunk in range(starts[k], ends[k], Q8_TILE_CHUNK_TOKENS):
            chunk_end = min(ends[k], chunk + Q8_TILE_CHUNK_TOKENS)
            for row in range(block * ROWS_PER_TASK, row_end, 2):  # rows in pairs; an odd last row twice
                other = min(row + 1, row_end - 1)
                _q8_tile_rows(w2p[e, row], w2s[e, row], w2p[e, other], w2s[e, other], xq, corrections, lane_scales,
                              starts, False, chunk, chunk_end, isa, tile_tokens, out, out, row, other)


# The families' int8 experts (per row: w[r, c] = q_w[r, c] s[r], `families.experts.Int8Matrix`) on Q8_0
# activations, llama.cpp's ggml_vec_dot_q8_0_q8_0 arithmetic with a per-row weight scale (opt-in:
# K3SERVE_INT8_ACTIVATIONS=q8, `generate`/`serve --int8-activations q8`; the switch's default, "auto", keeps these
# on float activations and puts a GGUF's Q8_0 experts, which carry block scales, on Q8_0 ones: `q8_0_experts_on`):
#
#     y[t, r] = s[r] * sum_lanes sum_k d[t, g(lane)] * (sum_{4 bytes of the lane} q_w q_x)
#
# AVX-512 VNNI: vpdpbusd needs one unsigned side, so the weight bytes are offset by 128 (w ^ 0x80 = w + 128, once a
# row for all tokens) and 128 * (each lane's 4 q_x), precomputed per token, is subtracted. AVX2: vpmaddubsw on |w|
# and q_x with w's sign (vpsignb; |w| <= 128 and |q_x| <= 127, so a pair's sum stays under 32767), then vpmaddwd by
# ones. Each lane's int32 is exact; one FMA a lane folds it in with d. The same tiles of 2 rows x 8, 4 or 1 tokens.
INT8_ACTIVATIONS = os.environ.get("K3SERVE_INT8_ACTIVATIONS", "auto").strip().lower() or "auto"
if INT8_ACTIVATIONS not in ("auto", "f32", "q8") or (INT8_ACTIVATIONS != "f32" and not Q8_ISAS):
    if INT8_ACTIVATIONS != "auto":  # auto on a CPU without the int8 instructions: floats, silently
        logger.warning("K3SERVE_INT8_ACTIVATIONS=%r: %s; the int8 experts run on float activations (f32)",
                       INT8_ACTIVATIONS, "known: auto, f32, q8" if INT8_ACTIVATIONS != "q8" else
                       "q8 needs AVX2 or AVX-512 VNNI, which this CPU lacks")
    INT8_ACTIVATIONS = "f32"
elif INT8_ACTIVATIONS == "q8":
    logger.info("int8 experts on Q8_0 activations (int8 dot products, %s)", Q8_ISAS[-1])
_INT8_OFFSET = 128
_INT8_CHUNK = 64  # activation rows are padded to a multiple of this many bytes (one AVX-512 step)


@njit(cache=True)
def _int8_q8_activations(q, d, xq, corrections, lane_scales):
    """Q8_0 activations q int8 [T, C], d f32 [T, G] -> xq int8 [T, P] (P = C rounded up to 64, zero padded),
    corrections int32 [T, P / 4] = 128 * the sum of each lane's 4 q, lane_scales f32 [T, P / 4] = the d of each
    lane's group (lane l holds bytes 4 l .. 4 l + 3)."""
    xq[:] = 0
    corrections[:] = 0
    lane_scales[:] = 0
    for t in range(q.shape[0]):
        for c in range(q.shape[1]):
            xq[t, c] = q[t, c]
            corrections[t, c // 4] += _INT8_OFFSET * np.int32(q[t, c])
        for lane in range(q.shape[1] // 4):
            lane_scales[t, lane] = d[t, lane // 8]


def _int8_q8_prepare(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """f32 [T, C] -> (xq int8 [T, P], corrections int32 [T, P / 4], lane scales f32 [T, P / 4])."""
    q, d = quantize_activations(x)  # [T, C] int8, [T, G]
    padded = (x.shape[1] + _INT8_CHUNK - 1) // _INT8_CHUNK * _INT8_CHUNK
    xq = np.empty((x.shape[0], padded), np.int8)  # [T, P]
    corrections = np.empty((x.shape[0], padded // 4), np.int32)  # [T, P / 4]
    lane_scales = np.empty((x.shape[0], padded // 4), np.float32)  # [T, P / 4]
    _int8_q8_activations(q, d, xq, corrections, lane_scales)
    return xq, corrections, lane_scales


def _int8_q8_tile_codegen(lanes: int, num_tokens: int):
    """IR of the unscaled int8 dots of two int8 rows (a, b) with `num_tokens` activation rows: args (w_a, w_b int8
    [C], xq, corrections, lane_scales of `_int8_q8_prepare`, then num_tokens row indices) -> 2 num_tokens float32
    (a's, then b's); the caller multiplies by the rows' scales."""
    chunk_bytes = 4 * lanes

    def codegen(context, builder, signature, args):
        w_a, w_b, xq, corrections, lane_scales = (context.make_array(t)(context, builder, a)
                                                  for t, a in zip(signature.args[:5], args[:5]))
        token_rows = args[5:]
        (num_columns,) = cgutils.unpack_tuple(builder, w_a.shape, 1)
        module = builder.module
        index_type = ir.IntType(64)
        vb, vi, vf = _vector(_I8, chunk_bytes), _vector(_I32, lanes), _vector(_F32, lanes)
        fma = cgutils.get_or_insert_function(module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{lanes}f32")
        if lanes == 16:
            dpbusd = cgutils.get_or_insert_function(module, ir.FunctionType(vi, [vi, vi, vi]),
                                                    "llvm.x86.avx512.vpdpbusd.512")
            masked_load = cgutils.get_or_insert_function(
                module, ir.FunctionType(vb, [vb.as_pointer(), _I32, _vector(ir.IntType(1), chunk_bytes), vb]),
                f"llvm.masked.load.v{chunk_bytes}i8.p0")
            offset = ir.Constant(vb, [-128] * chunk_bytes)
            half_mask = ir.Constant(_vector(ir.IntType(1), chunk_bytes), [1] * (chunk_bytes // 2)
                                    + [0] * (chunk_bytes // 2))
        else:
            vw = _vector(ir.IntType(16), 16)
            maddubs = cgutils.get_or_insert_function(module, ir.FunctionType(vw, [vb, vb]),
                                                     "llvm.x86.avx2.pmadd.ub.sw")
            maddwd = cgutils.get_or_insert_function(module, ir.FunctionType(vi, [vw, vw]), "llvm.x86.avx2.pmadd.wd")
            psign = cgutils.get_or_insert_function(module, ir.FunctionType(vb, [vb, vb]), "llvm.x86.avx2.psign.b")
            absolute = cgutils.get_or_insert_function(module, ir.FunctionType(vb, [vb, ir.IntType(1)]),
                                                      f"llvm.abs.v{chunk_bytes}i8")
            ones = ir.Constant(vw, [1] * 16)
        acc_slots = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * lanes)) for _ in range(2 * num_tokens)]

        x_rows, correction_rows, scale_rows = _q8_token_rows(builder, xq, corrections, lane_scales, token_rows)

        def chunk_dots(chunk, half: bool):
            """Every (row, token) acc += one chunk of `chunk_bytes` weights (AVX-512's last chunk may hold 32)."""
            byte_base = builder.mul(chunk, ir.Constant(index_type, chunk_bytes))
            weights = []
            for w in (w_a, w_b):
                pointer = builder.bitcast(builder.gep(w.data, [byte_base]), vb.as_pointer())
                if half:  # the row's last 32 bytes; the rest reads as 0 (+ 128 meets padded zero q)
                    values = builder.call(masked_load, [pointer, ir.Constant(_I32, 1), half_mask,
                                                        ir.Constant(vb, [0] * chunk_bytes)])
                else:
                    values = builder.load(pointer, align=1)
                if lanes == 16:
                    weights.append((builder.bitcast(builder.xor(values, offset), vi), None))
                else:
                    weights.append((builder.call(absolute, [values, ir.Constant(ir.IntType(1), 0)]), values))
            lane_base = builder.mul(chunk, ir.Constant(index_type, lanes))
            for j in range(num_tokens):
                x = _load(builder, x_rows[j], byte_base, vb, 1)
                token_scale = _load(builder, scale_rows[j], lane_base, vf, 4)
                correction = _load(builder, correction_rows[j], lane_base, vi, 4) if lanes == 16 else None
                for i, (unsigned, signs) in enumerate(weights):
                    if lanes == 16:
                        sums = builder.call(dpbusd, [ir.Constant(vi, [0] * lanes), unsigned,
                                                     builder.bitcast(x, vi)])
                        sums = builder.sub(sums, correction)
                    else:
                        pairs = builder.call(maddubs, [unsigned, builder.call(psign, [x, signs])])
                        sums = builder.call(maddwd, [pairs, ones])
                    slot = acc_slots[i * num_tokens + j]
                    builder.store(builder.call(fma, [builder.sitofp(sums, vf), token_scale, builder.load(slot)]),
                                  slot)

        full_chunks = builder.udiv(num_columns, ir.Constant(index_type, chunk_bytes))
        with cgutils.for_range(builder, full_chunks) as loop:
            chunk_dots(loop.index, half=False)
        if lanes == 16:  # C = 64 k + 32
            has_half = builder.icmp_unsigned(
                "!=", builder.mul(full_chunks, ir.Constant(index_type, chunk_bytes)), num_columns)
            with builder.if_then(has_half):
                chunk_dots(full_chunks, half=True)
        totals = [_pairwise_sum(builder, builder.load(slot), lanes) for slot in acc_slots]
        return context.make_tuple(builder, signature.return_type, totals)

    return codegen


def _int8_q8_tile_intrinsic(isa: str, num_tokens: int):
    lanes = {"avx512": 16, "avx2": 8}[isa]

    def typer(typingctx, *operands):
        if len(operands) != 5 + num_tokens:
            return None
        codegen = _int8_q8_tile_codegen(lanes, num_tokens) if isa in Q8_ISAS else _unavailable_tile_codegen
        return types.UniTuple(types.float32, 2 * num_tokens)(*operands), codegen

    return typer


@intrinsic
def _int8_q8_tile8_avx512(typingctx, wa, wb, xq, corrections, lane_scales, t0, t1, t2, t3, t4, t5, t6, t7):
    """2 int8 rows x 8 tokens, AVX-512 VNNI (unscaled)."""
    return _int8_q8_tile_intrinsic("avx512", 8)(typingctx, wa, wb, xq, corrections, lane_scales, t0, t1, t2, t3,
                                                t4, t5, t6, t7)


@intrinsic
def _int8_q8_tile8_avx2(typingctx, wa, wb, xq, corrections, lane_scales, t0, t1, t2, t3, t4, t5, t6, t7):
    """The same on AVX2."""
    return _int8_q8_tile_intrinsic("avx2", 8)(typingctx, wa, wb, xq, corrections, lane_scales, t0, t1, t2, t3, t4,
                                              t5, t6, t7)


@intrinsic
def _int8_q8_tile4_avx512(typingctx, wa, wb, xq, corrections, lane_scales, t0, t1, t2, t3):
    """2 int8 rows x 4 tokens, AVX-512 VNNI (unscaled)."""
    return _int8_q8_tile_intrinsic("avx512", 4)(typingctx, wa, wb, xq, corrections, lane_scales, t0, t1, t2, t3)


@intrinsic
def _int8_q8_tile4_avx2(typingctx, wa, wb, xq, corrections, lane_scales, t0, t1, t2, t3):
    """The same on AVX2."""
    return _int8_q8_tile_intrinsic("avx2", 4)(typingctx, wa, wb, xq, corrections, lane_scales, t0, t1, t2, t3)


@intrinsic
def _int8_q8_tile1_avx512(typingctx, wa, wb, xq, corrections, lane_scales, t0):
    """2 int8 rows x 1 token, AVX-512 VNNI (unscaled)."""
    return _int8_q8_tile_intrinsic("avx512", 1)(typingctx, wa, wb, xq, corrections, lane_scales, t0)


@intrinsic
def _int8_q8_tile1_avx2(typingctx, wa, wb, xq, corrections, lane_scales, t0):
    """The same on AVX2."""
    return _int8_q8_tile_intrinsic("avx2", 1)(typingctx, wa, wb, xq, corrections, lane_scales, t0)


@njit(inline="always")
def _int8_q8_tile_rows(wa, wb, scale_a, scale_b, xq, corrections, lane_scales, rows, gathered, start, end, isa,
                       out_a, out_b, column_a, column_b):
    """out_a[n, column_a] = scale_a * (row wa . activation row rows[n] (or n when not `gathered`)), and the same for
    b, for n in start:end: 8 tokens a pass, then 4, then 1. Each output's bits depend on its row and token only."""
    n = start
    while n + 8 <= end:
        if gathered:
            t0, t1, t2, t3, t4, t5, t6, t7 = (rows[n], rows[n + 1], rows[n + 2], rows[n + 3], rows[n + 4],
                                              rows[n + 5], rows[n + 6], rows[n + 7])
        else:
            t0, t1, t2, t3, t4, t5, t6, t7 = n, n + 1, n + 2, n + 3, n + 4, n + 5, n + 6, n + 7
        if isa == 2:
            d = _int8_q8_tile8_avx512(wa, wb, xq, corrections, lane_scales, t0, t1, t2, t3, t4, t5, t6, t7)
        else:
            d = _int8_q8_tile8_avx2(wa, wb, xq, corrections, lane_scales, t0, t1, t2, t3, t4, t5, t6, t7)
        for i in range(8):
            out_a[n + i, column_a] = scale_a * d[i]
            out_b[n + i, column_b] = scale_b * d[8 + i]
        n += 8
    while n + 4 <= end:
        if gathered:
            t0, t1, t2, t3 = rows[n], rows[n + 1], rows[n + 2], rows[n + 3]
        else:
            t0, t1, t2, t3 = n, n + 1, n + 2, n + 3
        if isa == 2:
            d = _int8_q8_tile4_avx512(wa, wb, xq, corrections, lane_scales, t0, t1, t2, t3)
        else:
            d = _int8_q8_tile4_avx2(wa, wb, xq, corrections, lane_scales, t0, t1, t2, t3)
        for i in range(4):
            out_a[n + i, column_a] = scale_a * d[i]
            out_b[n + i, column_b] = scale_b * d[4 + i]
        n += 4
    while n < end:
        t = rows[n] if gathered else n
        if isa == 2:
            d = _int8_q8_tile1_avx512(wa, wb, xq, corrections, lane_scales, t)
        else:
            d = _int8_q8_tile1_avx2(wa, wb, xq, corrections, lane_scales, t)
        out_a[n, column_a] = scale_a * d[0]
        out_b[n, column_b] = scale_b * d[1]
        n += 1


@njit(cache=True, parallel=True)
def _int8_q8_gate_up(gate_up, gate_up_scales, expert_ids, xq, corrections, lane_scales, tokens, starts, ends, isa,
                     hidden):
    """hidden[n, i] = SiLU(gate) * up of the gate row i and up row I + i (each times its row scale) of expert
    expert_ids[k] for the tokens n of starts[k]:ends[k]; gate_up int8 [E, 2I, H], scales f32 [E, 2I, 1]."""
    width = hidden.shape[1]
    blocks = (width + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        k, block = task // blocks, task % blocks
        e = expert_ids[k]
        row_end = min(width, (block + 1) * ROWS_PER_TASK)
        up = np.empty((Q8_TILE_CHUNK_TOKENS, ROWS_PER_TASK), np.float32)  # the chunk's up values
        gate = np.empty((Q8_TILE_CHUNK_TOKENS, ROWS_PER_TASK), np.float32)
        for chunk in range(starts[k], ends[k], Q8_TILE_CHUNK_TOKENS):
            chunk_end = min(ends[k], chunk + Q8_TILE_CHUNK_TOKENS)
            for row in range(block * ROWS_PER_TASK, row_end):
                column = row - block * ROWS_PER_TASK
                _int8_q8_tile_rows(gate_up[e, row], gate_up[e, width + row], gate_up_scales[e, row, 0],
                                   gate_up_scales[e, width + row, 0], xq, corrections, lane_scales,
                                   tokens[chunk:chunk_end], True, 0, chunk_end - chunk, isa, gate, up, column,
                                   column)
            for n in range(chunk, chunk_end):
                for row in range(block * ROWS_PER_TASK, row_end):
                    column = row - block * ROWS_PER_TASK
                    hidden[n, row] = _silu_glu(gate[n - chunk, column], up[n - chunk, column])


@njit(cache=True, parallel=True)
def _int8_q8_down(down, down_scales, expert_ids, xq, corrections, lane_scales, starts, ends, isa, out):
    """out[n] = down_e hidden[n] (xq etc. hold the quantized hidden rows [N, ...]); rows in pairs, an odd last row
    twice."""
    blocks = (down.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        k, block = task // blocks, task % blocks
        e = expert_ids[k]
        row_end = min(down.shape[1], (block + 1) * ROWS_PER_TASK)
        for chunk in range(starts[k], ends[k], Q8_TILE_CHUNK_TOKENS):
            chunk_end = min(ends[k], chunk + Q8_TILE_CHUNK_TOKENS)
            for row in range(block * ROWS_PER_TASK, row_end, 2):
                other = min(row + 1, row_end - 1)
                _int8_q8_tile_rows(down[e, row], down[e, other], down_scales[e, row, 0], down_scales[e, other, 0],
                                   xq, corrections, lane_scales, starts, False, chunk, chunk_end, isa, out, out, row,
                                   other)


def int8_experts_q8(gate_up: np.ndarray, gate_up_scales: np.ndarray, down: np.ndarray, down_scales: np.ndarray,
                    expert_ids: np.ndarray, x: np.ndarray, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                    out: np.ndarray | None = None, isa: str | None = None) -> np.ndarray:
    """`dense_experts_run` for per-row int8 experts (gate_up int8 [E, 2I, H], down [E, H, I], scales f32 [E, 2I]
    and [E, H]) with x and the hidden rows quantized to Q8_0 (see the section comment; other bits than the float
    path, llama.cpp's error). `out` [N, H], when given, is filled on the experts' rows only. `isa`: one of
    `Q8_ISAS` (default the best)."""
    code = _q8_isa_code(isa)
    x = np.ascontiguousarray(x, dtype=np.float32)
    num_experts, hidden_size, width = down.shape
    if (gate_up.dtype != np.int8 or down.dtype != np.int8 or gate_up.shape != (num_experts, 2 * width, hidden_size)
            or x.ndim != 2 or x.shape[1] != hidden_size or hidden_size % GROUP_SIZE or width % GROUP_SIZE
            or np.size(gate_up_scales) != num_experts * 2 * width or np.size(down_scales) != num_experts * hidden_size):
        raise ValueError(f"int8 experts gate_up {gate_up.shape} {gate_up.dtype} / down {down.shape} {down.dtype} with "
                         f"per-row scales do not fit x {x.shape} (widths must be multiples of {GROUP_SIZE})")
    if out is None:
        out = np.empty((tokens.shape[0], hidden_size), np.float32)  # [N, H]
    if tokens.shape[0] == 0 or expert_ids.shape[0] == 0:
        return out
    expert_ids = np.ascontiguousarray(expert_ids, dtype=np.int64)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    ends = np.ascontiguousarray(ends, dtype=np.int64)
    hidden = np.zeros((tokens.shape[0], width), np.float32)  # [N, I]; rows of experts not in this call stay 0
    _int8_q8_gate_up(np.ascontiguousarray(gate_up), np.ascontiguousarray(gate_up_scales, np.float32).reshape(
        num_experts, 2 * width, 1), expert_ids, *_int8_q8_prepare(x), np.ascontiguousarray(tokens, dtype=np.int64),
        starts, ends, code, hidden)
    _int8_q8_down(np.ascontiguousarray(down), np.ascontiguousarray(down_scales, np.float32).reshape(
        num_experts, hidden_size, 1), expert_ids, *_int8_q8_prepare(hidden), starts, ends, code, out)
    return out


# ------------------------------------------------------------------------------------------- routed experts
@njit(inline="always", fastmath=False)
def _silu_glu(gate: np.float32, up: np.float32) -> np.float32:
    """SiLU(gate) * up = gate sigmoid(gate) up (the families' experts)."""
    return gate / (np.float32(1.0) + np.exp(-gate)) * up


ACTIVATIONS = {"situ": 0, "silu": 1}


@njit
def _gate_up_tiles(w1, w1s, w3, w3s, zp, tokens, start, end, half_scales, gate, up, row, row_end):
    """`_gate_up_task`'s prefill pass: for each index of row:row_end, its w1 and w3 rows (one expert's) against the
    tokens start:end four at a time, the last 1-3 one at a time. Called, not inlined (see `_rows_dot_tiles`)."""
    for r in range(row, row_end):
        column = _permuted_index(r)
        n = start
        while n + 4 <= end:
            g0, g1, g2, g3, u0, u1, u2, u3 = _row_dots_2x4(w1[r], w3[r], w1s[r], w3s[r], zp[tokens[n]],
                                                           zp[tokens[n + 1]], zp[tokens[n + 2]], zp[tokens[n + 3]],
                                                           half_scales)
            gate[n, column], gate[n + 1, column], gate[n + 2, column], gate[n + 3, column] = g0, g1, g2, g3
            up[n, column], up[n + 1, column], up[n + 2, column], up[n + 3, column] = u0, u1, u2, u3
            n += 4
        while n < end:
            gate[n, column], up[n, column] = _row_dots2(w1[r], w3[r], w1s[r], w3s[r], zp[tokens[n]], half_scales,
                                                        _TILE_ISA)
            n += 1


@njit(inline="always")
def _gate_up_task(w1p, w1s, w3p, w3s, expert_ids, zp, tokens, starts, ends, half_scales, isa, gate, up, task,
                  blocks, rows_per_dot):
    """The w1 and w3 rows of a block against each token: with rows_per_dot 2 the w1 and w3 row of one index in one
    pass over z, with 4 those of two indices; 1 runs each dot alone. The bits are the same."""
    k = task // blocks
    e = expert_ids[k]
    row = (task % blocks) * ROWS_PER_TASK
    row_end = min(w1p.shape[1], row + ROWS_PER_TASK)
    if isa == _TILE_ISA and isa != 0 and ends[k] - starts[k] >= MXFP4_TILE_TOKENS:  # prefill: w1 and w3 rows x 4
        _gate_up_tiles(w1p[e], w1s[e], w3p[e], w3s[e], zp, tokens, starts[k], ends[k], half_scales, gate, up, row,
                       row_end)
        return
    while rows_per_dot >= 4 and row + 2 <= row_end:
        column, next_column = _permuted_index(row), _permuted_index(row + 1)
        for n in range(starts[k], ends[k]):
            g0, u0, g1, u1 = _row_dots4(w1p[e, row], w3p[e, row], w1p[e, row + 1], w3p[e, row + 1], w1s[e, row],
                                        w3s[e, row], w1s[e, row + 1], w3s[e, row + 1], zp[tokens[n]], half_scales,
                                        isa)
            gate[n, column], up[n, column], gate[n, next_column], up[n, next_column] = g0, u0, g1, u1
        row += 2
    for row in range(row, row_end):
        column = _permuted_index(row)
        for n in range(starts[k], ends[k]):
            z_row = zp[tokens[n]]
            if rows_per_dot >= 2:
                gate[n, column], up[n, column] = _row_dots2(w1p[e, row], w3p[e, row], w1s[e, row], w3s[e, row],
                                                            z_row, half_scales, isa)
            else:
                gate[n, column] = _row_dot(w1p[e, row], w1s[e, row], z_row, half_scales, isa)
                up[n, column] = _row_dot(w3p[e, row], w3s[e, row], z_row, half_scales, isa)


@njit(inline="always")
def _down_task(w2p, w2s, expert_ids, starts, ends, half_scales, isa, hidden, out, task, blocks, rows_per_dot):
    k = task // blocks
    e = expert_ids[k]
    row_end = min(w2p.shape[1], (task % blocks + 1) * ROWS_PER_TASK)
    _rows_dot_into(w2p[e], w2s[e], hidden, half_scales, isa, rows_per_dot, (task % blocks) * ROWS_PER_TASK, row_end,
                   starts[k], ends[k], out)


@njit(cache=True, parallel=True)
def _experts_gate_up_parallel(w1p, w1s, w3p, w3s, expert_ids, zp, tokens, starts, ends, half_scales, isa, gate,
                              up, rows_per_dot=MXFP4_GATE_UP_ROWS_PER_DOT):
    """Stage 1 of `mxfp4_experts_run` over (expert, w1/w3 row block): the gate and up dots, no activation."""
    blocks = (w1p.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        _gate_up_task(w1p, w1s, w3p, w3s, expert_ids, zp, tokens, starts, ends, half_scales, isa, gate, up, task,
                      blocks, rows_per_dot)


@njit(cache=True)
def _experts_gate_up_serial(w1p, w1s, w3p, w3s, expert_ids, zp, tokens, starts, ends, half_scales, isa, gate, up,
                            rows_per_dot=MXFP4_GATE_UP_ROWS_PER_DOT):
    blocks = (w1p.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in range(expert_ids.shape[0] * blocks):
        _gate_up_task(w1p, w1s, w3p, w3s, expert_ids, zp, tokens, starts, ends, half_scales, isa, gate, up, task,
                      blocks, rows_per_dot)


@njit(cache=True, parallel=True)
def _experts_down_parallel(w2p, w2s, expert_ids, starts, ends, half_scales, isa, hidden, out,
                           rows_per_dot=MXFP4_ROWS_PER_DOT):
    """Stage 2 of `mxfp4_experts_run` over (expert, w2 row block)."""
    blocks = (w2p.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        _down_task(w2p, w2s, expert_ids, starts, ends, half_scales, isa, hidden, out, task, blocks, rows_per_dot)


@njit(cache=True)
def _experts_down_serial(w2p, w2s, expert_ids, starts, ends, half_scales, isa, hidden, out,
                         rows_per_dot=MXFP4_ROWS_PER_DOT):
    blocks = (w2p.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in range(expert_ids.shape[0] * blocks):
        _down_task(w2p, w2s, expert_ids, starts, ends, half_scales, isa, hidden, out, task, blocks, rows_per_dot)


def expert_activation(gate: np.ndarray, up: np.ndarray, beta: float, linear_beta: float, activation: str) -> None:
    """gate <- act(gate, up) in place with numpy's vectorized ufuncs: `ops.situ_glu` (the dense MLP's and the
    shared expert's activation) or `ops.silu(gate) * up`. Each element's bits depend only on its own gate and up.
    numpy's overflow warnings are off (a large gate overflows exp on the way to the right limit); a real overflow
    still shows as inf."""
    if activation not in ("situ", "silu"):
        raise ValueError(f"unknown expert activation {activation!r} (known: situ, silu)")
    with np.errstate(over="ignore", invalid="ignore"):
        if activation == "situ":
            situ_glu(gate, up, beta, linear_beta, out=gate)
        else:
            np.multiply(silu(gate), up, out=gate)


@njit(cache=True, fastmath=False)
def _accumulate_rows(out: np.ndarray, tokens: np.ndarray, token_weights: np.ndarray, mixed: np.ndarray) -> None:
    """mixed[tokens[i]] += token_weights[i] * out[i], in row order (experts ascending)."""
    for i in range(tokens.shape[0]):
        weight = token_weights[i]
        for j in range(out.shape[1]):
            mixed[tokens[i], j] += weight * out[i, j]


StackedExperts = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def mxfp4_experts_run(stacked: StackedExperts, expert_ids: np.ndarray, z: np.ndarray, tokens: np.ndarray,
                      starts: np.ndarray, ends: np.ndarray, beta: float, linear_beta: float,
                      isa: str | None = None, activation: str = "situ", activations: str | None = None) -> np.ndarray:
    """y[n] = w2_e SiTU-GLU(w1_e z[tokens[n]], w3_e z[tokens[n]]) for every routed (token, expert) pair, in one
    compiled call. stacked = (w1 packed, w1 scales, w3 packed, w3 scales, w2 packed, w2 scales), each [E, ...]
    (u8 [E, MI, LT/2], [E, MI, LT/32], ..., [E, LT, MI/2], [E, LT, MI/32]); expert_ids [K] index E; expert k owns
    rows starts[k]:ends[k] of tokens [N]. z [T, LT] -> y [N, LT]. Each y[n] is the same bits whatever the other
    tokens, experts and threads of the call. activation "silu" computes SiLU(w1 z) * (w3 z) instead (beta and
    linear_beta unused). activations "q8" (default `MXFP4_ACTIVATIONS`) quantizes z and the hidden rows to Q8_0 and
    runs the int8 row dot (section "MXFP4 x int8"; other bits, llama.cpp's error) on `isa` if it is one of
    `Q8_ISAS`, else on the best of them."""
    w1p, w1s, w3p, w3s, w2p, w2s = stacked
    num_inner, latent = w1p.shape[1], 2 * w1p.shape[2]
    z = np.ascontiguousarray(z, dtype=np.float32)
    if z.ndim != 2 or z.shape[1] != latent or w2p.shape[1] != latent or 2 * w2p.shape[2] != num_inner:
        raise ValueError(f"experts [{num_inner}, {latent}] / [{w2p.shape[1]}, {2 * w2p.shape[2]}] do not fit z "
                         f"{z.shape}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
    activations = MXFP4_ACTIVATIONS if activations is None else activations
    if activations == "q8":
        return _mxfp4_experts_run_q8(stacked, expert_ids, z, tokens, starts, ends, beta, linear_beta, activation,
                                     _q8_isa_code(isa if isa in Q8_ISAS else None))
    if activations != "f32":
        raise ValueError(f"unknown activations {activations!r} (known: f32, q8)")
    code = _isa_code(isa)
    zp = np.empty_like(z)  # [T, LT]
    permute_groups(z, zp)
    gate = np.empty((tokens.shape[0], num_inner), np.float32)  # [N, MI] permuted; then the activation
    up = np.empty((tokens.shape[0], num_inner), np.float32)  # [N, MI] permuted
    out = np.empty((tokens.shape[0], latent), np.float32)  # [N, LT]
    if tokens.shape[0] == 0:
        return out
    parallel = expert_ids.shape[0] * num_inner * latent >= PARALLEL_MIN_WEIGHTS
    expert_ids = np.ascontiguousarray(expert_ids, dtype=np.int64)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    ends = np.ascontiguousarray(ends, dtype=np.int64)
    (_experts_gate_up_parallel if parallel else _experts_gate_up_serial)(
        w1p, w1s, w3p, w3s, expert_ids, zp, np.ascontiguousarray(tokens, dtype=np.int64), starts, ends,
        _HALF_SCALES, code, gate, up, MXFP4_GATE_UP_ROWS_PER_DOT)
    expert_activation(gate, up, beta, linear_beta, activation)
    (_experts_down_parallel if parallel else _experts_down_serial)(w2p, w2s, expert_ids, starts, ends, _HALF_SCALES,
                                                                   code, gate, out, MXFP4_ROWS_PER_DOT)
    return out


def _mxfp4_experts_run_q8(stacked: StackedExperts, expert_ids: np.ndarray, z: np.ndarray, tokens: np.ndarray,
                          starts: np.ndarray, ends: np.ndarray, beta: float, linear_beta: float,
                          activation: str, code: int, out: np.ndarray | None = None,
                          tile_tokens: int | None = None) -> np.ndarray:
    """`mxfp4_experts_run` on the int8 path (z checked there), instruction set `code`: experts with tile_tokens (8
    or 4; default `Q8_TILE_TOKENS`, read at each call) tokens or more in the tiles of section "int8 tiles"
    (the row dot's bits); tile_tokens 1 runs every dot alone (the kernels before the tiles, kept for the A/B).
    `out` [N, LT], when given, is filled on the experts' rows only."""
    w1p, w1s, w3p, w3s, w2p, w2s = stacked
    num_pairs, num_inner, latent = tokens.shape[0], w1p.shape[1], z.shape[1]
    if num_pairs == 0 or expert_ids.shape[0] == 0:
        return np.empty((num_pairs, latent), np.float32) if out is None else out
    tile_tokens = Q8_TILE_TOKENS if tile_tokens is None else tile_tokens
    if tile_tokens not in (1, 4, 8):
        raise ValueError(f"tile_tokens must be 1, 4 or 8, got {tile_tokens}")
    expert_ids = np.ascontiguousarray(expert_ids, dtype=np.int64)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    ends = np.ascontiguousarray(ends, dtype=np.int64)
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    # [N, MI]: with `out` the experts may cover some rows only; the others are zeros (quantized, never read)
    allocate = np.empty if out is None else np.zeros
    gate, up = allocate((num_pairs, num_inner), np.float32), allocate((num_pairs, num_inner), np.float32)
    if out is None:
        out = np.empty((num_pairs, latent), np.float32)  # [N, LT]
    if tile_tokens == 1:
        _experts_q8_gate_up(w1p, w1s, w3p, w3s, expert_ids, *_q8_vnni_prepare(z), tokens, starts, ends, code, gate,
                            up)
    else:
        _experts_q8_tiled_gate_up(w1p, w1s, w3p, w3s, expert_ids, *_q8_vnni_prepare(z), tokens, starts, ends, code,
                                  tile_tokens, gate, up)
    expert_activation(gate, up, beta, linear_beta, activation)
    if tile_tokens == 1:
        _experts_q8_down(w2p, w2s, expert_ids, *_q8_vnni_prepare(gate), starts, ends, code, out)
    else:
        _experts_q8_tiled_down(w2p, w2s, expert_ids, *_q8_vnni_prepare(gate), starts, ends, code, tile_tokens, out)
    return out


def mxfp4_experts_accumulate_stacked(stacked: StackedExperts, expert_ids: np.ndarray, z: np.ndarray,
                                     tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                                     token_weights: np.ndarray, beta: float, linear_beta: float,
                                     mixed: np.ndarray, isa: str | None = None) -> None:
    """mixed[tokens[n]] += token_weights[n] * y[n] (`mxfp4_experts_run`), added in n order."""
    out = mxfp4_experts_run(stacked, expert_ids, z, tokens, starts, ends, beta, linear_beta, isa)
    _accumulate_rows(out, np.ascontiguousarray(tokens, dtype=np.int64),
                     np.ascontiguousarray(token_weights, dtype=np.float32), mixed)


def accumulate_expert_rows(y: np.ndarray, tokens: np.ndarray, token_weights: np.ndarray, mixed: np.ndarray) -> None:
    """mixed[tokens[n]] += token_weights[n] * y[n], added in n order: the accumulation of
    `mxfp4_experts_accumulate_stacked`, for outputs y [N, LT] computed elsewhere (expert parallelism)."""
    _accumulate_rows(np.ascontiguousarray(y, dtype=np.float32), np.ascontiguousarray(tokens, dtype=np.int64),
                     np.ascontiguousarray(token_weights, dtype=np.float32), mixed)


def stack_expert(w1: tuple[np.ndarray, np.ndarray], w3: tuple[np.ndarray, np.ndarray],
                 w2: tuple[np.ndarray, np.ndarray]) -> StackedExperts:
    """One expert as a stack of one (views, no copy)."""
    return tuple(np.ascontiguousarray(a)[None] for a in (*w1, *w3, *w2))  # type: ignore[return-value]


def mxfp4_expert_forward(
    w1: tuple[np.ndarray, np.ndarray], w3: tuple[np.ndarray, np.ndarray], w2: tuple[np.ndarray, np.ndarray],
    z: np.ndarray, beta: float, linear_beta: float, isa: str | None = None,
) -> np.ndarray:
    """One routed expert, w2 SiTU-GLU(w1 z, w3 z), each matrix given as (packed, scales). z [T, LT] -> [T, LT]."""
    z = np.ascontiguousarray(z, dtype=np.float32)
    _check_operands(*w1, z)
    num_tokens = z.shape[0]
    return mxfp4_experts_run(stack_expert(w1, w3, w2), np.zeros(1, np.int64), z, np.arange(num_tokens),
                             np.zeros(1, np.int64), np.full(1, num_tokens, np.int64), beta, linear_beta, isa)


def mxfp4_expert_accumulate(
    w1: tuple[np.ndarray, np.ndarray], w3: tuple[np.ndarray, np.ndarray], w2: tuple[np.ndarray, np.ndarray],
    z: np.ndarray, tokens: np.ndarray, token_weights: np.ndarray, beta: float, linear_beta: float,
    mixed: np.ndarray,
) -> None:
    """mixed[tokens] += token_weights * expert(z[tokens]) for one routed expert, in one compiled call."""
    mxfp4_experts_accumulate_stacked(stack_expert(w1, w3, w2), np.zeros(1, np.int64), z, tokens,
                                     np.zeros(1, np.int64), np.full(1, len(tokens), np.int64), token_weights,
                                     beta, linear_beta, mixed)


def mxfp4_experts_accumulate(
    experts: list[tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]],
    z: np.ndarray, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray, token_weights: np.ndarray,
    beta: float, linear_beta: float, mixed: np.ndarray,
) -> None:
    """Several routed experts given one by one (copied into a stack; callers holding a stacked layer use
    `mxfp4_experts_accumulate_stacked`). Bit-identical to `mxfp4_expert_accumulate` per expert in order."""
    stacked = tuple(np.stack([expert[m][part] for expert in experts]) for m in range(3) for part in range(2))
    mxfp4_experts_accumulate_stacked(stacked, np.arange(len(experts)), z, tokens, starts, ends,  # type: ignore
                                     token_weights, beta, linear_beta, mixed)


# ------------------------------------------------------------------------------------------- bf16 / int8 experts
# The families' experts at "native" (bf16, or float32 test checkpoints) and "int8" precision, multiplied from the
# stored bytes: bf16 as uint16 (widened lane by lane, value = bits << 16, exact), int8 as int8 with float32 scales
# (one per row, multiplying the row's dot, or one per block of 32 values, GGUF's Q8_0, scaling each weight as it
# is widened: the float32 kernel's bits on the dequantized values), float32 as is. Same row dot structure as
# MXFP4: 16 float32 lanes, FMA, a fixed pairwise lane sum, a scalar tail, in portable LLVM IR. As for MXFP4, a
# layer's active experts run in one compiled call over a stack [E, ...] of its experts (`dense_experts_run`),
# spread over the cores across (expert, row block). From 4 tokens on (decode batches, short prompts) the same dots
# run in tiles of 2 rows x 4 tokens (`_dense_dots_2x4`): 8 independent accumulators instead of one FMA chain that
# waits on its own latency, each dot with the one-pair operation order, so the bits do not change.
DENSE_LANES = 16
_DENSE_KINDS = {types.uint16: "bf16", types.int8: "int8", types.float32: "f32"}
_DENSE_STORED = {"bf16": ir.IntType(16), "int8": _I8, "f32": _F32}


def _widen(builder: ir.IRBuilder, kind: str, value: ir.Value, lanes: int | None) -> ir.Value:
    """Stored weights (a vector of `lanes`, or a scalar for None) as float32: bf16 bits << 16, int8 converted."""
    if kind == "f32":
        return value
    vf, vi = (_F32, _I32) if lanes is None else (_vector(_F32, lanes), _vector(_I32, lanes))
    if kind == "bf16":
        shift = ir.Constant(_I32, 16) if lanes is None else ir.Constant(vi, [16] * lanes)
        return builder.bitcast(builder.shl(builder.zext(value, vi), shift), vf)
    return builder.sitofp(value, vf)


def _dense_dots_codegen(kind: str, num_rows: int = 1, num_tokens: int = 1):
    """IR of the dense row dot for `num_rows` weight rows against `num_tokens` x rows: every (row, token) pair keeps
    its own accumulator with exactly the one-pair operation order (16-lane FMAs, the fixed pairwise lane sum, then
    the scalar tail), so each dot has the bits of `_dense_row_dot`. Each weight chunk is loaded and widened once for
    all tokens and each x chunk once for all rows; the independent accumulators hide the FMA latency that bounds
    a single chain (one FMA per ~4 cycles)."""
    def codegen(context, builder, signature, args):
        ws = [context.make_array(signature.args[r])(context, builder, args[r]) for r in range(num_rows)]
        xs = [context.make_array(signature.args[num_rows + t])(context, builder, args[num_rows + t])
              for t in range(num_tokens)]
        (length,) = cgutils.unpack_tuple(builder, ws[0].shape, 1)
        lanes = DENSE_LANES
        vf = _vector(_F32, lanes)
        stored = _vector(_DENSE_STORED[kind], lanes)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{lanes}f32")

        index_type = length.type
        chunks = builder.udiv(length, ir.Constant(index_type, lanes))
        acc_slots = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * lanes)) for _ in range(num_tokens)]
                     for _ in range(num_rows)]
        with cgutils.for_range(builder, chunks) as loop:
            base = builder.mul(loop.index, ir.Constant(index_type, lanes))
            weights = [_widen(builder, kind, _load(builder, w.data, base, stored, 4 if kind == "f32" else 1), lanes)
                       for w in ws]
            inputs = [_load(builder, x.data, base, vf, 4) for x in xs]
            for r in range(num_rows):
                for t in range(num_tokens):
                    slot = acc_slots[r][t]
                    builder.store(builder.call(fma, [weights[r], inputs[t], builder.load(slot)]), slot)
        total_slots = [[cgutils.alloca_once_value(builder, _pairwise_sum(builder, builder.load(slot), lanes))
                        for slot in row] for row in acc_slots]
        tail_start = builder.mul(chunks, ir.Constant(index_type, lanes))
        with cgutils.for_range(builder, builder.sub(length, tail_start)) as loop:
            i = builder.add(tail_start, loop.index)
            for r in range(num_rows):
                weight = _widen(builder, kind, builder.load(builder.gep(ws[r].data, [i])), None)
                for t in range(num_tokens):
                    product = builder.fmul(weight, builder.load(builder.gep(xs[t].data, [i])))
                    slot = total_slots[r][t]
                    builder.store(builder.fadd(builder.load(slot), product), slot)
        totals = [builder.load(slot) for row in total_slots for slot in row]
        if num_rows * num_tokens == 1:
            return totals[0]
        return context.make_tuple(builder, signature.return_type, totals)

    return codegen


@intrinsic
def _dense_row_dot(typingctx, w_row, x):
    """sum_c w[c] x[c]; w_row bf16 bits (uint16), int8 or float32 [C], x float32 [C]."""
    if w_row.dtype in _DENSE_KINDS:
        return types.float32(w_row, x), _dense_dots_codegen(_DENSE_KINDS[w_row.dtype])
    return None


@njit(inline="always")
def _touch_rows(w, begin, end):
    """Load one value of each cache line of rows begin:end of w [R, C], one row after another, and return their
    sum. The multi-dot tiles read several rows at once, 4 KB apart (one page each), which the hardware prefetcher
    follows badly (a bf16 [151936, 2048] lm_head against 4 tokens: 8.7 GB/s tiled, 23 GB/s by the one-row dot);
    streaming a block's rows into the cache first, in order, runs at the one-row rate (llvm.prefetch hints instead
    of loads gained only half as much here)."""
    total = 0
    step = max(1, 64 // w.itemsize)
    for row in range(begin, end):
        values = w[row]
        for c in range(0, values.shape[0], step):
            total += values[c]
    return total


DOT_TILE_ROWS, DOT_TILE_TOKENS = 2, 4  # the multi-dot tiles: 2 rows x 4 tokens (and 1 x 4)
LINEAR_ROWS_PER_TASK = 64  # rows of a bf16 trunk matrix one task streams in (256 KB at C = 2048: in L2)


def _dense_dots_intrinsic(num_rows: int, num_tokens: int):
    def typer(typingctx, *arrays):
        rows, xs = arrays[:num_rows], arrays[num_rows:]
        if (len(arrays) == num_rows + num_tokens and rows[0].dtype in _DENSE_KINDS
                and all(w.dtype == rows[0].dtype for w in rows) and all(x.dtype == types.float32 for x in xs)):
            return (types.UniTuple(types.float32, num_rows * num_tokens)(*arrays),
                    _dense_dots_codegen(_DENSE_KINDS[rows[0].dtype], num_rows, num_tokens))
        return None
    return typer


@intrinsic
def _dense_dots_2x4(typingctx, w0, w1, x0, x1, x2, x3):
    """(w0.x0, w0.x1, w0.x2, w0.x3, w1.x0, ..., w1.x3), each with the bits of `_dense_row_dot`."""
    return _dense_dots_intrinsic(2, 4)(typingctx, w0, w1, x0, x1, x2, x3)


@intrinsic
def _dense_dots_1x4(typingctx, w0, x0, x1, x2, x3):
    """(w0.x0, w0.x1, w0.x2, w0.x3), each with the bits of `_dense_row_dot`."""
    return _dense_dots_intrinsic(1, 4)(typingctx, w0, x0, x1, x2, x3)


def _block_scaled_row_dot_codegen(kind: str):
    return lambda context, builder, signature, args: _block_scaled_row_dot_ir(kind, context, builder, signature,
                                                                               args)


def _block_scaled_row_dot_ir(kind: str, context, builder, signature, args):
    w_t, s_t, x_t = signature.args
    w = context.make_array(w_t)(context, builder, args[0])
    s = context.make_array(s_t)(context, builder, args[1])
    x = context.make_array(x_t)(context, builder, args[2])
    (length,) = cgutils.unpack_tuple(builder, w.shape, 1)
    (groups,) = cgutils.unpack_tuple(builder, s.shape, 1)
    lanes = DENSE_LANES
    vf = _vector(_F32, lanes)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{lanes}f32")
    index_type = length.type
    block = builder.udiv(length, groups)
    acc_slot = cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * lanes))
    with cgutils.for_range(builder, builder.udiv(length, ir.Constant(index_type, lanes))) as loop:
        base = builder.mul(loop.index, ir.Constant(index_type, lanes))
        scale = builder.load(builder.gep(s.data, [builder.udiv(base, block)]))
        stored = _load(builder, w.data, base, _vector(_DENSE_STORED[kind], lanes), 4 if kind == "f32" else 1)
        weights = builder.fmul(_widen(builder, kind, stored, lanes), _splat(builder, scale, lanes))
        inputs = _load(builder, x.data, base, vf, 4)
        builder.store(builder.call(fma, [weights, inputs, builder.load(acc_slot)]), acc_slot)
    return _pairwise_sum(builder, builder.load(acc_slot), lanes)


@intrinsic
def _block_scaled_row_dot(typingctx, w_row, scales, x):
    """sum_c (w[c] * scales[c // B]) x[c] for w [C] (int8: GGUF's Q8_0, B = 32; typed for every dense kind),
    float32 scales [G], B = C / G a multiple of DENSE_LANES: each weight scaled as it is widened, then the float32
    row dot's FMA order, so the bits are those of `_dense_row_dot` on the dequantized row."""
    if w_row.dtype in _DENSE_KINDS and scales.dtype == types.float32:
        return types.float32(w_row, scales, x), _block_scaled_row_dot_codegen(_DENSE_KINDS[w_row.dtype])
    return None


@njit(inline="always")
def _scaled_row_dot(w_row, scales, scaled, x):
    """sum_c w[c] x[c] with w's scales [G] when `scaled`: one per row (G = 1) multiplies the dot, one per block of
    C/G values scales each weight (`_block_scaled_row_dot`)."""
    if not scaled:
        return _dense_row_dot(w_row, x)
    if scales.shape[0] == 1:
        return _dense_row_dot(w_row, x) * scales[0]
    return _block_scaled_row_dot(w_row, scales, x)


@njit(inline="always")
def _row_scale(scales, scaled):
    """The factor a row's dot is multiplied by: its one scale (int8 per row), or 1 (unscaled)."""
    return scales[0] if scaled else np.float32(1.0)


@njit(inline="always")
def _dense_gate_up_task(gate_up, gate_up_scales, scaled, expert_ids, x, tokens, starts, ends, hidden, task, blocks):
    k = task // blocks
    e = expert_ids[k]
    width = hidden.shape[1]
    begin, end = (task % blocks) * ROWS_PER_TASK, min(width, (task % blocks + 1) * ROWS_PER_TASK)
    if scaled and gate_up_scales.shape[2] > 1:  # block scales (Q8_0): one pair at a time
        for row in range(begin, end):
            gate_scales, up_scales = gate_up_scales[e, row], gate_up_scales[e, width + row]
            for n in range(starts[k], ends[k]):
                x_row = x[tokens[n]]
                gate = _scaled_row_dot(gate_up[e, row], gate_scales, scaled, x_row)
                up = _scaled_row_dot(gate_up[e, width + row], up_scales, scaled, x_row)
                hidden[n, row] = _silu_glu(gate, up)
        return
    # the same dots in tiles: a gate row and its up row against 4 tokens
    if ends[k] - starts[k] >= DOT_TILE_TOKENS and begin < end:  # the rows streamed in first (`_touch_rows`)
        hidden[starts[k], begin] = np.float32(_touch_rows(gate_up[e], begin, end)
                                              + _touch_rows(gate_up[e], width + begin, width + end))
    n = starts[k]
    while n + DOT_TILE_TOKENS <= ends[k]:
        x0, x1, x2, x3 = x[tokens[n]], x[tokens[n + 1]], x[tokens[n + 2]], x[tokens[n + 3]]
        for row in range(begin, end):
            gs = _row_scale(gate_up_scales[e if scaled else 0, row if scaled else 0], scaled)
            us = _row_scale(gate_up_scales[e if scaled else 0, width + row if scaled else 0], scaled)
            g0, g1, g2, g3, u0, u1, u2, u3 = _dense_dots_2x4(gate_up[e, row], gate_up[e, width + row], x0, x1, x2, x3)
            if scaled:
                g0, g1, g2, g3, u0, u1, u2, u3 = g0 * gs, g1 * gs, g2 * gs, g3 * gs, u0 * us, u1 * us, u2 * us, u3 * us
            hidden[n, row] = _silu_glu(g0, u0)
            hidden[n + 1, row] = _silu_glu(g1, u1)
            hidden[n + 2, row] = _silu_glu(g2, u2)
            hidden[n + 3, row] = _silu_glu(g3, u3)
        n += DOT_TILE_TOKENS
    while n < ends[k]:  # fewer than 4 tokens left: one pair at a time, as the row dot always ran
        x_row = x[tokens[n]]
        for row in range(begin, end):
            gate = _scaled_row_dot(gate_up[e, row], gate_up_scales[e if scaled else 0, row if scaled else 0], scaled,
                                   x_row)
            up = _scaled_row_dot(gate_up[e, width + row],
                                 gate_up_scales[e if scaled else 0, width + row if scaled else 0], scaled, x_row)
            hidden[n, row] = _silu_glu(gate, up)
        n += 1


@njit(inline="always")
def _dense_down_task(down, down_scales, scaled, expert_ids, starts, ends, hidden, out, task, blocks):
    k = task // blocks
    e = expert_ids[k]
    begin, end = (task % blocks) * ROWS_PER_TASK, min(out.shape[1], (task % blocks + 1) * ROWS_PER_TASK)
    if scaled and down_scales.shape[2] > 1:  # block scales (Q8_0): one dot at a time
        for row in range(begin, end):
            for n in range(starts[k], ends[k]):
                out[n, row] = _scaled_row_dot(down[e, row], down_scales[e, row], scaled, hidden[n])
        return
    _dense_rows_tiled(down[e], down_scales[e if scaled else 0], scaled, hidden, starts[k], ends[k], out, begin, end)


@njit(inline="always")
def _dense_rows_tiled(w, scales, scaled, x, first, last, out, begin, end):
    """out[n, r] = (w[r] . x[n]) * scales[r, 0] (when `scaled`) for rows begin:end and x rows first:last, in the
    multi-dot tiles: each dot has the bits of `_dense_row_dot` times its scale."""
    if last - first >= DOT_TILE_TOKENS and begin < end:
        # the loaded values' sum goes where the tiles write next, so the loads stay (the tiles overwrite it)
        out[first, begin] = np.float32(_touch_rows(w, begin, end))
    n = first
    while n + DOT_TILE_TOKENS <= last:
        x0, x1, x2, x3 = x[n], x[n + 1], x[n + 2], x[n + 3]
        row = begin
        while row + DOT_TILE_ROWS <= end:
            a0, a1, a2, a3, b0, b1, b2, b3 = _dense_dots_2x4(w[row], w[row + 1], x0, x1, x2, x3)
            if scaled:
                sa, sb = scales[row, 0], scales[row + 1, 0]
                a0, a1, a2, a3, b0, b1, b2, b3 = a0 * sa, a1 * sa, a2 * sa, a3 * sa, b0 * sb, b1 * sb, b2 * sb, b3 * sb
            out[n, row], out[n + 1, row], out[n + 2, row], out[n + 3, row] = a0, a1, a2, a3
            out[n, row + 1], out[n + 1, row + 1], out[n + 2, row + 1], out[n + 3, row + 1] = b0, b1, b2, b3
            row += DOT_TILE_ROWS
        if row < end:
            a0, a1, a2, a3 = _dense_dots_1x4(w[row], x0, x1, x2, x3)
            if scaled:
                sa = scales[row, 0]
                a0, a1, a2, a3 = a0 * sa, a1 * sa, a2 * sa, a3 * sa
            out[n, row], out[n + 1, row], out[n + 2, row], out[n + 3, row] = a0, a1, a2, a3
        n += DOT_TILE_TOKENS
    while n < last:  # fewer than 4 tokens left: one row after another, as the row dot always ran
        for row in range(begin, end):
            out[n, row] = _scaled_row_dot(w[row], scales[row if scaled else 0], scaled, x[n])
        n += 1


@njit(cache=True, parallel=True)
def _dense_experts_parallel(gate_up, gate_up_scales, down, down_scales, scaled, expert_ids, x, tokens, starts,
                            ends, hidden, out):
    """Stage 1 over (expert, gate/up row block), stage 2 over (expert, down row block); see `dense_experts_run`."""
    blocks = (hidden.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        _dense_gate_up_task(gate_up, gate_up_scales, scaled, expert_ids, x, tokens, starts, ends, hidden, task,
                            blocks)
    blocks = (out.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        _dense_down_task(down, down_scales, scaled, expert_ids, starts, ends, hidden, out, task, blocks)


@njit(cache=True)
def _dense_experts_serial(gate_up, gate_up_scales, down, down_scales, scaled, expert_ids, x, tokens, starts, ends,
                          hidden, out):
    blocks = (hidden.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in range(expert_ids.shape[0] * blocks):
        _dense_gate_up_task(gate_up, gate_up_scales, scaled, expert_ids, x, tokens, starts, ends, hidden, task,
                            blocks)
    blocks = (out.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in range(expert_ids.shape[0] * blocks):
        _dense_down_task(down, down_scales, scaled, expert_ids, starts, ends, hidden, out, task, blocks)


_NO_SCALES = np.ones((1, 1, 1), np.float32)  # stands for absent scales (never read: `scaled` is False)
_ZERO_ID = np.zeros(1, np.int64)


def dense_experts_run(gate_up: np.ndarray, gate_up_scales: np.ndarray | None, down: np.ndarray,
                      down_scales: np.ndarray | None, expert_ids: np.ndarray, x: np.ndarray, tokens: np.ndarray,
                      starts: np.ndarray, ends: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y[n] = down_e SiLU-GLU(gate_up_e x[tokens[n]]) for every routed (token, expert) pair, in one compiled call.
    gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I]: bf16 bits (uint16), int8 or float32; scales
    float32 [E, 2I] and [E, H] multiply each row's dot (int8), or [E, 2I, H/32] and [E, H, I/32] scale each block
    of 32 values (GGUF's Q8_0), or None (bf16, float32). expert_ids [K] index E;
    expert k owns rows starts[k]:ends[k] of tokens [N]; x [T, H] -> y [N, H] (`out`, when given, is filled on
    those rows only). Each y[n] is the same bits whatever the other tokens, experts and threads of the call."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    num_experts, width, hidden_size = down.shape[0], down.shape[2], down.shape[1]
    if (gate_up.shape != (num_experts, 2 * width, hidden_size) or x.ndim != 2 or x.shape[1] != hidden_size
            or (gate_up_scales is None) != (down_scales is None)):
        raise ValueError(f"experts gate_up {gate_up.shape} / down {down.shape} do not fit x {x.shape}")
    for w, scales in ((gate_up, gate_up_scales), (down, down_scales)):
        groups = 1 if scales is None else scales[0].size // w.shape[1]
        if groups > 1 and (w.shape[2] % groups or (w.shape[2] // groups) % DENSE_LANES):
            raise ValueError(f"block scales {scales.shape} of {w.shape}: blocks must be multiples of {DENSE_LANES}")
    if out is None:
        out = np.empty((tokens.shape[0], hidden_size), np.float32)  # [N, H]
    hidden = np.empty((tokens.shape[0], width), np.float32)  # [N, I]
    if tokens.shape[0] == 0 or expert_ids.shape[0] == 0:
        return out
    scaled = gate_up_scales is not None
    parallel = expert_ids.shape[0] * gate_up[0].size >= PARALLEL_MIN_WEIGHTS
    kernel = _dense_experts_parallel if parallel else _dense_experts_serial
    gate_up_scales, down_scales = (np.ascontiguousarray(a, np.float32).reshape(*w.shape[:2], -1) if scaled
                                   else _NO_SCALES for a, w in ((gate_up_scales, gate_up), (down_scales, down)))
    kernel(np.ascontiguousarray(gate_up), gate_up_scales, np.ascontiguousarray(down), down_scales, scaled,
           np.ascontiguousarray(expert_ids, dtype=np.int64), x, np.ascontiguousarray(tokens, dtype=np.int64),
           np.ascontiguousarray(starts, dtype=np.int64), np.ascontiguousarray(ends, dtype=np.int64), hidden, out)
    return out


def dense_expert_forward(gate_up: np.ndarray, gate_up_scales: np.ndarray | None, down: np.ndarray,
                         down_scales: np.ndarray | None, x: np.ndarray) -> np.ndarray:
    """One SiLU-GLU expert (`dense_experts_run` on a stack of one): gate_up [2I, H], down [H, I], scales [2I] and
    [H] or None; x [T, H] -> [T, H]."""
    def one(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a)[None]

    n = len(x)
    return dense_experts_run(one(gate_up), one(gate_up_scales), one(down), one(down_scales), _ZERO_ID, x,
                             np.arange(n), _ZERO_ID, np.full(1, n, np.int64))


# ------------------------------------------------------------------------- dense experts at prefill: tiles
# An expert with many tokens (prefill) reuses each weight row across its tokens: a task widens one gate row and
# one up row (or two down rows) to float32 once, then computes them against the tokens four at a time, 8 dot
# products per pass over the row (6 loads per 8 FMAs, where the row dot makes 2 loads per FMA). No float32 copy of
# the expert is made, as BLAS needs. The summation order is the compiler's (fastmath reassociation, for vectorized
# reductions): a fixed order for a given CPU and tile shape, but not the row dot's, so a token's bits depend on
# whether its expert ran tiled (as they already did with BLAS). `dense_expert_reference` is the numpy twin.
TILE_TOKENS = 4  # tokens per pass over a widened row pair
TILE_CHUNK_TOKENS = 32  # tokens whose x rows (32 x 8 KB at H = 2048) stay in L2 while a row block passes
_TILE_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_KIND_CODES = {np.dtype(np.float32): 0, np.dtype(np.uint16): 1, np.dtype(np.int8): 2}


@njit(fastmath=_TILE_FASTMATH, cache=True)
def _dots_2x4(a, b, x0, x1, x2, x3):
    """(a.x0, a.x1, a.x2, a.x3, b.x0, ..., b.x3) over float32 rows [C]."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    for c in range(a.shape[0]):
        wa, wb = a[c], b[c]
        v0, v1, v2, v3 = x0[c], x1[c], x2[c], x3[c]
        a0 += wa * v0
        a1 += wa * v1
        a2 += wa * v2
        a3 += wa * v3
        b0 += wb * v0
        b1 += wb * v1
        b2 += wb * v2
        b3 += wb * v3
    return a0, a1, a2, a3, b0, b1, b2, b3


@njit(fastmath=_TILE_FASTMATH, cache=True)
def _dots_2x1(a, b, x0):
    """(a.x0, b.x0) over float32 rows [C]."""
    a0 = b0 = np.float32(0.0)
    for c in range(a.shape[0]):
        a0 += a[c] * x0[c]
        b0 += b[c] * x0[c]
    return a0, b0


@njit(inline="always")
def _widen_row(w_row, scales, scaled, kind, bits, out):
    """out [C] = w_row as float32 (kind 0 float32, 1 bf16 bits, 2 int8) times its scale: scales [G] with one
    scale per C / G values (G = 1: one per row); `bits` is `out` viewed as uint32. One loop per scale block that
    converts and scales at once (one rounding, as before), over range(block) from a base: a division per value, a
    second pass over `out` or a loop over range(g * block, (g + 1) * block) kept LLVM from vectorizing, and widening
    took 4-8x the time (1.2 ms of an int8 expert of Qwen3-30B-A3B's shape, of the tiled kernel's 2.0 ms at 8 tokens)."""
    C = w_row.shape[0]
    if kind == 1:
        for c in range(C):
            bits[c] = np.uint32(w_row[c]) << np.uint32(16)
        if scaled:
            block = C // scales.shape[0]
            for g in range(scales.shape[0]):
                scale, base = scales[g], g * block
                for c in range(block):
                    out[base + c] *= scale
    elif scaled:
        block = C // scales.shape[0]
        for g in range(scales.shape[0]):
            scale, base = scales[g], g * block
            for c in range(block):
                out[base + c] = np.float32(w_row[base + c]) * scale
    else:
        for c in range(C):
            out[c] = np.float32(w_row[c])


@njit(inline="always")
def _tiled_gate_up_task(gate_up, gate_up_scales, scaled, kind, expert_ids, x, tokens, starts, ends, hidden, task,
                        blocks):
    k = task // blocks
    e = expert_ids[k]
    width, C = hidden.shape[1], x.shape[1]
    begin, end = (task % blocks) * ROWS_PER_TASK, min(width, (task % blocks + 1) * ROWS_PER_TASK)
    bits = np.empty((2 * ROWS_PER_TASK, C), np.uint32)  # the block's gate rows, then its up rows, widened
    rows = bits.view(np.float32)
    for i in range(end - begin):
        row = begin + i
        _widen_row(gate_up[e, row], gate_up_scales[e if scaled else 0, row if scaled else 0], scaled, kind,
                   bits[i], rows[i])
        _widen_row(gate_up[e, width + row], gate_up_scales[e if scaled else 0, width + row if scaled else 0],
                   scaled, kind, bits[ROWS_PER_TASK + i], rows[ROWS_PER_TASK + i])
    for chunk in range(starts[k], ends[k], TILE_CHUNK_TOKENS):  # the chunk's x rows stay in L2 across the rows
        chunk_end = min(ends[k], chunk + TILE_CHUNK_TOKENS)
        for i in range(end - begin):
            gate_row, up_row, row = rows[i], rows[ROWS_PER_TASK + i], begin + i
            n = chunk
            while n + TILE_TOKENS <= chunk_end:
                g0, g1, g2, g3, u0, u1, u2, u3 = _dots_2x4(gate_row, up_row, x[tokens[n]], x[tokens[n + 1]],
                                                           x[tokens[n + 2]], x[tokens[n + 3]])
                hidden[n, row] = _silu_glu(g0, u0)
                hidden[n + 1, row] = _silu_glu(g1, u1)
                hidden[n + 2, row] = _silu_glu(g2, u2)
                hidden[n + 3, row] = _silu_glu(g3, u3)
                n += TILE_TOKENS
            while n < chunk_end:
                g0, u0 = _dots_2x1(gate_row, up_row, x[tokens[n]])
                hidden[n, row] = _silu_glu(g0, u0)
                n += 1


@njit(inline="always")
def _tiled_down_task(down, down_scales, scaled, kind, expert_ids, starts, ends, hidden, out, task, blocks):
    k = task // blocks
    e = expert_ids[k]
    C = hidden.shape[1]
    begin, end = (task % blocks) * ROWS_PER_TASK, min(out.shape[1], (task % blocks + 1) * ROWS_PER_TASK)
    bits = np.empty((ROWS_PER_TASK, C), np.uint32)  # the block's down rows, widened
    rows = bits.view(np.float32)
    for i in range(end - begin):
        _widen_row(down[e, begin + i], down_scales[e if scaled else 0, begin + i if scaled else 0], scaled, kind,
                   bits[i], rows[i])
    for chunk in range(starts[k], ends[k], TILE_CHUNK_TOKENS):
        chunk_end = min(ends[k], chunk + TILE_CHUNK_TOKENS)
        for i in range(0, end - begin, 2):
            j = min(i + 1, end - begin - 1)  # an odd last row is computed twice, written once
            row, other = begin + i, begin + j
            n = chunk
            while n + TILE_TOKENS <= chunk_end:
                a0, a1, a2, a3, b0, b1, b2, b3 = _dots_2x4(rows[i], rows[j], hidden[n], hidden[n + 1],
                                                           hidden[n + 2], hidden[n + 3])
                out[n, row], out[n + 1, row], out[n + 2, row], out[n + 3, row] = a0, a1, a2, a3
                out[n, other], out[n + 1, other], out[n + 2, other], out[n + 3, other] = b0, b1, b2, b3
                n += TILE_TOKENS
            while n < chunk_end:
                a0, b0 = _dots_2x1(rows[i], rows[j], hidden[n])
                out[n, row], out[n, other] = a0, b0
                n += 1


@njit(cache=True, parallel=True)
def _tiled_experts_parallel(gate_up, gate_up_scales, down, down_scales, scaled, kind, expert_ids, x, tokens, starts,
                            ends, hidden, out):
    """Stage 1 over (expert, gate/up row block), stage 2 over (expert, down row block); see `dense_experts_tiled`."""
    blocks = (hidden.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        _tiled_gate_up_task(gate_up, gate_up_scales, scaled, kind, expert_ids, x, tokens, starts, ends, hidden,
                            task, blocks)
    blocks = (out.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        _tiled_down_task(down, down_scales, scaled, kind, expert_ids, starts, ends, hidden, out, task, blocks)


def dense_experts_tiled(gate_up: np.ndarray, gate_up_scales: np.ndarray | None, down: np.ndarray,
                        down_scales: np.ndarray | None, expert_ids: np.ndarray, x: np.ndarray, tokens: np.ndarray,
                        starts: np.ndarray, ends: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`dense_experts_run` for experts with many tokens (prefill), with the same arguments: each weight row is
    widened once per call and multiplied by the expert's tokens four at a time (see the section comment). Within
    float32 rounding of `dense_expert_reference`; the bits are not those of the row dot."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    num_experts, width, hidden_size = down.shape[0], down.shape[2], down.shape[1]
    if (gate_up.shape != (num_experts, 2 * width, hidden_size) or x.ndim != 2 or x.shape[1] != hidden_size
            or (gate_up_scales is None) != (down_scales is None) or gate_up.dtype != down.dtype
            or gate_up.dtype not in _KIND_CODES):
        raise ValueError(f"experts gate_up {gate_up.shape} {gate_up.dtype} / down {down.shape} {down.dtype} do not "
                         f"fit x {x.shape}")
    if bf16_experts_on(gate_up, gate_up_scales):
        return bf16_experts_run(gate_up, down, expert_ids, x, tokens, starts, ends, out)
    if out is None:
        out = np.empty((tokens.shape[0], hidden_size), np.float32)  # [N, H]
    if tokens.shape[0] == 0 or expert_ids.shape[0] == 0:
        return out
    hidden = np.empty((tokens.shape[0], width), np.float32)  # [N, I]
    scaled = gate_up_scales is not None
    gate_up_scales, down_scales = (np.ascontiguousarray(a, np.float32).reshape(*w.shape[:2], -1) if scaled
                                   else _NO_SCALES for a, w in ((gate_up_scales, gate_up), (down_scales, down)))
    for w, scales in ((gate_up, gate_up_scales), (down, down_scales)):
        if scaled and w.shape[2] % scales.shape[2]:
            raise ValueError(f"block scales {scales.shape} do not divide the rows of {w.shape}")
    _tiled_experts_parallel(np.ascontiguousarray(gate_up), gate_up_scales, np.ascontiguousarray(down), down_scales,
                            scaled, _KIND_CODES[gate_up.dtype], np.ascontiguousarray(expert_ids, dtype=np.int64), x,
                            np.ascontiguousarray(tokens, dtype=np.int64), np.ascontiguousarray(starts, dtype=np.int64),
                            np.ascontiguousarray(ends, dtype=np.int64), hidden, out)
    return out


def _mxfp4_widen_codegen(lanes: int):
    """IR of `_mxfp4_widen_row` with `lanes` float32 lanes: a group's 16 bytes widened to 32-bit lanes, each nibble
    looked up in a register (AVX-512 vpermps of V, or AVX2's 8-entry vpermps and a sign flip), times the group's
    multiplier, low and high nibbles interleaved into natural order: 32 values in about a dozen instructions, where
    the numba loop of scalar table lookups took ~6x as long (about 1 ms of an MXFP4 expert of Qwen3-30B-A3B's shape,
    the tiled kernel's fixed cost)."""

    def codegen(context, builder, signature, args):
        prow, srow, half_scales, out = (context.make_array(t)(context, builder, a)
                                        for t, a in zip(signature.args, args))
        (num_groups,) = cgutils.unpack_tuple(builder, srow.shape, 1)
        vf, vi, vb = _vector(_F32, lanes), _vector(_I32, lanes), _vector(_I8, lanes)
        lookup = _nibble_lookup(builder, lanes)
        index_type = ir.IntType(64)
        interleave = ir.Constant(_vector(_I32, 2 * lanes), [i // 2 + (lanes if i % 2 else 0) for i in range(2 * lanes)])
        with cgutils.for_range(builder, num_groups) as loop:
            group = loop.index
            scale_byte = builder.load(builder.gep(srow.data, [group]))
            scale_index = builder.zext(scale_byte, index_type)
            multiplier = _splat(builder, builder.load(builder.gep(half_scales.data, [scale_index])), lanes)
            for part in range(BYTES_PER_GROUP // lanes):
                byte_offset = builder.add(builder.mul(group, ir.Constant(index_type, BYTES_PER_GROUP)),
                                          ir.Constant(index_type, part * lanes))
                packed = builder.zext(_load(builder, prow.data, byte_offset, vb, 1), vi)
                low = builder.fmul(lookup(packed), multiplier)
                high = builder.fmul(lookup(builder.lshr(packed, ir.Constant(vi, [4] * lanes))), multiplier)
                both = builder.shuffle_vector(low, high, interleave)  # [2 lanes]: low0 high0 low1 high1 ...
                value_offset = builder.add(builder.mul(group, ir.Constant(index_type, GROUP_SIZE)),
                                           ir.Constant(index_type, 2 * part * lanes))
                pointer = builder.bitcast(builder.gep(out.data, [value_offset]), _vector(_F32, 2 * lanes).as_pointer())
                builder.store(both, pointer, align=4)
        return context.get_dummy_value()

    return codegen


_WIDEN_LANES = 16 if "avx512" in AVAILABLE_ISAS else 8 if "avx2" in AVAILABLE_ISAS else 0  # the host's, not ISA's


def _mxfp4_widen_intrinsic(isa: str):
    def typer(typingctx, prow, srow, half_scales, out):
        codegen = (_mxfp4_widen_codegen({"avx512": 16, "avx2": 8}[isa]) if isa in AVAILABLE_ISAS
                   else lambda context, builder, signature, args: context.get_dummy_value())  # never called
        return types.none(prow, srow, half_scales, out), codegen
    return typer


@intrinsic
def _mxfp4_widen_row_avx512(typingctx, prow, srow, half_scales, out):
    """out [C] = the MXFP4 row as float32 in natural order (see `_mxfp4_widen_codegen`), AVX-512."""
    return _mxfp4_widen_intrinsic("avx512")(typingctx, prow, srow, half_scales, out)


@intrinsic
def _mxfp4_widen_row_avx2(typingctx, prow, srow, half_scales, out):
    """The same on AVX2."""
    return _mxfp4_widen_intrinsic("avx2")(typingctx, prow, srow, half_scales, out)


@njit(inline="always")
def _mxfp4_widen_row(prow, srow, doubled_e2m1, half_scales, out):
    """out [C] = the MXFP4 row (packed u8 [C/2], scale bytes [C/32]) as float32, in natural order: exact (each value
    is V[nibble] * m[scale], a power-of-two multiple of a 4-bit integer), so the vector path and the loop agree."""
    if _WIDEN_LANES == 16:
        _mxfp4_widen_row_avx512(prow, srow, half_scales, out)
        return
    if _WIDEN_LANES == 8:
        _mxfp4_widen_row_avx2(prow, srow, half_scales, out)
        return
    for g in range(srow.shape[0]):
        m = half_scales[srow[g]]
        for j in range(BYTES_PER_GROUP):
            byte = prow[g * BYTES_PER_GROUP + j]
            out[g * GROUP_SIZE + 2 * j] = doubled_e2m1[byte & 15] * m
            out[g * GROUP_SIZE + 2 * j + 1] = doubled_e2m1[byte >> 4] * m


@njit(inline="always")
def _mxfp4_tiled_pair_task(first_p, first_s, second_p, second_s, rows_first, rows_second, doubled_e2m1, half_scales,
                           x, tokens, gathered, start, end, out_first, out_second, row_begin, row_end):
    """For each row r of [row_begin, row_end): out_first[n, r] = W1[r] . x_n and out_second[n, r] = W2[r'] . x_n
    for the tokens n of start:end (x rows tokens[n], or rows n of x when not `gathered`); W1 and W2 MXFP4."""
    C = x.shape[1]
    a, b = np.empty(C, np.float32), np.empty(C, np.float32)
    for row in range(row_begin, row_end):
        r1, r2 = rows_first[row], rows_second[row]
        _mxfp4_widen_row(first_p[r1], first_s[r1], doubled_e2m1, half_scales, a)
        _mxfp4_widen_row(second_p[r2], second_s[r2], doubled_e2m1, half_scales, b)
        n = start
        while n + TILE_TOKENS <= end:
            i0, i1, i2, i3 = (tokens[n], tokens[n + 1], tokens[n + 2], tokens[n + 3]) if gathered else (
                n, n + 1, n + 2, n + 3)
            a0, a1, a2, a3, b0, b1, b2, b3 = _dots_2x4(a, b, x[i0], x[i1], x[i2], x[i3])
            out_first[n, row], out_first[n + 1, row], out_first[n + 2, row], out_first[n + 3, row] = a0, a1, a2, a3
            out_second[n, r2], out_second[n + 1, r2], out_second[n + 2, r2], out_second[n + 3, r2] = b0, b1, b2, b3
            n += TILE_TOKENS
        while n < end:
            a0, b0 = _dots_2x1(a, b, x[tokens[n] if gathered else n])
            out_first[n, row], out_second[n, r2] = a0, b0
            n += 1


@njit(cache=True, parallel=True)
def _mxfp4_tiled_gate_up(w1p, w1s, w3p, w3s, expert_ids, x, tokens, starts, ends, doubled_e2m1, half_scales, gate,
                         up):
    """gate[n] = w1_e x[tokens[n]], up[n] = w3_e x[tokens[n]] (natural order) over (expert, row block) tasks."""
    width = gate.shape[1]
    rows = np.arange(width)
    blocks = (width + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        k, block = task // blocks, task % blocks
        e = expert_ids[k]
        _mxfp4_tiled_pair_task(w1p[e], w1s[e], w3p[e], w3s[e], rows, rows, doubled_e2m1, half_scales, x, tokens,
                               True, starts[k], ends[k], gate, up, block * ROWS_PER_TASK,
                               min(width, (block + 1) * ROWS_PER_TASK))


@njit(cache=True, parallel=True)
def _mxfp4_tiled_down(w2p, w2s, expert_ids, hidden, starts, ends, doubled_e2m1, half_scales, out):
    """out[n] = w2_e hidden[n] over (expert, row pair block) tasks: rows r and r + R/2 share a pass over the
    tokens."""
    rows_total = out.shape[1]
    half = (rows_total + 1) // 2
    first = np.arange(half)
    second = np.minimum(np.arange(half) + half, rows_total - 1)  # an odd last row is computed twice
    blocks = (half + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        k, block = task // blocks, task % blocks
        e = expert_ids[k]
        _mxfp4_tiled_pair_task(w2p[e], w2s[e], w2p[e], w2s[e], first, second, doubled_e2m1, half_scales, hidden,
                               first, False, starts[k], ends[k], out, out, block * ROWS_PER_TASK,
                               min(half, (block + 1) * ROWS_PER_TASK))


def mxfp4_experts_tiled(stacked: StackedExperts, expert_ids: np.ndarray, z: np.ndarray, tokens: np.ndarray,
                        starts: np.ndarray, ends: np.ndarray, activation: str = "silu",
                        out: np.ndarray | None = None, activations: str | None = None) -> np.ndarray:
    """`mxfp4_experts_run` (activation "silu") for experts with many tokens (prefill): each row decoded to float32
    once per call and multiplied by the tokens four at a time (`dense_experts_tiled`'s tile). `out` [N, LT], when
    given, is filled on the experts' rows only. Within float32 rounding of the numpy twin `dense_expert_reference` on
    the dequantized matrices (`dequantize_mxfp4`); the bits are not those of the row dot. activations "q8" (default
    `MXFP4_ACTIVATIONS`) runs the int8 tiles instead (section "int8 tiles": the int8 row dot's bits)."""
    activations = MXFP4_ACTIVATIONS if activations is None else activations
    if activations not in ("f32", "q8"):
        raise ValueError(f"unknown activations {activations!r} (known: f32, q8)")
    w1p, w1s, w3p, w3s, w2p, w2s = stacked
    num_inner, latent = w1p.shape[1], 2 * w1p.shape[2]
    z = np.ascontiguousarray(z, dtype=np.float32)
    if z.ndim != 2 or z.shape[1] != latent or w2p.shape[1] != latent or 2 * w2p.shape[2] != num_inner:
        raise ValueError(f"experts [{num_inner}, {latent}] / [{w2p.shape[1]}, {2 * w2p.shape[2]}] do not fit z "
                         f"{z.shape}")
    if out is None:
        out = np.empty((tokens.shape[0], latent), np.float32)  # [N, LT]
    if tokens.shape[0] == 0 or expert_ids.shape[0] == 0:
        return out
    if activations == "q8":
        return _mxfp4_experts_run_q8(stacked, expert_ids, z, tokens, starts, ends, 0.0, 0.0, activation,
                                     _q8_isa_code(None), out=out)
    expert_ids = np.ascontiguousarray(expert_ids, dtype=np.int64)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    ends = np.ascontiguousarray(ends, dtype=np.int64)
    gate = np.zeros((tokens.shape[0], num_inner), np.float32)  # [N, MI]; rows of other experts stay 0
    up = np.zeros((tokens.shape[0], num_inner), np.float32)  # [N, MI]
    _mxfp4_tiled_gate_up(w1p, w1s, w3p, w3s, expert_ids, z, np.ascontiguousarray(tokens, dtype=np.int64), starts,
                         ends, _DOUBLED_E2M1, _HALF_SCALES, gate, up)
    expert_activation(gate, up, 0.0, 0.0, activation)
    _mxfp4_tiled_down(w2p, w2s, expert_ids, gate, starts, ends, _DOUBLED_E2M1, _HALF_SCALES, out)
    return out


@njit(cache=True, parallel=True)
def _bf16_matmul_parallel(w, x, out):
    """out [T, R] = x w^T, w bf16 bits u16 [R, C], over blocks of LINEAR_ROWS_PER_TASK rows in the multi-dot tiles (each
    output the bits of the row dot, whatever T and the threads)."""
    blocks = (w.shape[0] + LINEAR_ROWS_PER_TASK - 1) // LINEAR_ROWS_PER_TASK
    for block in prange(blocks):
        _dense_rows_tiled(w, _NO_SCALES[0], False, x, 0, x.shape[0], out, block * LINEAR_ROWS_PER_TASK,
                          min(w.shape[0], (block + 1) * LINEAR_ROWS_PER_TASK))


@njit(cache=True)
def _bf16_matmul_serial(w, x, out):
    _dense_rows_tiled(w, _NO_SCALES[0], False, x, 0, x.shape[0], out, 0, w.shape[0])


BF16_KERNEL_MAX_TOKENS = 32  # from this many tokens on, BLAS on a transient float32 copy is faster
# Below this many weights (4 MB of bf16) the bf16 kernel runs on the calling thread. At decode the trunk matrices
# come from DRAM (the routed experts stream through the caches in between), and a parallel region's start costs
# more than a second thread's reads save: its main thread starts its own rows ~12 us after the call (waking the
# sleeping worker, threads.py), and in the widened K3's decode a [2048, 128] matrix took 66 us over 2 threads against
# 45 us on one (docs/BENCHMARKS.md, "The bf16 trunk of the MoE block at decode"). Full-K3 matrices (25M+ weights)
# still split over the threads. Both paths run the same row dot, so the bits do not depend on it.
BF16_PARALLEL_MIN_WEIGHTS = 1 << 21
BF16_WIDEN_BLOCK_BYTES = 64 << 20  # the transient float32 copy is made this many bytes of rows at a time


def widen_bf16(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32, exact. One new array (shifted in place): the transient a bf16 trunk's budget
    charges is this one copy."""
    wide = bits.astype(np.uint32)
    wide <<= 16
    return wide.view(np.float32)


def linear(x: np.ndarray, w: np.ndarray | QuantizedMatrix) -> np.ndarray:
    """x [T, C] @ w.T for w float32 [R, C] (BLAS), or w bf16 bits uint16 [R, C] kept as bf16: the bf16 row-dot
    kernel for a few tokens, BLAS on transient float32 copies of w (BF16_WIDEN_BLOCK_BYTES of rows at a time) for
    BF16_KERNEL_MAX_TOKENS or more; or a `QuantizedMatrix` (Q8_0, MXFP4) read from its bytes at every T
    (`quantized_matmul`: the same row dot at decode and at prefill). -> [T, R]"""
    if isinstance(w, QuantizedMatrix):
        return quantized_matmul(w, x)
    if w.dtype != np.uint16:
        return x @ w.T
    if bf16_activations_on():
        return bf16_linear(x, w)
    if x.shape[0] >= BF16_KERNEL_MAX_TOKENS:
        block = max(1, BF16_WIDEN_BLOCK_BYTES // (4 * max(w.shape[1], 1)))
        if block >= w.shape[0]:
            return x @ widen_bf16(w).T
        out = np.empty((x.shape[0], w.shape[0]), np.float32)  # [T, R]
        for start in range(0, w.shape[0], block):  # a bounded transient: a bf16 trunk's budget counts on it
            out[:, start:start + block] = x @ widen_bf16(w[start:start + block]).T
        return out
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)  # [T, R]
    kernel = _bf16_matmul_parallel if w.size >= BF16_PARALLEL_MIN_WEIGHTS else _bf16_matmul_serial
    kernel(w, x, out)
    return out


def dense_expert_reference(gate_up: np.ndarray, gate_up_scales: np.ndarray | None, down: np.ndarray,
                           down_scales: np.ndarray | None, x: np.ndarray) -> np.ndarray:
    """The numpy twin of `dense_expert_forward`: widen to float32 (a transient copy), then BLAS matmuls. Also the
    families' path for an expert with many tokens (prefill), where BLAS reuses each weight across tokens."""
    def widen(w: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
        values = widen_bf16(w) if w.dtype == np.uint16 else w.astype(np.float32)
        if scales is None:
            return values
        rows = w.shape[0]  # scales [R] (per row) or [R, G] (per block of C/G values)
        return (values.reshape(rows, scales.reshape(rows, -1).shape[1], -1) * scales.reshape(rows, -1, 1)).reshape(
            w.shape)

    h = np.asarray(x, np.float32) @ widen(gate_up, gate_up_scales).T  # [T, 2I]
    width = down.shape[1]
    gate = h[:, :width]
    with np.errstate(over="ignore"):  # a large negative gate overflows exp to inf: gate / inf is the right -0
        silu = gate / (1 + np.exp(-gate))
    return (silu * h[:, width:]) @ widen(down, down_scales).T


# ------------------------------------------------------------------------- bf16 weights x bf16 activations
# An opt-in path for bf16 weights with many tokens (`generate`/`serve --bf16-activations bf16`, or
# K3SERVE_BF16_ACTIVATIONS=bf16): the activations are rounded to bf16 once per call (round to nearest even, NaN
# kept quiet: llama.cpp's ggml_compute_fp32_to_bf16), and AVX512_BF16's vdpbf16ps multiplies 32 stored bf16 weights
# by 32 bf16 activations an instruction, adding each adjacent pair's products into one of 16 float32 lanes:
#
#     acc[l] += w[32 s + 2 l] x[32 s + 2 l] + w[32 s + 2 l + 1] x[32 s + 2 l + 1]   (l < 16, each product exact)
#     y = the fixed pairwise sum of acc's 16 lanes
#
# llama.cpp's arithmetic for a BF16 matrix (its vec_dot_type is BF16). Twice the products of an f32 FMA an
# instruction, half the bytes loaded for both operands, and no widening of the weights. Tiles of 4 rows x 4 tokens
# (16 accumulators hide the instruction's latency; 8 zmm loads per 16 instructions: at C = 4096 the 4 x rows
# no longer fit L1 beside the rows, and 2 x 4 tiles, 6 loads per 8, ran at 2/3 of the speed), a token tail 4 x 1; a row
# length that is not a multiple of 32 ends in one masked step. The instruction treats denormal inputs and results as
# zero. Each y has the same bits whatever T, the tile it ran in and the threads; they are not the float path's (x
# loses 16 bits of mantissa, a relative error up to 2^-8 a value), which stays the default. Used for bf16 `linear`
# and bf16 experts at every token count, in place of the row dot, the float tile and BLAS (`bf16_experts_on`;
# `dense_experts_tiled` also takes it), so that a product's bits do not depend on its batch either (decode at batch 1
# and 8, a chunked prefill and one token at a time take the same path); `bf16_dot_reference` is the numpy twin.
BF16_DOT_AVAILABLE = "avx512" in AVAILABLE_ISAS and "avx512bf16" in _FEATURES
BF16_STEP = 32  # bf16 products one vdpbf16ps adds, into 16 float32 lanes
BF16_TILE_ROWS, BF16_TILE_TOKENS = 4, 4
_I16 = ir.IntType(16)


def _bf16_activations_setting(value: str, available: bool) -> str:
    """The activation path a K3SERVE_BF16_ACTIVATIONS value selects: "f32" or "bf16"; an unknown value, or bf16 on
    a CPU without AVX512_BF16, is logged and gives f32."""
    name = value.strip().lower() or "f32"
    if name not in ("f32", "bf16"):
        logger.warning("K3SERVE_BF16_ACTIVATIONS=%r: known: f32, bf16; bf16 weights multiply float32 activations "
                       "(f32)", value)
        return "f32"
    if name == "bf16" and not available:
        logger.warning("K3SERVE_BF16_ACTIVATIONS=bf16 needs AVX512_BF16, which this CPU (or numba's target) lacks; "
                       "bf16 weights multiply float32 activations (f32)")
        return "f32"
    if name == "bf16":
        logger.info("bf16 weights on bf16-rounded activations (AVX512_BF16 vdpbf16ps)")
    return name


# read at each call (`linear`, `dense_experts_tiled`), so a process can compare both paths
BF16_ACTIVATIONS = _bf16_activations_setting(os.environ.get("K3SERVE_BF16_ACTIVATIONS", "f32"), BF16_DOT_AVAILABLE)


def bf16_activations_on() -> bool:
    """Whether bf16 weights multiply bf16-rounded activations now (the switch is on and the CPU has the
    instruction)."""
    return BF16_ACTIVATIONS == "bf16" and BF16_DOT_AVAILABLE


def _check_bf16_dot() -> None:
    if not BF16_DOT_AVAILABLE:  # the compiled instruction would fault
        raise RuntimeError("the bf16-activation path needs AVX512_BF16, which this CPU (or numba's target) lacks")


class _BFloat16(ir.Type):
    """LLVM's bfloat, the element type of vdpbf16ps's operands (llvmlite.ir names no such type)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat16)

    def __hash__(self) -> int:
        return hash(_BFloat16)


def _bf16_dots_codegen(num_rows: int, num_tokens: int):
    """IR of `num_rows` bf16 weight rows [C] against `num_tokens` bf16 x rows [C] (all uint16 bits): one float32
    accumulator of 16 lanes a (row, token) pair, one vdpbf16ps a pair and step of 32 values, the last step masked
    (zeros past C), then the fixed pairwise lane sum. Each dot's operations do not depend on the other rows and
    tokens of the tile, so neither do its bits."""
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args)]
        ws, xs = arrays[:num_rows], arrays[num_rows:]
        (length,) = cgutils.unpack_tuple(builder, ws[0].shape, 1)
        lanes = BF16_STEP // 2
        vf, vh, vb = _vector(_F32, lanes), _vector(_I16, BF16_STEP), _vector(_BFloat16(), BF16_STEP)
        module = builder.module
        dpbf16 = cgutils.get_or_insert_function(module, ir.FunctionType(vf, [vf, vb, vb]),
                                                "llvm.x86.avx512bf16.dpbf16ps.512")
        masked_load = cgutils.get_or_insert_function(
            module, ir.FunctionType(vh, [vh.as_pointer(), _I32, _vector(ir.IntType(1), BF16_STEP), vh]),
            f"llvm.masked.load.v{BF16_STEP}i16.p0")
        index_type = length.type
        steps = builder.udiv(length, ir.Constant(index_type, BF16_STEP))
        acc_slots = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * lanes)) for _ in range(num_tokens)]
                     for _ in range(num_rows)]

        def step(base: ir.Value, mask: ir.Value | None) -> None:
            def load(array):
                if mask is None:
                    return builder.bitcast(_load(builder, array.data, base, vh, 2), vb)
                pointer = builder.bitcast(builder.gep(array.data, [base]), vh.as_pointer())
                return builder.bitcast(builder.call(masked_load, [pointer, ir.Constant(_I32, 2), mask,
                                                                  ir.Constant(vh, [0] * BF16_STEP)]), vb)

            weights, inputs = [load(w) for w in ws], [load(x) for x in xs]
            for r in range(num_rows):
                for t in range(num_tokens):
                    slot = acc_slots[r][t]
                    builder.store(builder.call(dpbf16, [builder.load(slot), weights[r], inputs[t]]), slot)

        with cgutils.for_range(builder, steps) as loop:
            step(builder.mul(loop.index, ir.Constant(index_type, BF16_STEP)), None)
        tail_start = builder.mul(steps, ir.Constant(index_type, BF16_STEP))
        remaining = builder.sub(length, tail_start)
        with builder.if_then(builder.icmp_unsigned("!=", remaining, ir.Constant(index_type, 0))):
            iota = ir.Constant(_vector(index_type, BF16_STEP), list(range(BF16_STEP)))
            step(tail_start, builder.icmp_unsigned("<", iota, _splat(builder, remaining, BF16_STEP)))
        totals = [_pairwise_sum(builder, builder.load(slot), lanes) for row in acc_slots for slot in row]
        return context.make_tuple(builder, signature.return_type, totals)

    return codegen


def _bf16_dots_intrinsic(num_rows: int, num_tokens: int):
    def typer(typingctx, *arrays):
        if len(arrays) == num_rows + num_tokens and all(
                isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.uint16 for a in arrays):
            return (types.UniTuple(types.float32, num_rows * num_tokens)(*arrays),
                    _bf16_dots_codegen(num_rows, num_tokens))
        return None
    return typer


@intrinsic
def _bf16_dots_4x4(typingctx, w0, w1, w2, w3, x0, x1, x2, x3):
    """(w0.x0, w0.x1, w0.x2, w0.x3, w1.x0, ..., w3.x3) on bf16 bits [C] (x at least C long)."""
    return _bf16_dots_intrinsic(4, 4)(typingctx, w0, w1, w2, w3, x0, x1, x2, x3)


@intrinsic
def _bf16_dots_4x1(typingctx, w0, w1, w2, w3, x0):
    """(w0.x0, w1.x0, w2.x0, w3.x0) on bf16 bits [C], each with the bits of the same pair in `_bf16_dots_4x4`."""
    return _bf16_dots_intrinsic(4, 1)(typingctx, w0, w1, w2, w3, x0)


@intrinsic
def _bf16_dots_1x1(typingctx, w0, x0):
    """(w0.x0,) on bf16 bits [C], with the bits of the same pair in `_bf16_dots_4x4`."""
    return _bf16_dots_intrinsic(1, 1)(typingctx, w0, x0)


@njit(inline="always")
def _round_row_bf16(x, out):
    """out [C] uint16 = x float32 [C] rounded to bf16: to nearest, ties to even; NaN stays NaN (made quiet)."""
    bits = x.view(np.uint32)
    for c in range(x.shape[0]):
        b = np.int64(bits[c])
        if b & 0x7FFFFFFF > 0x7F800000:
            out[c] = np.uint16((b >> 16) | 0x40)
        else:
            out[c] = np.uint16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)


@njit(cache=True, parallel=True)
def _round_bf16_parallel(x, out):
    for t in prange(x.shape[0]):
        _round_row_bf16(x[t], out[t])


@njit(cache=True)
def _round_bf16_serial(x, out):
    for t in range(x.shape[0]):
        _round_row_bf16(x[t], out[t])


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """x float32 [..., C] -> bf16 bits uint16 [..., C], round to nearest even (NaN kept, quiet), compiled."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)  # [T, C]
    out = np.empty(rows.shape, np.uint16)  # [T, C]
    (_round_bf16_parallel if rows.size >= PARALLEL_MIN_WEIGHTS else _round_bf16_serial)(rows, out)
    return out.reshape(x.shape)


def _round_to_bf16_reference(x: np.ndarray) -> np.ndarray:
    """The numpy twin of `round_to_bf16`."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def bf16_dot_reference(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The numpy twin of the bf16-activation path: x float32 [T, C] rounded to bf16 (`round_to_bf16`'s rounding),
    times w bf16 bits [R, C] widened, products summed in float64. -> float64 [T, R]. The kernels add the same exact
    products in float32 (C/32 additions a lane, then 4 for the lane sum), so they are within about
    (C/32 + 4) 2^-24 sum_c |w[r, c] x[t, c]| of it."""
    xb = _round_to_bf16_reference(np.asarray(x, np.float32))
    return widen_bf16(xb).astype(np.float64) @ widen_bf16(np.asarray(w, np.uint16)).astype(np.float64).T


@njit(inline="always")
def _bf16_rows_tiled(w, xb, first, last, out, begin, end):
    """out[n, r] = w[r] . xb[n] for rows begin:end of w (bf16 bits [R, C]) and rows first:last of xb (bf16 bits
    [N, C]): four tokens at a time against each four rows, the weight rows re-read from L2 for each four tokens
    (their block stays there), the token tail one at a time; under four tokens, one row at a time. A row block that
    is not a multiple of 4 repeats its last row in the last tile (computed again, written again with the same
    bits)."""
    if last - first < BF16_TILE_TOKENS:  # decode: one row at a time, streamed in order (the prefetcher follows)
        for row in range(begin, end):
            for n in range(first, last):
                out[n, row] = _bf16_dots_1x1(w[row], xb[n])[0]
        return
    if begin < end:  # the rows streamed in first, in order (`_touch_rows`)
        out[first, begin] = np.float32(_touch_rows(w, begin, end))  # overwritten by the tiles
    n = first
    while n + BF16_TILE_TOKENS <= last:
        x0, x1, x2, x3 = xb[n], xb[n + 1], xb[n + 2], xb[n + 3]
        for row in range(begin, end, BF16_TILE_ROWS):
            r1, r2, r3 = min(row + 1, end - 1), min(row + 2, end - 1), min(row + 3, end - 1)
            dots = _bf16_dots_4x4(w[row], w[r1], w[r2], w[r3], x0, x1, x2, x3)
            for i in range(BF16_TILE_ROWS):
                r = min(row + i, end - 1)
                for t in range(BF16_TILE_TOKENS):
                    out[n + t, r] = dots[BF16_TILE_TOKENS * i + t]
        n += BF16_TILE_TOKENS
    while n < last:
        for row in range(begin, end, BF16_TILE_ROWS):
            r1, r2, r3 = min(row + 1, end - 1), min(row + 2, end - 1), min(row + 3, end - 1)
            out[n, row], out[n, r1], out[n, r2], out[n, r3] = _bf16_dots_4x1(w[row], w[r1], w[r2], w[r3], xb[n])
        n += 1


@njit(cache=True, parallel=True)
def _bf16_linear_parallel(w, xb, out):
    """out [T, R] = xb w^T on bf16 bits, over blocks of LINEAR_ROWS_PER_TASK rows."""
    blocks = (w.shape[0] + LINEAR_ROWS_PER_TASK - 1) // LINEAR_ROWS_PER_TASK
    for block in prange(blocks):
        _bf16_rows_tiled(w, xb, 0, xb.shape[0], out, block * LINEAR_ROWS_PER_TASK,
                         min(w.shape[0], (block + 1) * LINEAR_ROWS_PER_TASK))


@njit(cache=True)
def _bf16_linear_serial(w, xb, out):
    _bf16_rows_tiled(w, xb, 0, xb.shape[0], out, 0, w.shape[0])


def bf16_linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x float32 [T, C] @ w.T for w bf16 bits uint16 [R, C] on the bf16-activation path (x rounded to bf16 once);
    needs AVX512_BF16 (`BF16_DOT_AVAILABLE`). -> float32 [T, R]; `bf16_dot_reference` is the twin."""
    if x.ndim != 2 or w.ndim != 2 or w.dtype != np.uint16 or x.shape[1] != w.shape[1]:
        raise ValueError(f"bf16 linear: x {x.shape} does not fit w {w.shape} {w.dtype}")
    _check_bf16_dot()
    w = np.ascontiguousarray(w)
    xb = round_to_bf16(x)  # [T, C]
    out = np.empty((x.shape[0], w.shape[0]), np.float32)  # [T, R]
    if x.shape[0] == 0 or w.shape[0] == 0:
        return out
    # under four tokens the float row dot's rule (small trunk matrices on the calling thread), else the tiles' work
    parallel = (w.size >= BF16_PARALLEL_MIN_WEIGHTS if x.shape[0] < BF16_TILE_TOKENS
                else w.size * BF16_TILE_TOKENS >= PARALLEL_MIN_WEIGHTS)
    kernel = _bf16_linear_parallel if parallel else _bf16_linear_serial
    kernel(w, xb, out)
    return out


@njit(inline="always")
def _bf16_gate_up_task(gate_up, expert_ids, xb, tokens, xg, starts, ends, projected, task, blocks):
    """Task (k, half, block) of stage 1, projected [N, 2I]. Under BF16_TILE_TOKENS tokens (decode) a task streams
    one run of rows of one matrix, gate (half 0) or up (half 1), into projected (`_bf16_rows_tiled`: one row at a
    time, in order): a gate and an up run side by side in one task read them slower (Qwen3-30B-A3B's 8 experts, one
    token, cold, old and new kernels alternated in one process: 2.70-3.05 against 2.40-2.61 ms). From
    BF16_TILE_TOKENS tokens (prefill) half 0 computes the block's gate rows r, r + 1 and up rows r, r + 1 as one
    tile's four rows against four tokens and writes SiLU-GLU into projected's gate columns at once, as before;
    half 1 has nothing to do. The same bits either way (each dot's operations are its own)."""
    k = task // (2 * blocks)
    half, block = (task // blocks) % 2, task % blocks
    e = expert_ids[k]
    width = projected.shape[1] // 2
    begin, end = block * ROWS_PER_TASK, min(width, (block + 1) * ROWS_PER_TASK)
    if ends[k] - starts[k] < BF16_TILE_TOKENS:
        _bf16_rows_tiled(gate_up[e], xg, starts[k], ends[k], projected, half * width + begin, half * width + end)
        return
    if half == 1:
        return
    if begin < end:  # the rows streamed in first; the tiles overwrite
        projected[starts[k], begin] = np.float32(_touch_rows(gate_up[e], begin, end)
                                                 + _touch_rows(gate_up[e], width + begin, width + end))
    n = starts[k]
    while n + BF16_TILE_TOKENS <= ends[k]:
        x0, x1, x2, x3 = xb[tokens[n]], xb[tokens[n + 1]], xb[tokens[n + 2]], xb[tokens[n + 3]]
        for row in range(begin, end, 2):
            other = min(row + 1, end - 1)
            g0, g1, g2, g3, h0, h1, h2, h3, u0, u1, u2, u3, v0, v1, v2, v3 = _bf16_dots_4x4(
                gate_up[e, row], gate_up[e, other], gate_up[e, width + row], gate_up[e, width + other], x0, x1, x2, x3)
            projected[n, row] = _silu_glu(g0, u0)
            projected[n + 1, row] = _silu_glu(g1, u1)
            projected[n + 2, row] = _silu_glu(g2, u2)
            projected[n + 3, row] = _silu_glu(g3, u3)
            projected[n, other] = _silu_glu(h0, v0)
            projected[n + 1, other] = _silu_glu(h1, v1)
            projected[n + 2, other] = _silu_glu(h2, v2)
            projected[n + 3, other] = _silu_glu(h3, v3)
        n += BF16_TILE_TOKENS
    while n < ends[k]:
        for row in range(begin, end, 2):
            other = min(row + 1, end - 1)
            g0, h0, u0, v0 = _bf16_dots_4x1(gate_up[e, row], gate_up[e, other], gate_up[e, width + row],
                                            gate_up[e, width + other], xb[tokens[n]])
            projected[n, row], projected[n, other] = _silu_glu(g0, u0), _silu_glu(h0, v0)
        n += 1


@njit(cache=True, parallel=True)
def _bf16_experts_parallel(gate_up, down, expert_ids, xb, tokens, xg, starts, ends, projected, hidden_bits, out):
    """Stage 1 over (expert, gate or up, 16-row block) into projected [N, 2I] (`_bf16_gate_up_task`); SiLU-GLU where
    stage 1 left it, and the hidden rows rounded to bf16; stage 2 over (expert, down row block). xg [N, H] holds
    each pair's activation row. See `bf16_experts_run`."""
    width = hidden_bits.shape[1]
    blocks = (width + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * 2 * blocks):
        _bf16_gate_up_task(gate_up, expert_ids, xb, tokens, xg, starts, ends, projected, task, blocks)
    for k in prange(expert_ids.shape[0]):
        for n in range(starts[k], ends[k]):
            if ends[k] - starts[k] < BF16_TILE_TOKENS:  # the hidden row in place of the gate values
                for i in range(width):
                    projected[n, i] = _silu_glu(projected[n, i], projected[n, width + i])
            _round_row_bf16(projected[n, :width], hidden_bits[n])
    blocks = (out.shape[1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(expert_ids.shape[0] * blocks):
        k = task // blocks
        block = task % blocks
        _bf16_rows_tiled(down[expert_ids[k]], hidden_bits, starts[k], ends[k], out, block * ROWS_PER_TASK,
                         min(out.shape[1], (block + 1) * ROWS_PER_TASK))


def bf16_experts_run(gate_up: np.ndarray, down: np.ndarray, expert_ids: np.ndarray, x: np.ndarray,
                     tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                     out: np.ndarray | None = None) -> np.ndarray:
    """`dense_experts_run` for bf16 experts (gate_up [E, 2I, H], down [E, H, I] bf16 bits, no scales) on the
    bf16-activation path: x rounded to bf16 once, the SiLU-GLU hidden rows rounded to bf16 before down, every
    product by vdpbf16ps (llama.cpp's arithmetic). `out` [N, H], when given, is filled on the experts' rows only.
    Each y[n] has the same bits whatever the other tokens, experts and threads of the call. Needs AVX512_BF16."""
    num_experts, hidden_size, width = down.shape
    if (gate_up.shape != (num_experts, 2 * width, hidden_size) or gate_up.dtype != np.uint16
            or down.dtype != np.uint16 or x.ndim != 2 or x.shape[1] != hidden_size):
        raise ValueError(f"bf16 experts gate_up {gate_up.shape} {gate_up.dtype} / down {down.shape} {down.dtype} do "
                         f"not fit x {x.shape}")
    _check_bf16_dot()
    if out is None:
        out = np.empty((tokens.shape[0], hidden_size), np.float32)  # [N, H]
    if tokens.shape[0] == 0 or expert_ids.shape[0] == 0:
        return out
    projected = np.empty((tokens.shape[0], 2 * width), np.float32)  # [N, 2I]
    hidden_bits = np.empty((tokens.shape[0], width), np.uint16)  # [N, I]
    xb, tokens = round_to_bf16(x), np.ascontiguousarray(tokens, dtype=np.int64)
    xg = xb[tokens]  # [N, H]: each pair's row, the experts' contiguous
    _bf16_experts_parallel(np.ascontiguousarray(gate_up), np.ascontiguousarray(down),
                           np.ascontiguousarray(expert_ids, dtype=np.int64), xb, tokens, xg,
                           np.ascontiguousarray(starts, dtype=np.int64), np.ascontiguousarray(ends, dtype=np.int64),
                           projected, hidden_bits, out)
    return out


def bf16_experts_on(gate_up: np.ndarray, gate_up_scales: np.ndarray | None) -> bool:
    """Whether experts of this kind run `bf16_experts_run` at every token count (in place of the row dot, the float
    tile and BLAS on a float32 copy): bf16 experts while the bf16-activation path is on."""
    return bf16_activations_on() and gate_up.dtype == np.uint16 and gate_up_scales is None


def q8_0_experts_on(gate_up: np.ndarray, gate_up_scales: np.ndarray | None, down: np.ndarray) -> bool:
    """Whether block-scaled int8 experts (a GGUF's Q8_0: a scale per 32 values) run `q8_0_experts_run` (Q8_0
    activations, llama.cpp's arithmetic) at every token count: the switch is "auto" (the default) or "q8", and both
    widths hold whole blocks of 32."""
    return (INT8_ACTIVATIONS in ("auto", "q8") and gate_up.dtype == np.int8 and down.dtype == np.int8
            and gate_up_scales is not None and gate_up.shape[2] % GROUP_SIZE == 0 and down.shape[2] % GROUP_SIZE == 0
            and gate_up_scales.shape == (*gate_up.shape[:2], gate_up.shape[2] // GROUP_SIZE))


def int8_experts_q8_on(gate_up: np.ndarray, gate_up_scales: np.ndarray | None, down: np.ndarray) -> bool:
    """Whether int8 experts run `int8_experts_q8` (Q8_0 activations) at every token count: the switch is on, the
    scales are per row (a GGUF's Q8_0 block scales stay on the float path) and both widths are multiples of 32."""
    return (INT8_ACTIVATIONS == "q8" and gate_up.dtype == np.int8 and gate_up_scales is not None
            and gate_up_scales.size == gate_up.shape[0] * gate_up.shape[1]
            and gate_up.shape[2] % GROUP_SIZE == 0 and down.shape[2] % GROUP_SIZE == 0)


def warmup(dense_experts: bool = True) -> None:
    """Compile (or load from numba's cache) every kernel of this module on tiny inputs, for this CPU's ISA.

    `dense_experts` False leaves out the families' bf16, int8 and float32 expert kernels (`dense_experts_run`,
    `dense_experts_tiled`; compiled at their first call): K3 models never run them, and they were ~71 of the 98 s
    of a cold compile on 2 cores (2026-12-07, docs/BENCHMARKS.md)."""
    packed = np.zeros((3, BYTES_PER_GROUP), dtype=np.uint8)  # [3, 16]
    scales = np.full((3, 1), 127, dtype=np.uint8)  # [3, 1]
    x = np.ones((2, GROUP_SIZE), dtype=np.float32)  # [2, 32]
    out = np.empty((2, 3), dtype=np.float32)  # [2, 3]
    for kernel in (_matmul_serial, _matmul_parallel):
        kernel(packed, scales, x, _HALF_SCALES, ISA_CODES[ISA], out, MXFP4_ROWS_PER_DOT)
    square = (np.zeros((32, 16), np.uint8), np.full((32, 1), 127, np.uint8))  # a [32, 32] matrix
    stacked = stack_expert(square, square, square)
    w1p, w1s, w3p, w3s, w2p, w2s = stacked
    one = np.zeros(1, np.int64)
    zp, tokens, ends = np.ones((2, 32), np.float32), np.zeros(2, np.int64), np.full(1, 2, np.int64)
    gate, up = np.empty((2, 32), np.float32), np.empty((2, 32), np.float32)
    for kernel in (_experts_gate_up_serial, _experts_gate_up_parallel):
        kernel(w1p, w1s, w3p, w3s, one, zp, tokens, one, ends, _HALF_SCALES, ISA_CODES[ISA], gate, up,
               MXFP4_GATE_UP_ROWS_PER_DOT)
    for kernel in (_experts_down_serial, _experts_down_parallel):
        kernel(w2p, w2s, one, one, ends, _HALF_SCALES, ISA_CODES[ISA], gate, np.empty((2, 32), np.float32),
               MXFP4_ROWS_PER_DOT)
    if MXFP4_ACTIVATIONS == "q8":
        mxfp4_experts_run(stacked, one, zp, tokens, one, ends, 4.0, 25.0)
    _accumulate_rows(np.zeros((1, 32), np.float32), one, np.ones(1, np.float32), np.zeros((1, 32), np.float32))
    permute_groups(x, np.empty_like(x))
    q8_blocks, (xq, xd) = np.zeros((3, Q8_0_BLOCK_BYTES), np.uint8), quantize_activations(x)
    xt, dt = _q8_0_tiles(xq, xd, ISA_CODES[ISA])  # 2 tokens: empty (the kernels compile every path regardless)
    for kernel in (_q8_0_matmul_serial, _q8_0_matmul_parallel):
        kernel(q8_blocks, xq, xd, xt, dt, _F16_TO_F32, ISA_CODES[ISA], out)
    for kernel in (_bf16_matmul_serial, _bf16_matmul_parallel):
        kernel(np.zeros((3, 32), np.uint16), x, out)
    if INT8_ACTIVATIONS == "q8":
        int8_experts_q8(np.zeros((1, 64, 32), np.int8), np.ones((1, 64), np.float32), np.zeros((1, 32, 32), np.int8),
                        np.ones((1, 32), np.float32), one, x, np.zeros(2, np.int64), one, np.full(1, 2, np.int64))
    if INT8_ACTIVATIONS == "q8":  # at "auto" only a Q8_0 GGUF's experts use these: compiled at their first call
        gate_up, down = np.zeros((1, 64, 32), np.int8), np.zeros((1, 32, 32), np.int8)  # I = 32, H = 32
        # the families' scales: a GGUF's float16 ones, as their bits (`kernel_block_scales`)
        gate_up_scales, down_scales = np.ones((1, 64, 1), np.uint16), np.ones((1, 32, 1), np.uint16)
        xq, xd = quantize_activations(x)
        xt, dt = _q8_0_tiles(xq, xd, ISA_CODES[ISA])  # 2 tokens: empty
        for kernel in (_q8s_gate_up_serial, _q8s_gate_up_parallel):
            kernel(gate_up, gate_up_scales, one, xq, xd, xt, dt, np.zeros(1, np.int64), np.full(1, 2, np.int64),
                   ISA_CODES[ISA], np.empty((2, 64), np.float32), np.empty((2, 32), np.float32))
        for kernel in (_q8s_down_serial, _q8s_down_parallel):
            kernel(down, down_scales, one, xq, xd, xt, dt, np.zeros(1, np.int64), np.full(1, 2, np.int64),
                   ISA_CODES[ISA], np.empty((2, 32), np.float32))
    if dense_experts:
        warmup_dense_experts()
    if bf16_activations_on():
        bits = np.zeros((1, 64, 32), np.uint16)  # I = 32, H = 32
        bf16_experts_run(bits, bits[:, :32], one, x, np.zeros(2, np.int64), one, np.full(1, 2, np.int64))
        for kernel in (_bf16_linear_serial, _bf16_linear_parallel):
            kernel(bits[0], round_to_bf16(x), np.empty((2, 64), np.float32))
        for kernel in (_round_bf16_serial, _round_bf16_parallel):
            kernel(x, np.empty(x.shape, np.uint16))


def warmup_dense_experts() -> None:
    """Compile (or load from numba's cache) the families' bf16, int8 and float32 expert kernels (part of `warmup`)."""
    one, x = np.zeros(1, np.int64), np.ones((2, GROUP_SIZE), dtype=np.float32)  # [2, 32]
    for dtype in (np.uint16, np.int8, np.float32):
        gate_up, down = np.zeros((1, 64, 32), dtype), np.zeros((1, 32, 32), dtype)  # I = 32, H = 32
        for kernel in (_dense_experts_serial, _dense_experts_parallel):
            kernel(gate_up, np.ones((1, 64, 1), np.float32), down, np.ones((1, 32, 1), np.float32), dtype == np.int8,
                   one, x, np.zeros(2, np.int64), one, np.full(1, 2, np.int64), np.empty((2, 32), np.float32),
                   np.empty((2, 32), np.float32))
        for scaled in (False, True):
            _tiled_experts_parallel(gate_up, np.ones((1, 64, 1), np.float32), down, np.ones((1, 32, 1), np.float32),
                                    scaled, _KIND_CODES[np.dtype(dtype)], one, x, np.zeros(2, np.int64), one,
                                    np.full(1, 2, np.int64), np.empty((2, 32), np.float32),
                                    np.empty((2, 32), np.float32))
