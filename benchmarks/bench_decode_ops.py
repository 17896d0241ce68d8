"""Where a K3 decode step goes, op by op, in k3serve and in llama.cpp on the same weights: milliseconds and bytes
per token per op, and each op's bandwidth against a STREAM triad (issue 33's "profile of what remains").

    python benchmarks/bench_decode_ops.py [--steps 200] [--rounds 3] [--threads 2] [--engines k3serve,llama.cpp]
        [--target k3 | --target qwen3_moe --precision int8 [--k3serve-source checkpoint | gguf]]
        [--sdist /tmp/llama_sdist/llama_cpp_python-0.3.36.tar.gz]

--engines k3serve runs k3serve's side alone (no llama.cpp build, GGUF or perf). --k3serve-variants alternates
several k3serve settings round by round, each a label and the variables set for its child, e.g. the wait policies:
"default;passive:K3SERVE_CORE_KEEPERS=0;active:K3SERVE_WAIT_POLICY=active" (one table per setting). --load-job 2
runs bench_peers.py's other 2-thread job throughout, for the loaded machine.

--target k3 (default): the widened trained K3 of bench_peers.py (1.5 GB, MXFP4 experts, bf16 trunk; built once)
and its GGUF from llama.cpp's own converter. --target qwen3_moe (or another family): the family's real-width
fixture of bench_peers.py (Qwen3-30B-A3B's widths, 4 of its 48 layers) at --precision bf16 / int8 / mxfp4 against
BF16 / Q8_0 / MXFP4_MOE, k3serve's trunk matching the file's as bench_peers.py's `--k3serve-trunk match` does
(Q8_0 against Q8_0 and MXFP4_MOE), or with --k3serve-source gguf the very GGUF llama.cpp loads, at the types it
stores; every expert resident. Each engine in a fresh process at its own defaults
(`host.defaults_environment`), 2 threads, the processes alternated round by round; medians.

- k3serve: the model's kernel entry points are wrapped with a wall clock (routed experts, each module's `linear`,
  the MLA and KDA cores); "the rest" is the step less the timed ops (Python, norms, routing, the residual
  stack, small numpy calls). The wrappers cost about a microsecond per call (~100 calls a step). Bytes per op: the
  weight bytes each call reads (a routed expert's MXFP4 bytes and scales; a trunk matrix as held).
- llama.cpp: `perf record` (cpu-clock, 1999 Hz, both threads) started and stopped through its control fifo
  around the timed decode only, samples grouped by symbol into the same ops (`ggml_vec_dot_mxfp4_q8_0`: routed
  experts; `ggml_vec_dot_bf16` and the bf16 conversions: trunk matmuls; the activation quantizers; attention;
  the thread pool's barrier and spin). A family's file multiplies its experts, trunk and lm_head with one dot per
  format (`ggml_vec_dot_q8_0_q8_0` for all three in a Q8_0 file), so its ops are grouped by format, not by role:
  compare their sum with k3serve's matmul rows. An op's ms per token is its share of the samples times the
  decode's wall time per token (every ggml op runs on all threads between barriers, so a CPU share is a wall
  share). Needs
  `perf` (linux-perf); without it that side is skipped and said so.

Prints the machine, one table per engine, and a JSON record on the last line (--out also writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# The k3serve children: a head (the timers and the wrapper), the model's own part (load, what to wrap), a tail (the
# timed decode and its JSON line, "the rest" named by REST).
CHILD_HEAD = r"""
import k3serve  # before numpy, as the CLI runs: numpy first leaves OpenBLAS's workers spinning (k3serve/__init__.py)
import json, sys, time
import numpy as np
spec = json.loads(sys.argv[1])
from k3serve.loading import load_model
from k3serve.model.interface import ForwardItem

timers = {}
bytes_read = {}

def weight_bytes(w):
    if isinstance(w, np.ndarray):
        return w.nbytes
    return sum(getattr(w, name).nbytes for name in ("data", "scales") if getattr(w, name, None) is not None)

def wrap(module, name, op, count_bytes):
    inner = getattr(module, name)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        out = inner(*args, **kwargs)
        timers[op] = timers.get(op, 0.0) + time.perf_counter() - started
        bytes_read[op] = bytes_read.get(op, 0) + count_bytes(args)
        return out
    setattr(module, name, timed)
"""

CHILD_TAIL = r"""
rng = np.random.default_rng(0)
prompt = rng.integers(3, model.config.vocab_size - 8, 64)
cache = model.new_cache()
token = int(np.argmax(model.forward([ForwardItem(prompt, cache)]).logits[0][-1]))
for _ in range(8):
    token = int(np.argmax(model.forward([ForwardItem(np.array([token]), cache)]).logits[0][-1]))
timers.clear(); bytes_read.clear()
started = time.perf_counter()
for _ in range(spec["steps"]):
    token = int(np.argmax(model.forward([ForwardItem(np.array([token]), cache)]).logits[0][-1]))
wall = (time.perf_counter() - started) / spec["steps"]
ops = {op: {"ms": t / spec["steps"] * 1e3, "bytes": bytes_read[op] // spec["steps"]} for op, t in timers.items()}
ops[REST] = {"ms": wall * 1e3 - sum(o["ms"] for o in ops.values()), "bytes": 0}
print(json.dumps({"wall_ms": wall * 1e3, "ops": ops}))
"""

K3SERVE_CHILD = CHILD_HEAD + r"""
from k3serve.model import k3 as k3_module, kda, mla, moe

model = load_model(spec["checkpoint"]).model

def expert_bytes(args):
    stacked, ids = args[0], args[1]
    return sum(int(a[0].nbytes) for a in stacked) * len(ids)

wrap(moe, "mxfp4_experts_accumulate_stacked", "routed experts (MXFP4)", expert_bytes)
wrap(moe, "linear", "MoE trunk matmuls (latent down/up, shared expert)", lambda a: weight_bytes(a[1]))
wrap(kda, "linear", "KDA projections", lambda a: weight_bytes(a[1]))
wrap(mla, "linear", "MLA projections", lambda a: weight_bytes(a[1]))
wrap(k3_module, "linear", "lm_head and dense MLP", lambda a: weight_bytes(a[1]))
REST = "the rest (Python, norms, routing, attention cores, residual stack)"
""" + CHILD_TAIL

FAMILY_CHILD = CHILD_HEAD + r"""
from k3serve.model.families import attention, decoder, delta, experts, latent_attention, moe
from k3serve.model.families.moe import MoEBlock

model = load_model(spec.get("model", spec["checkpoint"]), expert_precision=spec.get("expert_precision",
                                                                                  spec["precision"]),
                   trunk_precision=spec["trunk_precision"]).model
for layer in model.layers:  # resident, as llama.cpp's: every expert packed first
    if isinstance(layer.mlp, MoEBlock):
        for expert in range(layer.mlp.router.weight.shape[0]):
            layer.mlp.experts.get(layer.mlp.layer, expert)

def expert_bytes(args):
    stacked, pairs = args[1], args[2]
    return sum(int(a[0].nbytes) for a in stacked if a is not None) * len(pairs.expert_ids)

wrap(experts, "run_experts", f"routed experts ({spec.get('expert_precision', spec['precision'])})", expert_bytes)
PROJECTIONS = f"attention projections ({spec['trunk_precision']} trunk)"
CORE = "attention core (over the cache; a delta rule's recurrence)"
for module in (attention, latent_attention, delta):  # GQA, MLA, KDA / Gated DeltaNet
    wrap(module, "linear", PROJECTIONS, lambda a: weight_bytes(a[1]))
wrap(attention, "causal_attention", CORE, lambda a: 0)
wrap(latent_attention, "causal_attention", CORE, lambda a: 0)
wrap(delta, "run_delta_rule", CORE, lambda a: 0)
# float32 per head (BLAS), or a GGUF's Q8_0 attn_k_b / attn_v_b (q8_0_heads_matmul)
wrap(latent_attention, "absorb_heads", "MLA W_uk / W_uv (per head)", lambda a: weight_bytes(a[1]))
wrap(latent_attention, "heads_values", "MLA W_uk / W_uv (per head)", lambda a: weight_bytes(a[1]))
wrap(moe, "linear", "dense and shared MLPs", lambda a: weight_bytes(a[1]))
wrap(decoder, "linear", "lm_head", lambda a: weight_bytes(a[1]))
REST = "the rest (Python, norms, routing, rope, residual adds)"
""" + CHILD_TAIL

LLAMA_CHILD = r"""
import json, os, sys, time
import numpy as np
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["benchmarks"])
from bench_peers import _LlamaCppShapes
engine = _LlamaCppShapes({"gguf": spec["gguf"], "batches": [1], "prompt_lens": [64], "decode_context": 64,
                          "decode_steps": spec["steps"], "threads": spec["threads"]})
rng = np.random.default_rng(0)
first = engine.prefill([rng.integers(3, spec["vocab"] - 8, 64).tolist()])
engine.decode([[first[0]]], 8)
control = spec.get("control")
if control:
    with open(control, "w") as f:
        f.write("enable\n")
started = time.perf_counter()
engine.decode([[first[0]]], spec["steps"])
wall = (time.perf_counter() - started) / spec["steps"]
if control:
    with open(control, "w") as f:
        f.write("disable\n")
print(json.dumps({"wall_ms": wall * 1e3}))
"""

# llama.cpp's symbols -> the ops of the k3serve table (first match wins); the rest is "other"
LLAMA_OPS = [
    ("routed experts (MXFP4)", r"mxfp4"),
    ("trunk matmuls (bf16)", r"vec_dot_bf16|bf16_to_fp32|fp32_to_bf16|gemm_bf16|mul_mat"),
    ("activation quantization (q8_0)", r"quantize_row_q8|quantize_q8"),
    ("attention", r"flash_attn|vec_dot_f16|soft_max|rope"),
    ("thread pool (barrier, spin, wake)", r"barrier|gomp|omp_|futex|sched_yield|do_syscall|entry_SYSCALL|"
                                          r"^0x0000"),
    ("math (exp, tanh, sigmoid, norms)", r"exp|tanh|sigmoid|norm|silu|glu|unary|mul$|add$|forward_mul|"
                                         r"forward_add|forward_scale|ssm|gla|delta"),
]
# a family's file: one dot per weight format, whatever the matrix's role (experts, trunk, lm_head)
LLAMA_FAMILY_OPS = [
    ("matmuls on MXFP4 (the experts of MXFP4_MOE)", r"mxfp4"),
    ("matmuls on Q8_0 (a Q8_0 file's experts, trunk, lm_head; MXFP4_MOE's trunk, lm_head)",
     r"q8_0_q8_0|gemv_q8|gemm_q8"),
    ("matmuls on BF16 (a BF16 file's experts, trunk, lm_head)", r"vec_dot_bf16|bf16_to_fp32|fp32_to_bf16|gemm_bf16"),
    ("activation quantization (q8_0)", r"quantize_row_q8|quantize_q8"),
    ("other matmul code (mul_mat, mul_mat_id)", r"mul_mat"),
    *LLAMA_OPS[3:],
]


def llama_ops(perf_data: Path, wall_ms: float, groups: list[tuple[str, str]] = LLAMA_OPS) -> dict:
    report = subprocess.run(["perf", "report", "-i", str(perf_data), "--no-children", "--sort", "symbol",
                             "-F", "overhead,sym", "--stdio", "-g", "none", "--percent-limit", "0"], capture_output=True, text=True)
    shares: dict[str, float] = {}
    symbols: dict[str, float] = {}
    for line in report.stdout.splitlines():
        match = re.match(r"\s*([\d.]+)%\s+\[[.k]\]\s+(.+?)\s*$", line)
        if not match:
            continue
        share, symbol = float(match.group(1)) / 100, re.sub(r"[\s-]+$", "", match.group(2))
        symbols[symbol] = symbols.get(symbol, 0.0) + share
        op = next((name for name, pattern in groups if re.search(pattern, symbol)), "other")
        shares[op] = shares.get(op, 0.0) + share
    total = sum(shares.values()) or 1.0
    top = sorted(symbols.items(), key=lambda kv: -kv[1])[:12]
    return {"ops": {op: {"share": s / total, "ms": s / total * wall_ms} for op, s in shares.items()},
            "top_symbols": [{"symbol": sym, "share": s / total} for sym, s in top]}


def parse_variants(text: str) -> dict[str, dict[str, str]]:
    """--k3serve-variants "default;passive:K3SERVE_CORE_KEEPERS=0;active:K3SERVE_WAIT_POLICY=active" -> {label:
    the environment variables set for that k3serve child on top of the defaults}."""
    variants: dict[str, dict[str, str]] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        label, _, assignments = item.partition(":")
        env = {}
        for assignment in filter(None, (a.strip() for a in assignments.split(","))):
            name, sep, value = assignment.partition("=")
            if not sep or not name:
                raise ValueError(f"--k3serve-variants: {assignment!r} is not NAME=VALUE")
            env[name] = value
        if label.strip() in variants:
            raise ValueError(f"--k3serve-variants: {label.strip()!r} twice")
        variants[label.strip()] = env
    return variants


def run_k3serve(spec: dict, extra_env: dict[str, str] | None = None) -> dict:
    from k3serve.host import defaults_environment

    child = K3SERVE_CHILD if spec["family"] == "k3" else FAMILY_CHILD
    done = subprocess.run([sys.executable, "-c", child, json.dumps(spec)], capture_output=True, text=True,
                          env={**defaults_environment(spec["threads"]), **(extra_env or {})}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_llama(spec: dict, perf: str | None) -> dict:
    from k3serve.host import defaults_environment

    env = defaults_environment(spec["threads"])
    command = [sys.executable, "-c", LLAMA_CHILD]
    if perf is None:
        done = subprocess.run([*command, json.dumps(spec)], capture_output=True, text=True, env=env, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])
    with tempfile.TemporaryDirectory() as tmp:
        fifo, data = Path(tmp) / "ctl", Path(tmp) / "perf.data"
        os.mkfifo(fifo)
        spec = {**spec, "control": str(fifo)}
        done = subprocess.run([perf, "record", "-e", "cpu-clock", "-F", "1999", "-D", "-1", "--control",
                               f"fifo:{fifo}", "-o", str(data), "--", *command, json.dumps(spec)],
                              capture_output=True, text=True, env=env, check=True)
        out = json.loads(next(line for line in reversed(done.stdout.strip().splitlines()) if line.startswith("{")))
        out.update(llama_ops(data, out["wall_ms"], LLAMA_OPS if spec["family"] == "k3" else LLAMA_FAMILY_OPS))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--inner", type=int, default=16)
    parser.add_argument("--latent", type=int, default=32)
    parser.add_argument("--sdist", type=Path, default=Path("/tmp/llama_sdist/llama_cpp_python-0.3.36.tar.gz"))
    parser.add_argument("--engines", default="k3serve,llama.cpp", help="comma-separated subset of k3serve,llama.cpp")
    parser.add_argument("--target", default="k3", help="k3 (the widened K3) or a family's real-width fixture: "
                                                       "qwen3_moe, kimi_linear, deepseek_v3, qwen3_next")
    parser.add_argument("--precision", default="int8", choices=("bf16", "int8", "mxfp4"),
                        help="a family's k3serve precision (against BF16 / Q8_0 / MXFP4_MOE)")
    parser.add_argument("--k3serve-source", choices=("checkpoint", "gguf"), default="checkpoint",
                        help="a family's k3serve model: the checkpoint with its trunk matching the file's (as "
                             "bench_peers.py --k3serve-trunk match), or gguf: the very GGUF llama.cpp loads "
                             "(as bench_peers.py --k3serve-source gguf)")
    parser.add_argument("--k3serve-variants", default="",
                        help='k3serve settings alternated round by round, "label[:NAME=VALUE,...];...", e.g. '
                             '"default;passive:K3SERVE_CORE_KEEPERS=0;active:K3SERVE_WAIT_POLICY=active" (each '
                             'a fresh process at the defaults plus its variables; default: one, at the defaults)')
    parser.add_argument("--load-job", type=int, default=0, metavar="THREADS",
                        help="run another job on the machine throughout (bench_peers.py's: an OpenBLAS float32 "
                             "matmul loop on THREADS threads), for the loaded-machine figures")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engines = args.engines.split(",")
    if not engines or any(e not in ("k3serve", "llama.cpp") for e in engines):
        parser.error(f"--engines must name k3serve and/or llama.cpp, got {args.engines!r}")
    try:
        variants = parse_variants(args.k3serve_variants) or {"": {}}
    except ValueError as exc:
        parser.error(str(exc))

    from bench_peers import (PAIRS, build_gguf, family_target, llama_cpp_tree, load_job, triad_bandwidth,
                             trunk_precision, widened_checkpoint)
    from k3serve.host import describe_host
    from k3serve.weights.checkpoint import Checkpoint

    spec: dict = {"family": args.target}
    if args.target == "k3":
        checkpoint = widened_checkpoint(args.inner, args.latent)
        gguf = build_gguf(checkpoint, llama_cpp_tree(args.sdist)) if "llama.cpp" in engines else None
    else:  # the GGUFs come with the fixture (llama.cpp's converter and quantizer: needs the sdist's tree)
        target = family_target(args.target, "real", llama_cpp_tree(args.sdist), [args.precision])
        checkpoint, gguf = target.checkpoint, target.ggufs[PAIRS[args.precision]]
        spec.update(precision=args.precision,
                    trunk_precision=trunk_precision(target, PAIRS[args.precision], "match"))
        if args.k3serve_source == "gguf":  # the file's tensors at the types it stores
            spec.update(model=str(gguf), trunk_precision="native", expert_precision="native")
    vocab = Checkpoint(checkpoint).config.vocab_size if args.target == "k3" else target.vocab
    spec.update({"checkpoint": str(checkpoint), "gguf": str(gguf), "steps": args.steps, "threads": args.threads,
                 "vocab": vocab, "benchmarks": str(HERE)})
    perf = shutil.which("perf")
    triad = triad_bandwidth()
    variant_names = {label: f"k3serve[{label}]" if label else "k3serve" for label in variants}
    runs: dict[str, list[dict]] = {}
    for engine in engines:
        runs.update({name: [] for name in variant_names.values()} if engine == "k3serve" else {engine: []})
    job = load_job(args.load_job) if args.load_job else None  # started after the triad: it measures the machine
    try:
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
            if "k3serve" in engines:
                for label, env in variants.items():
                    runs[variant_names[label]].append(run_k3serve(spec, env))
            if "llama.cpp" in runs:
                runs["llama.cpp"].append(run_llama(spec, perf))
    finally:
        if job is not None:
            job.kill()
            job.wait()
    host = describe_host()
    print(host, f"| triad {triad:.1f} GB/s | perf: {perf or 'not found (llama.cpp per-op skipped)'}")
    record: dict = {"benchmark": "decode_ops", "machine": host, "triad_gb_s": triad, "steps": args.steps,
                    "rounds": args.rounds, "threads": args.threads, "target": args.target,
                    "precision": spec.get("precision"), "trunk_precision": spec.get("trunk_precision"),
                    "checkpoint": str(checkpoint), "k3serve_source": args.k3serve_source,
                    "gguf": str(gguf),
                    "k3serve_variants": {variant_names[label]: env for label, env in variants.items()},
                    "load_job": {"threads": args.load_job, "what": "float32 1024x1024 matmul loop, OpenBLAS"}
                    if args.load_job else None, "load_average": list(os.getloadavg()),
                    "engines": {}, "runs": runs}
    for engine, rs in runs.items():
        wall = statistics.median(r["wall_ms"] for r in rs)
        names = sorted({op for r in rs for op in r.get("ops", {})})
        ops = {}
        for op in names:
            ms = statistics.median(r["ops"].get(op, {}).get("ms", 0.0) for r in rs)
            entry = {"ms_per_token": ms, "share": ms / wall}
            if engine.startswith("k3serve"):
                nbytes = statistics.median(r["ops"][op]["bytes"] for r in rs if op in r["ops"])
                entry["bytes_per_token"] = nbytes
                if nbytes and ms > 0:
                    entry["gb_s"] = nbytes / ms / 1e6
                    entry["of_triad"] = entry["gb_s"] / triad
            ops[op] = entry
        record["engines"][engine] = {"wall_ms_per_token": wall, "tok_s": 1e3 / wall, "ops": ops}
        print(f"\n{engine}: decode {wall:.2f} ms/token ({1e3 / wall:.1f} tok/s), medians of {len(rs)}")
        print(f"  {'op':<62} {'ms/token':>9} {'share':>6} {'MB/token':>9} {'GB/s':>6} {'triad':>6}")
        for op, e in sorted(ops.items(), key=lambda kv: -kv[1]["ms_per_token"]):
            mb = f"{e['bytes_per_token'] / 1e6:9.2f}" if e.get("bytes_per_token") else f"{'':>9}"
            gbs = f"{e['gb_s']:6.1f} {e['of_triad']:6.0%}" if "gb_s" in e else f"{'':>13}"
            print(f"  {op:<62} {e['ms_per_token']:9.3f} {e['share']:6.1%} {mb} {gbs}")
        if engine == "llama.cpp" and rs and "top_symbols" in rs[-1]:
            print("  top symbols (last round): " + ", ".join(f"{s['symbol']} {s['share']:.1%}"
                                                         for s in rs[-1]["top_symbols"][:8]))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
