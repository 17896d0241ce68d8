"""2. MXFP4: quantize a tensor and compare its error and bytes with bf16 and int8."""

from __future__ import annotations

import statistics
import time

import numpy as np

from k3serve.lab.registry import Figure, LabModule, LabParamError, LabResult, Param
from k3serve.lab.verdict import judge
from k3serve.lab.timing import MIN_REPEATS
from k3serve.weights.bf16 import round_to_bf16
from k3serve.weights.mxfp4 import GROUP_SIZE, dequantize_mxfp4, quantize_mxfp4

DISTRIBUTIONS = ("gaussian", "laplace", "student_t3", "model_trunk")


def sample(distribution: str, rows: int, cols: int, outliers: float, seed: int, lab) -> tuple[np.ndarray, str]:
    """[rows, cols] float32 values and where they came from."""
    rng = np.random.default_rng(seed)
    if distribution == "model_trunk":
        from k3serve.weights.checkpoint import Checkpoint

        checkpoint = Checkpoint(lab.model_dir)
        candidates = sorted((n for n in checkpoint.index.names() if n.endswith("q_proj.weight")),
                            key=lambda n: -checkpoint.index.info(n).nbytes)
        weights = [np.asarray(checkpoint.read(n), np.float32).ravel() for n in candidates]
        checkpoint.close()
        flat = np.concatenate(weights)
        need = rows * cols
        values = np.resize(flat, need)  # repeats when the model's tensors are smaller than rows x cols
        where = f"the q_proj weights of {lab.model_name} ({flat.size} values{', repeated' if need > flat.size else ''})"
    elif distribution == "gaussian":
        values, where = rng.standard_normal(rows * cols), "Gaussian N(0, 1)"
    elif distribution == "laplace":
        values, where = rng.laplace(size=rows * cols), "Laplace(0, 1)"
    else:
        values, where = rng.standard_t(3, size=rows * cols), "Student t, 3 degrees of freedom (heavy tails)"
    values = values.astype(np.float32).reshape(rows, cols)  # [R, C]
    if outliers > 0:
        mask = rng.random(values.shape) < outliers
        values[mask] *= 20.0
        where += f", {outliers:.2%} of values x20"
    return values, where


def int8_rows(x: np.ndarray, group: int) -> np.ndarray:
    """Symmetric int8 with one float32 absmax scale per `group` values of a row (group = C: per row)."""
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // group, group)  # [R, G, g]
    scale = np.abs(blocks).max(axis=2, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    return (np.clip(np.round(blocks / scale), -127, 127) * scale).reshape(rows, cols)


def relative_rms(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.sqrt(np.mean((x - y) ** 2)) / max(np.sqrt(np.mean(x ** 2)), 1e-30))


def run(params, progress, cancel, lab) -> LabResult:
    rows, cols = params["rows"], params["cols"]
    progress(0.1, "sampling the tensor")
    x, where = sample(params["distribution"], rows, cols, params["outlier_fraction"], params["seed"], lab)
    cancel.check()
    progress(0.3, "MXFP4 quantize + dequantize")
    packed, scales = quantize_mxfp4(x)  # untimed: a warm-up pass
    times = []
    for _ in range(MIN_REPEATS):
        started = time.perf_counter()
        quantize_mxfp4(x)
        times.append(time.perf_counter() - started)
    quantize_s = statistics.median(times)
    mx = dequantize_mxfp4(packed, scales)
    cancel.check()
    progress(0.6, "bf16 and int8")
    formats = {
        "bf16": (round_to_bf16(x), 16.0),
        "int8 per row": (int8_rows(x, cols), 8.0 + 32.0 / cols),
        "int8 per 32": (int8_rows(x, GROUP_SIZE), 8.0 + 32.0 / GROUP_SIZE),
        "MXFP4": (mx, 8.0 * (packed.nbytes + scales.nbytes) / x.size),
    }
    errors = {name: relative_rms(x, q) for name, (q, _) in formats.items()}
    bits = {name: b for name, (_, b) in formats.items()}
    cancel.check()
    progress(0.8, "error by magnitude")
    # error as a function of |x| relative to its group's max: MXFP4's grid is coarse near each group's top
    magnitude = np.abs(x).reshape(rows, -1, GROUP_SIZE)
    share = (magnitude / np.maximum(magnitude.max(axis=2, keepdims=True), 1e-30)).ravel()
    bins = np.linspace(0, 1, 11)
    which = np.clip(np.digitize(share, bins) - 1, 0, 9)
    by_bin = {}
    for name in ("MXFP4", "int8 per row"):
        err = np.abs((formats[name][0] - x)).ravel() / np.maximum(np.abs(x).ravel(), 1e-30)
        by_bin[name] = [float(np.median(err[which == b])) if np.any(which == b) else None for b in range(10)]
    centers = [round(float(c), 2) for c in (bins[:-1] + bins[1:]) / 2]
    names = list(formats)
    figures = [
        Figure("Relative RMS error by format", "bar", True, f"{rows}x{cols} values of {where}, on this machine",
               [{"name": "relative RMS error", "x": names, "y": [errors[n] for n in names]}],
               y_label="||x-q|| / ||x|| (ratio)"),
        Figure("Bits per value (scales included)", "bar", True, f"{rows}x{cols} tensor, bytes as encoded",
               [{"name": "bits/value", "x": names, "y": [bits[n] for n in names]}], y_label="storage per value (bits)"),
        Figure("Median relative error vs |x| / group max", "line", True,
               "MXFP4 groups of 32 vs one int8 scale per row", [{"name": n, "x": centers, "y": by_bin[n]}
                                                               for n in by_bin],
               x_label="|x| / max |x| of its group of 32 (ratio)", y_label="median |x-q| / |x| (ratio)", log_y=True),
    ]
    metrics = {"relative_rms_error": errors["MXFP4"], "bits_per_value": bits["MXFP4"],
               "bytes": float(packed.nbytes + scales.nbytes), "quantize_ms": 1e3 * quantize_s}
    baseline = {"relative_rms_error": errors["int8 per row"], "bits_per_value": bits["int8 per row"],
                "bytes": float(x.size + 4 * rows), "quantize_ms": float("nan")}
    labels = {"relative_rms_error": "relative RMS error ||x-q||/||x||", "bits_per_value": "bits per value",
              "bytes": "bytes of the tensor", "quantize_ms": f"quantize time (ms, median of {MIN_REPEATS} after a warm-up)"}
    progress(1.0, "done")
    # the size is what MXFP4 is for; the flip is the error budget it cannot meet
    verdict = judge("MXFP4", "int8 with one scale per row", "bits_per_value", "bits per value",
                    bits["MXFP4"], bits["int8 per row"], higher_is_better=False, words=("fewer", "more"),
                    flips_when=f"it loses wherever the error budget is below its relative RMS error of "
                               f"{errors['MXFP4']:.3g}: int8 per row holds {errors['int8 per row']:.3g} at "
                               f"{bits['int8 per row']:.2f} bits")
    return LabResult(metrics, baseline, figures, labels, baseline_name="int8, one scale per row", verdict=verdict,
                     metrics_name="MXFP4 (E2M1 + E8M0 scale per 32)",
                     notes=[f"bf16 error {errors['bf16']:.2e} at 16 bits; int8 per 32 values {errors['int8 per 32']:.2e} "
                            f"at {bits['int8 per 32']:.1f} bits; MXFP4 {errors['MXFP4']:.2e} at "
                            f"{bits['MXFP4']:.2f} bits."])


def check(params) -> None:
    if params["cols"] % GROUP_SIZE:
        raise LabParamError("cols", f"must be a multiple of the MXFP4 group size {GROUP_SIZE}, got {params['cols']}")


MODULE = LabModule(
    id="mxfp4", number=2, title="MXFP4: four bits per weight",
    summary="Quantize a tensor to MXFP4 and compare its error and size with bf16 and int8.",
    explanation=(
        "MXFP4 stores each value as a 4-bit E2M1 float (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) and "
        "each group of 32 values shares one 8-bit power-of-two scale: x ~ 2^(s-127) x e2m1, with s chosen so the "
        "group's largest magnitude lands at the top of the grid, s = floor(log2 max|x|) - 2 + 127. That is 4.25 "
        "bits per value, 3.8x smaller than bf16. The error is relative to each group's largest value, so small "
        "groups stay accurate where a per-row int8 scale would crush them; an outlier only hurts its own group."),
    params=(Param("distribution", "choice", "gaussian", "what to quantize", choices=DISTRIBUTIONS),
            Param("rows", "int", 256, "rows of the tensor", min=1, max=4096),
            Param("cols", "int", 1024, "columns (a multiple of 32)", min=32, max=16384),
            Param("outlier_fraction", "float", 0.0, "share of values multiplied by 20", min=0.0, max=0.2),
            Param("seed", "int", 0, "random seed", min=0, max=2**31 - 1)),
    kind="measured", run=run, check=check)
