"""Prefill of a Qwen3-MoE at Qwen3-30B-A3B's widths (hidden 2048, 128 experts of 768, top-8, 32/4 heads of 128,
vocabulary 32000), random bf16-exact weights built in memory (no file), resident: where prefill time goes, and the
prefill kernels of issue 33 against the settings before them, in one process.

    --profile    time per op of one prefill (wall and CPU seconds): attention projections, the causal softmax,
                 rope, norms, router, the routed experts, their weighted sum, lm_head (last position only)
    (default)    A/B: "before" = row dot under 32 tokens an expert, BLAS on a float32 copy from 32, MXFP4 experts
                 by the row dot at every size, [256 x 1024] attention tiles; "after" = the defaults of
                 `families.experts` (since 2026-12-06 late: the row dot's 2 x 4 tiles at every count for per-row
                 int8, bf16, float32 and MXFP4 experts, BLAS for bf16 / float32 from 256 tokens, the float tile
                 for block-scaled experts from 4), [128 x 256] tiles. The two alternate on the same model, so load
                 swings hit both alike. "before" is no longer the code it once measured: int8 experts never take
                 BLAS now, and MXFP4 experts always run the row dot.

    --decode-batches 1 8   decode steps instead: B sequences (a --decode-context-token prompt each), one token
                 each per step, timed per op as --profile does (issue 33: a batch-8 step was slower per token than
                 batch 1); with --vocab 151936 (Qwen3-30B-A3B's own) the lm_head is the released one. Runs the code on
                 PYTHONPATH, so base and tip compare in alternated processes.

    --variants after q8-rowdot q8   (with --precision mxfp4) the MXFP4 experts' activations: float32, Q8_0 on the
                 int8 row dot, Q8_0 on the int8 tiles (kernels section "int8 tiles"), alternated in one process;
    --variants after int8-q8        (with --precision int8) the int8 experts on float32 or Q8_0 activations
    --variants after bf16           bf16 weights (trunk, and experts at --precision native) on float32 activations or
                 on activations rounded to bf16 (`K3SERVE_BF16_ACTIVATIONS=bf16`, AVX512_BF16 dot products);
                 --bf16-activations bf16 runs --decode-batches on that path

    python benchmarks/bench_prefill_widths.py [--layers 1] [--tokens 512 2048] [--precision native|int8|mxfp4]
                                              [--rounds 3] [--profile] [--vocab 32000] [--variants before after]
                                              [--bf16-activations f32|bf16]
                                              [--decode-batches 1 8 [--decode-steps 5] [--decode-context 64]]
Builds in about 30 s a layer (2 cores). Prints one line per prompt length, then a JSON record on the last line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
import zlib

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

from k3serve.model.families import attention, decoder, experts as family_experts, moe as family_moe, rope
from k3serve.model.families.hf_config import HFConfig
from k3serve.model.families.loading import family_of
from k3serve.model.families.synthetic import _ROPE, _RandomReader
from k3serve.model.interface import ForwardItem
from k3serve.model import kernels
from k3serve.model.kernels import linear

QWEN3_30B_A3B_WIDTHS = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32,
                        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                        "moe_intermediate_size": 768, "intermediate_size": 6144, "vocab_size": 32000,
                        "norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1, "rms_norm_eps": 1e-6,
                        "max_position_embeddings": 40960, "use_sliding_window": False, "rope_parameters": _ROPE,
                        "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
                        "tie_word_embeddings": False}
_AFTER = dict(dense=family_experts.DENSE_TILE_MIN_TOKENS, blas=family_experts.DENSE_BLAS_MIN_TOKENS, blocks=(128, 256))
# "after" and the next two differ only in the MXFP4 experts' activations: float32 (the default), Q8_0 on the int8
# row dot (one token a pass, before the tiles), Q8_0 on the int8 tiles (`kernels.Q8_TILE_TOKENS`)
# (--precision mxfp4), and "int8-q8" the int8 experts on Q8_0 activations (--precision int8, `int8_experts_q8`)
SETTINGS = {"before": dict(dense=32, blas=32, blocks=(256, 1024), activations="f32", tile=None,
                           int8="f32", bf16="f32"),
            "after": dict(_AFTER, activations="f32", tile=None, int8="f32", bf16="f32"),
            "q8-rowdot": dict(_AFTER, activations="q8", tile=1, int8="f32", bf16="f32"),
            "q8": dict(_AFTER, activations="q8", tile=None, int8="f32", bf16="f32"),
            "int8-q8": dict(_AFTER, activations="f32", tile=None, int8="q8", bf16="f32"),
            "bf16": dict(_AFTER, activations="f32", tile=None, int8="f32", bf16="bf16")}
_DEFAULT_TILE_TOKENS = kernels.Q8_TILE_TOKENS


class _BF16Reader(_RandomReader):
    """Seeded N(0, 0.02^2) matrices (norms 1 + N(0, 0.2^2), routers N(0, 0.24^2)) truncated to bf16, so the trunk
    and the experts load as bf16 bits as from a bf16 checkpoint; expert matrices are not kept once packed."""

    def f32(self, *names: str, shape: tuple[int, ...] | None = None, size: int | None = None) -> np.ndarray:
        name = names[0]
        if name in self.tensors:
            return self.tensors[name].copy()
        shape = shape if shape is not None else (int(size),)
        values = np.random.default_rng([self.seed, zlib.crc32(name.encode())]).standard_normal(shape, np.float32)
        if name.endswith("norm.weight") or "layernorm" in name:
            values = 1.0 + np.float32(0.2) * values
        elif name.endswith("gate.weight") and len(shape) == 2 and shape[0] > 1:
            values *= np.float32(0.24)
        else:
            values *= np.float32(0.02)
        values = (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        if ".experts." not in name:
            self.tensors[name] = values
        return values.copy()


def build_model(layers: int, precision: str):
    hf = HFConfig({**QWEN3_30B_A3B_WIDTHS, "num_hidden_layers": layers}, "qwen3_moe", "<in memory>")
    spec = family_of(hf)
    model = spec.build(spec.parse(hf.with_family(spec.name)), _BF16Reader("qwen3_moe", 0), precision, 64)
    for layer in model.layers:
        for expert in range(QWEN3_30B_A3B_WIDTHS["num_experts"]):
            model.experts.get(layer.mlp.layer, expert)
    return model


def use(model, name: str) -> None:
    s = SETTINGS[name]
    family_experts.DENSE_TILE_MIN_TOKENS = s["dense"]  # block-scaled experts only since the row dot took the rest
    family_experts.DENSE_BLAS_MIN_TOKENS = s["blas"]
    kernels.MXFP4_ACTIVATIONS = s["activations"]  # read at each expert call
    kernels.Q8_TILE_TOKENS = _DEFAULT_TILE_TOKENS if s["tile"] is None else s["tile"]
    kernels.INT8_ACTIVATIONS = s["int8"]
    kernels.BF16_ACTIVATIONS = s["bf16"]
    for layer in model.layers:
        layer.mixer.query_block, layer.mixer.key_block = s["blocks"]


def profile(model, ids: np.ndarray, steps=None) -> dict[str, tuple[float, float, int]]:
    """label -> (wall s, CPU s, calls) of one prefill (or of the forwards `steps()` makes, "total" their sum), each
    op wrapped in a timer (nested ops are also counted in their parent's line)."""
    spent = collections.defaultdict(lambda: [0.0, 0.0, 0])

    def timed(label, fn):
        def wrapper(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = spent[label]
                entry[0] += time.perf_counter() - wall
                entry[1] += time.process_time() - cpu
                entry[2] += 1
        return wrapper

    patches = [(attention.GQAAttention, "_attend", "attention: causal softmax (tiles)"),
               (attention, "linear", "attention: qkv and o projections"),
               (attention, "rms_norm", "attention: q/k head norms"),
               (rope.Rotary, "apply", "attention: rope"),
               (decoder, "linear", "lm_head (last position)"),
               (decoder, "rms_norm", "layer and final norms"),
               (family_moe.SoftmaxRouter, "__call__", "router"),
               (family_experts.ExpertStore, "expert_outputs", "routed experts (gate_up, down)"),
               (family_moe, "accumulate_expert_rows", "routed experts: weighted sum"),
               (family_moe, "pairs_by_expert", "routing: group tokens by expert")]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    for owner, attr, label in patches:
        setattr(owner, attr, timed(label, getattr(owner, attr)))
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        if steps is None:
            model.forward([ForwardItem(ids, model.new_cache())])
            calls = 1
        else:
            calls = steps()
        spent["total prefill" if steps is None else "total"] = [time.perf_counter() - wall,
                                                               time.process_time() - cpu, calls]
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    return {label: tuple(v) for label, v in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--precision", default="native", choices=["native", "int8", "mxfp4"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="time per op of each variant but 'before'")
    parser.add_argument("--variants", nargs="+", default=["before", "after"], choices=list(SETTINGS),
                        help="alternated in each round; speedups and logit drift against the first (the MXFP4 int8 "
                             "A/B: --precision mxfp4 --variants after q8-rowdot q8)")
    parser.add_argument("--vocab", type=int, default=QWEN3_30B_A3B_WIDTHS["vocab_size"])
    parser.add_argument("--bf16-activations", choices=("f32", "bf16"), default="f32",
                        help="the activations of bf16 weights under --decode-batches")
    parser.add_argument("--decode-batches", type=int, nargs="*", default=[])
    parser.add_argument("--decode-steps", type=int, default=5)
    parser.add_argument("--decode-context", type=int, default=64)
    args = parser.parse_args()
    QWEN3_30B_A3B_WIDTHS["vocab_size"] = args.vocab
    assert linear is not None  # the kernels module (and its OpenMP wait setting) loads before the model
    start = time.perf_counter()
    model = build_model(args.layers, args.precision)
    print(f"built {args.layers} layer(s) at {args.precision} in {time.perf_counter() - start:.0f} s; routed experts "
          f"{model.experts.nbytes / 2**30:.2f} GiB", flush=True)
    rng = np.random.default_rng(1)
    if args.bf16_activations == "bf16" and not kernels.BF16_DOT_AVAILABLE:
        raise SystemExit("--bf16-activations bf16: this CPU lacks AVX512_BF16")
    if args.decode_batches:
        kernels.BF16_ACTIVATIONS = args.bf16_activations
        decode(model, args, rng)
        return
    record = {"precision": args.precision, "layers": args.layers, "threads": os.environ.get("NUMBA_NUM_THREADS"),
              "load_before": os.getloadavg()[0], "prompts": {}}
    for T in args.tokens:
        ids = rng.integers(3, QWEN3_30B_A3B_WIDTHS["vocab_size"], size=T)
        logits = {}
        for name in args.variants:  # compiles and warms every path
            use(model, name)
            logits[name] = np.asarray(model.forward([ForwardItem(ids, model.new_cache())]).logits[0]).ravel()
        if args.profile:
            for name in [v for v in args.variants if v != "before"]:
                use(model, name)
                table = profile(model, ids)
                total_wall = table["total prefill"][0]
                print(f"T={T} per op ({name}): wall ms, CPU ms, share of the wall, calls")
                for label, (wall, cpu, calls) in sorted(table.items(), key=lambda kv: -kv[1][0]):
                    print(f"  {label:36s} {wall * 1e3:9.1f} {cpu * 1e3:9.1f} {100 * wall / total_wall:6.1f}% "
                          f"{calls:4d}")
                record["prompts"].setdefault(T, {})[f"profile {name}"] = table
            continue
        rounds: dict[str, list[float]] = {name: [] for name in args.variants}
        cpu_rounds: dict[str, list[float]] = {name: [] for name in args.variants}  # CPU s: less swayed by others
        for _ in range(args.rounds):
            for name in args.variants:
                use(model, name)
                wall, cpu = time.perf_counter(), time.process_time()
                model.forward([ForwardItem(ids, model.new_cache())])
                rounds[name].append(time.perf_counter() - wall)
                cpu_rounds[name].append(time.process_time() - cpu)
        base = args.variants[0]
        entry = {"rounds_s": rounds, "cpu_s": cpu_rounds}
        for name in args.variants[1:]:
            ratios = [b / a for b, a in zip(rounds[base], rounds[name])]
            cpu_ratios = [b / a for b, a in zip(cpu_rounds[base], cpu_rounds[name])]
            before, after = logits[base], logits[name]
            drift = float(np.sqrt(np.mean((before - after) ** 2) / np.mean(before ** 2)))
            same = int(np.argmax(before)) == int(np.argmax(after))
            print(f"T={T} {args.precision}: {base} {T / statistics.median(rounds[base]):.1f} tok/s, {name} "
                  f"{T / statistics.median(rounds[name]):.1f} tok/s; per-round speedups "
                  f"{[round(r, 2) for r in ratios]}, median {statistics.median(ratios):.2f}x (CPU time "
                  f"{[round(r, 2) for r in cpu_ratios]}, median {statistics.median(cpu_ratios):.2f}x); last-position "
                  f"logits relative RMS difference {drift:.1e}, same argmax {same}; load {os.getloadavg()[0]:.1f}",
                  flush=True)
            entry[name] = {"speedups": ratios, "cpu_speedups": cpu_ratios, "logit_drift": drift,
                           "same_argmax": same}
        record["prompts"][T] = entry
    print(json.dumps(record))


def decode(model, args, rng: np.random.Generator) -> None:
    """Per op of --decode-steps steps at each batch size (after one untimed step), then one line and a JSON
    record: ms per step, tok/s and the per-op table."""
    record = {"precision": args.precision, "layers": args.layers, "vocab": args.vocab,
              "bf16_activations": kernels.BF16_ACTIVATIONS, "threads": os.environ.get("NUMBA_NUM_THREADS"),
              "load_before": os.getloadavg()[0], "batches": {}}
    for B in args.decode_batches:
        caches = [model.new_cache() for _ in range(B)]
        model.forward([ForwardItem(rng.integers(3, args.vocab, size=args.decode_context), c) for c in caches])
        last = [np.array([int(rng.integers(3, args.vocab))]) for _ in range(B)]

        def steps(count: int = args.decode_steps) -> int:
            for _ in range(count):
                model.forward([ForwardItem(ids, cache) for ids, cache in zip(last, caches)])
            return count

        steps(1)  # compiled, warm
        table = profile(model, None, steps)
        step_ms = 1e3 * table["total"][0] / args.decode_steps
        print(f"decode batch {B}: {step_ms:.1f} ms a step, {1e3 * B / step_ms:.1f} tok/s (per op, ms a step: wall, "
              f"CPU, calls)")
        for label, (wall, cpu, calls) in sorted(table.items(), key=lambda kv: -kv[1][0]):
            print(f"  {label:36s} {wall * 1e3 / args.decode_steps:9.2f} {cpu * 1e3 / args.decode_steps:9.2f} "
                  f"{calls / args.decode_steps:5.1f}")
        record["batches"][B] = {"step_ms": step_ms, "tok_s": 1e3 * B / step_ms, "profile": table}
    record["load_after"] = os.getloadavg()[0]
    print(json.dumps(record))


if __name__ == "__main__":
    main()
