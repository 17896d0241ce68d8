"""The MXFP4 routed-expert kernels with 1, 2 or 4 rows a pass of the row dot (`kernels.MXFP4_ROWS_PER_DOT`), and
the opt-in int8 VNNI path, alternated in one process: same bits for the float variants (checked: the run stops if
not), time and GB/s of MXFP4 bytes, at 1 and 2 threads.

Shapes (T = 1, 4 experts active a call, each call the next 4 of E stacked experts so the weights come from DRAM
as in decode):
    widened  the widened K3 fixture's experts: w1/w3 [1024, 2048], w2 [2048, 1024], E = 64 (200 MB)
    k3       full K3's experts: w1/w3 [3072, 3584], w2 [3584, 3072], E = 8 (132 MB)
    matmul   `mxfp4_matmul` on one full-K3 w1 [3072, 3584] (the trunk's MXFP4 path), T = 1

Variants: rows a pass in stage 1 / stage 2 (1/1: the one-row dot everywhere, as before; 2/1: the w1 and w3 rows of
one index together, the default; 2/2 and 4/4), and q8 (the int8 VNNI path, activation quantization included; its
relative RMS error against the float path is printed).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_mxfp4_row_dots.py [--rounds 7] [--calls 32] [--threads 1 2]
(K3SERVE_MXFP4_ISA=avx2 runs every variant, the int8 one included, on AVX2.)
Prints one line per (shape, threads): median wall ms of each variant (stage 1 + stage 2), its CPU ms, GB/s, the
default's and q8's gain over 1/1; then a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import json
import time

import numba
import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.model import kernels

VARIANTS = ((1, 1), (2, 1), (2, 2), (4, 4))  # rows a pass (stage 1, stage 2); the matmul case uses the second
BASE, DEFAULT = (1, 1), (kernels.MXFP4_GATE_UP_ROWS_PER_DOT, kernels.MXFP4_ROWS_PER_DOT)
EXPERT_SHAPES = {"widened": (1024, 2048, 64), "k3": (3072, 3584, 8)}  # (MI, LT, E)
ACTIVE = 4


def _random_matrices(rng: np.random.Generator, count: int, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    packed = rng.integers(0, 256, size=(count, rows, cols // 2), dtype=np.uint8)  # [E, R, C/2]
    scales = rng.integers(118, 125, size=(count, rows, cols // 32), dtype=np.uint8)  # [E, R, G]
    return packed, scales


def _experts_case(rng: np.random.Generator, inner: int, latent: int, count: int):
    w1p, w1s = _random_matrices(rng, count, inner, latent)
    w3p, w3s = _random_matrices(rng, count, inner, latent)
    w2p, w2s = _random_matrices(rng, count, latent, inner)
    z = rng.standard_normal((1, latent)).astype(np.float32)  # [T, LT]
    zp = np.empty_like(z)
    kernels.permute_groups(z, zp)
    hidden = rng.standard_normal((ACTIVE, inner)).astype(np.float32)  # [N, MI] the stage-2 input, permuted
    natural = np.array([(i // 32) * 32 + (i % 2) * 16 + (i % 32) // 2 for i in range(inner)])
    hidden_natural = hidden[:, natural]  # the same vector in natural order (what the int8 path reads)
    tokens = np.zeros(ACTIVE, np.int64)
    starts, ends = np.arange(ACTIVE, dtype=np.int64), np.arange(1, ACTIVE + 1, dtype=np.int64)
    gate, up = np.empty((ACTIVE, inner), np.float32), np.empty((ACTIVE, inner), np.float32)
    out = np.empty((ACTIVE, latent), np.float32)
    code = kernels.ISA_CODES[kernels.ISA]
    q8_code = kernels._q8_isa_code(kernels.ISA if kernels.ISA in kernels.Q8_ISAS else None) if kernels.Q8_ISAS else -1
    state = {"call": 0}

    def run(rows_per_dot: tuple[int, int] | str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        first = (state["call"] * ACTIVE) % count
        state["call"] += 1
        expert_ids = (first + np.arange(ACTIVE, dtype=np.int64)) % count
        if rows_per_dot == "q8":  # the int8 path's two stages, each with its activation quantization
            kernels._experts_q8_gate_up(w1p, w1s, w3p, w3s, expert_ids, *kernels._q8_vnni_prepare(z), tokens, starts,
                                        ends, q8_code, gate, up)
            kernels._experts_q8_down(w2p, w2s, expert_ids, *kernels._q8_vnni_prepare(hidden_natural), starts, ends,
                                     q8_code, out)
            return gate, up, out
        kernels._experts_gate_up_parallel(w1p, w1s, w3p, w3s, expert_ids, zp, tokens, starts, ends,
                                          kernels._HALF_SCALES, code, gate, up, rows_per_dot[0])
        kernels._experts_down_parallel(w2p, w2s, expert_ids, starts, ends, kernels._HALF_SCALES, code, hidden, out,
                                       rows_per_dot[1])
        return gate, up, out

    run.reset = lambda: state.update(call=0)  # type: ignore[attr-defined]
    nbytes = ACTIVE * 3 * (inner * latent // 2 + inner * latent // 32)
    return run, nbytes


def _matmul_case(rng: np.random.Generator):
    packed, scales = _random_matrices(rng, 1, 3072, 3584)
    packed, scales = packed[0], scales[0]
    x = rng.standard_normal((1, 3584)).astype(np.float32)
    xp = np.empty_like(x)
    kernels.permute_groups(x, xp)
    out = np.empty((1, 3072), np.float32)
    code = kernels.ISA_CODES[kernels.ISA]

    def run(rows_per_dot: tuple[int, int] | str) -> tuple[np.ndarray]:
        if rows_per_dot == "q8":
            out[:] = kernels.mxfp4_matmul_q8(packed, scales, x, isa=kernels.ISA if kernels.ISA in kernels.Q8_ISAS
                                             else None)
            return (out,)
        kernels._matmul_parallel(packed, scales, xp, kernels._HALF_SCALES, code, out, rows_per_dot[1])
        return (out,)

    return run, packed.nbytes + scales.nbytes


def _same_bits_and_q8_error(run, variants) -> tuple[bool, float | None]:
    """Whether the float variants give the same bits on the same call (the experts case rotates its experts per
    call: reset the rotation), and the int8 path's relative RMS error against them (its last output)."""
    results = {}
    for rows_per_dot in variants:
        if hasattr(run, "reset"):
            run.reset()
        results[rows_per_dot] = [a.copy() for a in run(rows_per_dot)]
    floats = [results[v] for v in variants if v != "q8"]
    same = all(all(np.array_equal(a, b) for a, b in zip(floats[0], other)) for other in floats[1:])
    if "q8" not in results:
        return same, None
    got, want = results["q8"][-1].astype(np.float64), floats[0][-1].astype(np.float64)
    return same, float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=32, help="calls per timed sample")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", default=["widened", "k3", "matmul"])
    parser.add_argument("--experts", type=int, default=None,
                        help="stacked experts E (default 64 widened, 8 k3; 4 keeps them in cache: compute only)")
    args = parser.parse_args()
    kernels.warmup()
    rng = np.random.default_rng(0)
    records = []
    int8_isa = kernels.ISA if kernels.ISA in kernels.Q8_ISAS else (kernels.Q8_ISAS or ("none",))[-1]
    print(f"isa {kernels.ISA} (int8 path: {int8_isa}) | numba threads available {numba.config.NUMBA_NUM_THREADS} | "
          f"{args.rounds} rounds x "
          f"{args.calls} calls")
    for shape in args.shapes:
        if shape == "matmul":
            run, nbytes = _matmul_case(rng)
        else:
            inner, latent, count = EXPERT_SHAPES[shape]
            run, nbytes = _experts_case(rng, inner, latent, args.experts or count)
        for threads in args.threads:
            numba.set_num_threads(threads)
            variants = VARIANTS + (("q8",) if kernels.Q8_ISAS else ())
            for rows_per_dot in variants:  # compile / first touch
                run(rows_per_dot)
            same_bits, q8_error = _same_bits_and_q8_error(run, variants)
            if not same_bits:
                raise SystemExit(f"{shape}: the rows-a-pass variants gave different bits")
            samples: dict[object, list[float]] = {v: [] for v in variants}
            cpu: dict[object, list[float]] = {v: [] for v in variants}
            for round_index in range(args.rounds):
                order = variants if round_index % 2 == 0 else variants[::-1]
                for rows_per_dot in order:
                    start, start_cpu = time.perf_counter(), time.process_time()
                    for _ in range(args.calls):
                        run(rows_per_dot)
                    samples[rows_per_dot].append((time.perf_counter() - start) / args.calls)
                    cpu[rows_per_dot].append((time.process_time() - start_cpu) / args.calls)
            name = {v: v if isinstance(v, str) else f"{v[0]}/{v[1]}" for v in variants}
            median_ms = {name[v]: float(np.median(samples[v])) * 1e3 for v in variants}
            cpu_ms = {name[v]: float(np.median(cpu[v])) * 1e3 for v in variants}
            gb_per_s = {k: nbytes / (ms * 1e-3) / 1e9 for k, ms in median_ms.items()}
            base, default = name[BASE], name[DEFAULT]
            print(f"{shape:>8} threads {threads} | " + " | ".join(
                f"{k}: {median_ms[k]:7.3f} ms (cpu {cpu_ms[k]:7.3f}) {gb_per_s[k]:5.1f} GB/s" for k in median_ms)
                + f" | {default} vs {base}: {median_ms[base] / median_ms[default]:.2f}x"
                + (f", q8 vs {base}: {median_ms[base] / median_ms['q8']:.2f}x (rel RMS {q8_error:.1e})"
                   if q8_error is not None else "") + f" | same bits {same_bits}", flush=True)
            records.append({"shape": shape, "threads": threads, "bytes_per_call": nbytes, "median_ms": median_ms,
                            "cpu_ms": cpu_ms, "gb_per_s": gb_per_s,
                            "samples_ms": {name[v]: [s * 1e3 for s in samples[v]] for v in variants},
                            "same_bits": same_bits, "q8_relative_rms_vs_float": q8_error})
    print(json.dumps({"benchmark": "mxfp4_row_dots", "isa": kernels.ISA, "rounds": args.rounds,
                      "calls": args.calls, "results": records}))


if __name__ == "__main__":
    main()
