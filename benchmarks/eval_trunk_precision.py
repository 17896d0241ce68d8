"""Quality of a quantized trunk (`k3serve pack --trunk-precision`): what Q8_0 and MXFP4 trunk matrices cost.

1. The embedded trained model, packed at bf16, q8_0 and mxfp4: held-out loss (nats per token) on code and prose
   windows of the training corpus's held-out split (k3serve.training.corpus), logits' relative RMS error against
   the bf16 store on those windows, greedy agreement (the share of 32 greedy tokens equal to bf16's, from the
   start of each window), and eval_copy's probe (share of each held-out function reproduced before the first
   mistake).
2. The families' random tiny checkpoints (benchmarks/family_fixture.py: the configurations the tests build):
   their trunk matrices (attention projections, dense / shared MLPs, lm_head; not the embedding) quantized in place
   to Q8_0 / MXFP4 and multiplied by the same kernels; logits' relative RMS error and argmax agreement against the
   model as loaded (bf16 values).

A 6.9M-parameter model's loss delta bounds nothing for the 2.78T model: these figures say the kernels and the
packing are right and how the two formats compare, not what the full K3 loses.

    .venv/bin/python benchmarks/eval_trunk_precision.py [--windows 12] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.default_model import default_model_dir
from k3serve.loading import load_model
from k3serve.stream.options import StreamOptions
from k3serve.training.corpus import build_corpus, copy_probe
from k3serve.weights.pack import pack_checkpoint
from k3serve.weights.quantized import QuantizedMatrix

PRECISIONS = ("bf16", "q8_0", "mxfp4")
WINDOW = 128
GREEDY = 32
FAMILY_MATRICES = ("in_proj", "o_proj", "q_b", "qkv", "out_proj", "gate_up", "down", "shared_gate_up", "shared_down")


def _relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got.astype(np.float64) - want) ** 2) / np.mean(want.astype(np.float64) ** 2)))


def _nll(logits: np.ndarray, ids: np.ndarray) -> float:
    """Mean next-token negative log-likelihood, nats: logits [T, V] predict ids[1:]."""
    z = logits[:-1].astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(ids) - 1), ids[1:]].mean())


def _windows(tokenizer, documents: list[str], count: int) -> list[np.ndarray]:
    out = []
    for doc in documents:
        ids = [tokenizer.bos_id] + tokenizer.encode(doc)
        for start in range(0, len(ids) - WINDOW + 1, WINDOW):
            out.append(np.asarray(ids[start:start + WINDOW], np.int64))
            if len(out) == count:
                return out
    return out


def embedded_rows(num_windows: int, num_copies: int) -> list[dict]:
    corpus = build_corpus()
    folder = Path(tempfile.mkdtemp(prefix="trunk-precision-"))
    stores = {p: pack_checkpoint(default_model_dir(), folder / p, trunk_precision=p) for p in PRECISIONS}
    models = {p: load_model(stores[p].path, stream=StreamOptions(trunk_dtype="bf16")) for p in PRECISIONS}
    tokenizer = models["bf16"].tokenizer
    windows = {"code": _windows(tokenizer, corpus.heldout_code, num_windows),
               "prose": _windows(tokenizer, corpus.heldout_prose, num_windows)}
    reference = {kind: [models["bf16"].model.logits(w) for w in ws] for kind, ws in windows.items()}
    greedy_reference = [models["bf16"].model.greedy(w[:32], GREEDY) for w in windows["code"] + windows["prose"]]
    probe = copy_probe(corpus.heldout_code, num_copies)
    rows = []
    for precision in PRECISIONS:
        model = models[precision].model
        row: dict = {"precision": precision, "trunk_file_bytes": stores[precision].trunk_path.stat().st_size}
        errors = []
        for kind, ws in windows.items():
            logits = [model.logits(w) for w in ws]
            row[f"{kind}_loss"] = float(np.mean([_nll(z, w) for z, w in zip(logits, ws)]))
            errors += [_relative_rms(z, r) for z, r in zip(logits, reference[kind])]
        row["logit_rel_rms"] = float(np.mean(errors))
        same = [sum(a == b for a, b in zip(model.greedy(w[:32], GREEDY), want)) / GREEDY
                for w, want in zip(windows["code"] + windows["prose"], greedy_reference)]
        row["greedy_agreement"] = float(np.mean(same))
        shares = []
        for prompt, rest in probe:
            want = tokenizer.encode(rest)
            got = model.greedy([tokenizer.bos_id] + tokenizer.encode(prompt), len(want))
            shares.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want)) / len(want))
        row["copy_prefix_share"] = float(np.mean(shares))
        rows.append(row)
    for loaded in models.values():
        loaded.model.source.close()
    return rows


def quantize_trunk_in_place(model, precision: str) -> int:
    """Replace a family model's trunk matrices by `QuantizedMatrix` (what `kernels.linear` multiplies from bytes);
    returns how many. Matrices whose rows are not whole 32-blocks stay as they are."""
    count = 0

    def visit(obj, depth: int) -> None:
        nonlocal count
        if depth > 3 or not hasattr(obj, "__dict__"):
            return
        for name, value in list(vars(obj).items()):
            if name in FAMILY_MATRICES and isinstance(value, np.ndarray) and value.ndim == 2 and \
                    value.shape[1] % 32 == 0:
                values = (value.astype(np.uint32) << 16).view(np.float32) if value.dtype == np.uint16 else value
                object.__setattr__(obj, name, QuantizedMatrix.quantize(values, precision))
                count += 1
            elif not isinstance(value, (np.ndarray, int, float, str, bool, type(None))):
                visit(value, depth + 1)

    for layer in model.layers:
        visit(layer, 0)
    head = model.lm_head
    if isinstance(head, np.ndarray) and head.shape[1] % 32 == 0:
        model.lm_head = QuantizedMatrix.quantize(
            (head.astype(np.uint32) << 16).view(np.float32) if head.dtype == np.uint16 else head, precision)
        count += 1
    return count


def dequantize_in_place(model) -> None:
    """Every `QuantizedMatrix` of a model back to its float32 values (weights quantized, activations float)."""
    def visit(obj, depth: int) -> None:
        if depth > 3 or not hasattr(obj, "__dict__"):
            return
        for name, value in list(vars(obj).items()):
            if isinstance(value, QuantizedMatrix):
                object.__setattr__(obj, name, value.dequantize())
            elif not isinstance(value, (np.ndarray, int, float, str, bool, type(None))):
                visit(value, depth + 1)

    for layer in model.layers:
        visit(layer, 0)
    if isinstance(model.lm_head, QuantizedMatrix):
        model.lm_head = model.lm_head.dequantize()


def family_rows() -> list[dict]:
    from family_fixture import family_model_dir

    from k3serve.model.families.synthetic import SYNTHETIC_FAMILIES

    rng = np.random.default_rng(0)
    rows = []
    for family in SYNTHETIC_FAMILIES:
        folder = family_model_dir(family)
        reference_model = load_model(folder).model
        ids = rng.integers(0, reference_model.config.vocab_size, 48)
        reference = reference_model.logits(ids)
        for precision in ("q8_0", "mxfp4"):
            model = load_model(folder).model
            count = quantize_trunk_in_place(model, precision)
            logits = model.logits(ids)
            dequantize_in_place(model)  # the same weights with float32 activations and BLAS
            weights_only = model.logits(ids)
            rows.append({"family": family, "precision": precision, "matrices": count,
                         "logit_rel_rms": _relative_rms(logits, reference),
                         "argmax_agreement": float(np.mean(logits.argmax(-1) == reference.argmax(-1))),
                         "weights_only_rel_rms": _relative_rms(weights_only, reference)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=12, help="held-out windows of 128 tokens per kind")
    parser.add_argument("--copies", type=int, default=12, help="eval_copy probes")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    start = time.time()
    embedded = embedded_rows(args.windows, args.copies)
    families = family_rows()
    base = embedded[0]
    print(f"{'trunk':>6} {'trunk file':>11} {'code loss':>10} {'prose loss':>11} {'logit rRMS':>11} {'greedy':>7} "
          f"{'copy':>6}")
    for row in embedded:
        print(f"{row['precision']:>6} {row['trunk_file_bytes']:>11} {row['code_loss']:>10.4f} "
              f"{row['prose_loss']:>11.4f} {row['logit_rel_rms']:>11.4f} {row['greedy_agreement']:>7.3f} "
              f"{row['copy_prefix_share']:>6.3f}")
    for row in families:
        print(f"{row['family']:>12} {row['precision']:>6}: {row['matrices']} matrices, logits rRMS "
              f"{row['logit_rel_rms']:.4f}, argmax agreement {row['argmax_agreement']:.3f} (weights quantized, float "
              f"activations: rRMS {row['weights_only_rel_rms']:.4f})")
    deltas = {r["precision"]: (r["code_loss"] - base["code_loss"], r["prose_loss"] - base["prose_loss"])
              for r in embedded}
    print(f"trunk precision: loss change q8_0 {deltas['q8_0'][0]:+.4f} code / {deltas['q8_0'][1]:+.4f} prose nats, "
          f"mxfp4 {deltas['mxfp4'][0]:+.4f} / {deltas['mxfp4'][1]:+.4f} ({time.time() - start:.0f} s)")
    record = {"embedded": embedded, "families": families, "window_tokens": WINDOW, "windows_per_kind": args.windows}
    print(json.dumps(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
