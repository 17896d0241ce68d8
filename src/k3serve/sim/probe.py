"""Measuring a machine for the simulator: the disk as the engine reads it, the CPU with the engine's own kernels.

- `probe_disk(path)`: O_DIRECT `preadv` of `size` bytes at random aligned offsets, `qd` threads at once, for each
  (size, queue depth): aggregate bytes/s. Short by design (a fraction of a second per point): the CPU and the
  disk are shared.
- `probe_cpu()`: the MXFP4 expert kernel (`k3serve.model.kernels.mxfp4_expert_forward`) at one row and at many,
  the float32 dense matmul the trunk runs (numpy), bf16 -> float32 widening (`k3serve.weights.bf16`), and a KDA
  decode state update, reported as bytes/s and FLOP/s: the `compute` table of a machine file.
"""

from __future__ import annotations

import mmap
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np

from k3serve.sim.machine import ComputeModel, DiskModel, MachineError

ALIGN = 4096


def probe_disk(path: str | Path, sizes: Sequence[int] = (4096, 65536, 1 << 20, 4 << 20, 16 << 20),
               queue_depths: Sequence[int] = (1, 4, 16), seconds: float = 0.3, seed: int = 0) -> DiskModel:
    path = Path(path)
    if not path.is_file():
        raise MachineError(f"probe-disk needs an existing file to read (give a large file on the disk to "
                           f"measure, e.g. a packed experts.bin), got {path}")
    size = path.stat().st_size
    if size < max(sizes) * 4:
        raise MachineError(f"{path} is {size} bytes: too small to probe reads of {max(sizes)} bytes "
                           f"(needs at least 4x that)")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError as exc:
        raise MachineError(f"cannot open {path} with O_DIRECT: {exc}") from exc
    rng = random.Random(seed)
    rows = []
    try:
        for n in sizes:
            row = []
            for qd in queue_depths:
                buffers = [mmap.mmap(-1, n) for _ in range(qd)]
                done = [0] * qd
                deadline = time.perf_counter() + seconds
                offsets = [[rng.randrange(0, (size - n) // ALIGN) * ALIGN for _ in range(4096)] for _ in range(qd)]

                def worker(i: int) -> None:
                    j = 0
                    while time.perf_counter() < deadline or j == 0:
                        os.preadv(fd, [buffers[i]], offsets[i][j % 4096])
                        done[i] += n
                        j += 1

                started = time.perf_counter()
                with ThreadPoolExecutor(qd) as pool:
                    list(pool.map(worker, range(qd)))
                row.append(sum(done) / (time.perf_counter() - started))
                for b in buffers:
                    b.close()
            rows.append(tuple(row))
    finally:
        os.close(fd)
    return DiskModel(tuple(int(s) for s in sizes), tuple(int(q) for q in queue_depths), tuple(rows))


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def probe_cpu(latent: int = 1024, inner: int = 1024, dense: int = 2048, rows: int = 64,
              repeats: int = 5) -> tuple[ComputeModel, dict]:
    """The compute table and the raw timings behind it."""
    from k3serve.model.kernels import mxfp4_expert_forward
    from k3serve.weights.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
    from k3serve.weights.mxfp4 import quantize_mxfp4

    rng = np.random.default_rng(0)
    w1 = quantize_mxfp4(rng.standard_normal((inner, latent)).astype(np.float32))
    w3 = quantize_mxfp4(rng.standard_normal((inner, latent)).astype(np.float32))
    w2 = quantize_mxfp4(rng.standard_normal((latent, inner)).astype(np.float32))
    expert_bytes = sum(p.nbytes + s.nbytes for p, s in (w1, w3, w2))
    expert_flops_per_row = 2 * 3 * inner * latent
    one = rng.standard_normal((1, latent)).astype(np.float32)
    many = rng.standard_normal((rows, latent)).astype(np.float32)
    t_one = _best_time(lambda: mxfp4_expert_forward(w1, w3, w2, one, 4.0, 25.0), repeats)
    t_many = _best_time(lambda: mxfp4_expert_forward(w1, w3, w2, many, 4.0, 25.0), repeats)

    weight = rng.standard_normal((dense, dense)).astype(np.float32)  # the trunk is float32 in RAM
    x1 = rng.standard_normal((1, dense)).astype(np.float32)
    xm = rng.standard_normal((rows, dense)).astype(np.float32)
    t_dense_one = _best_time(lambda: x1 @ weight.T, repeats)
    t_dense_many = _best_time(lambda: xm @ weight.T, repeats)

    bits = f32_to_bf16_bits(weight)
    t_widen = _best_time(lambda: bf16_bits_to_f32(bits), repeats)

    heads, d = 96, 128  # the full K3's KDA state: one decode update S <- S * decay + k (v - S^T k)^T
    state = np.zeros((heads, d, d), np.float32)
    k = rng.standard_normal((heads, d)).astype(np.float32)
    v = rng.standard_normal((heads, d)).astype(np.float32)

    def kda_step() -> None:
        nonlocal state
        state *= np.float32(0.99)
        err = v - np.einsum("hij,hi->hj", state, k)
        state += np.einsum("hi,hj->hij", k, err)

    t_kda = _best_time(kda_step, repeats)
    compute = ComputeModel(
        dense_bytes_per_s=weight.nbytes / t_dense_one, dense_flops=2 * dense * dense * rows / t_dense_many,
        expert_bytes_per_s=expert_bytes / t_one, expert_flops=expert_flops_per_row * rows / t_many,
        attention_s_per_token_layer=t_kda, layer_overhead_s=1e-3, widen_bytes_per_s=weight.nbytes / t_widen)
    raw = {"expert_shape": [inner, latent], "expert_bytes": expert_bytes, "expert_batch1_s": t_one,
           f"expert_batch{rows}_s": t_many, "dense_shape": [dense, dense], "dense_batch1_s": t_dense_one,
           f"dense_batch{rows}_s": t_dense_many, "widen_s": t_widen, "kda_full_k3_step_s": t_kda,
           "layer_overhead_s": "not measured: set to 1 ms (Python dispatch per layer, from the decode benchmark)"}
    return compute, raw
