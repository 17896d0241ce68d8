"""k3serve against llama.cpp on the same K3 weights, with the machine's memory bandwidth as the yardstick.

    pip install -e '.[peers]'          # llama-cpp-python==0.3.36 (compiles ~13 min on 2 cores) and gguf
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llama_sdist   # its converter
    python benchmarks/bench_peers.py [--sdist /tmp/llama_sdist/llama_cpp_python-0.3.36.tar.gz] [--rounds 3]
    python benchmarks/bench_peers.py --memory-limits 768M,1G,1536M --rounds 3 --decode-steps 16   # streaming

What it does, in one run:
1. Memory bandwidth: a STREAM triad a = b + s c in numba over 3 x 128 MiB float32 arrays, every core; the best
   of 5 (STREAM's convention: 12 bytes counted per element).
2. The fixture: the shipped trained K3 with its experts widened 16x in units and 32x in the latent (1.5 GB,
   `k3serve.weights.widen`, the same fixture as bench_stream.py), and the bytes a decoded token must read: the
   trunk as held in RAM, the lm_head, and the top-k routed experts of every MoE layer (MXFP4 bytes + scales).
3. The GGUF: llama.cpp's own converter (`conversion/kimi_k3.py`, from the llama-cpp-python sdist) on a copy of
   the config with the released keys its converter expects; MXFP4 experts are repacked without requantizing,
   the bf16 trunk stays bf16. Our tokenizer is not one llama.cpp knows, so the vocab is written as plain
   placeholder tokens and both engines are fed token ids.
4. Agreement: the logits of one prompt from both engines (relative RMS, top-5 of the last position) and 10
   greedy tokens; with --reference-positions N, each engine against the fp32 oracle (`model/reference.py`) over
   the first N positions, to tell whose numbers depart.
5. Speed, alternated (k3serve, llama.cpp, k3serve, ...; one fresh process per run): prefill of --prompt-len
   tokens, then --decode-steps decode steps at batch 1, and the process's peak RSS. 2 threads each; llama.cpp
   with use_extra_bufts off (its AMX repack crashes on this CPU at the first decode).
With --memory-limits 768M,1G instead: streaming under those cgroup-v1 memory limits (page cache counted; needs
root), alternated and cold (the files' pages evicted with POSIX_FADV_DONTNEED, not the machine's): k3serve from its
packed store (RAM budget half the limit, O_DIRECT, LFU; `bench_stream.py`'s worker) against llama.cpp on the mmap'd
GGUF, decode seconds per token, medians of --rounds.
Prints one summary line and a JSON record on the last line. Figures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

# llama.cpp's own converter (placeholder vocab) and the config keys it reads that our writer leaves out: one copy,
# shared with the lab's peers module
from k3serve.lab.peers import CONFIG_KEYS_FOR_LLAMA_CPP, CONVERT_SCRIPT as CONVERT

HERE = Path(__file__).resolve().parent
WORK = Path(os.environ.get("K3BENCH_DIR", "/tmp/k3bench-trained"))


# ------------------------------------------------------------------------------------------------ bandwidth
def _mxfp4_isa() -> str:
    from k3serve.model.kernels import ISA

    return ISA


def triad_bandwidth(num_elements: int = 32 << 20, repeats: int = 5) -> float:
    """Best-of STREAM triad bandwidth in GB/s (12 bytes per element: read b, read c, write a)."""
    from numba import njit, prange

    @njit(parallel=True, cache=False)
    def triad(a, b, c, s):
        for i in prange(a.shape[0]):
            a[i] = b[i] + s * c[i]

    a = np.zeros(num_elements, np.float32)
    b = np.ones(num_elements, np.float32)
    c = np.full(num_elements, 2.0, np.float32)
    triad(a, b, c, np.float32(3.0))
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        triad(a, b, c, np.float32(3.0))
        best = min(best, time.perf_counter() - started)
    return 12 * num_elements / best / 1e9


# ------------------------------------------------------------------------------------------------ fixture
def widened_checkpoint(inner: int, latent: int) -> Path:
    from k3serve.loading import default_model_dir
    from k3serve.weights.widen import widen_experts

    src = default_model_dir()
    key = hashlib.sha256((Path(src) / "SHA256SUMS").read_bytes()).hexdigest()[:12]
    folder = WORK / f"{key}-x{inner}-x{latent}" / "checkpoint"
    if not (folder / "config.json").exists():
        print(f"widening {src} x{inner} units x{latent} latent (once)...", file=sys.stderr)
        widen_experts(src, folder, inner=inner, latent=latent, progress=True)
    return folder


def bytes_per_token(checkpoint: Path) -> dict[str, int]:
    """Bytes one decode step must read: k3serve's trunk as held (float32), the lm_head, top-k experts."""
    from k3serve.config import K3Config
    from k3serve.weights.checkpoint import Checkpoint

    config: K3Config = Checkpoint(checkpoint).config
    index = Checkpoint(checkpoint).index
    expert_bytes = trunk_f32 = trunk_stored = 0
    for name in index.names():
        info = index.info(name)
        size = int(np.prod(info.shape)) if info.shape else 1
        if ".experts." in name and ".shared_experts." not in name:
            expert_bytes += size  # uint8 packed nibbles and scale bytes
        elif name.endswith("embed_tokens.weight"):
            continue  # one row per token
        else:
            trunk_f32 += 4 * size
            trunk_stored += size * (2 if info.dtype == "BF16" else 4)
    per_expert = expert_bytes // (config.num_experts * len(config.moe_layer_ids))
    routed = per_expert * config.num_experts_per_token * len(config.moe_layer_ids)
    return {"trunk_k3serve": trunk_f32, "trunk_stored": trunk_stored, "routed_experts": routed,
            "k3serve_total": trunk_f32 + routed, "stored_total": trunk_stored + routed}


def llama_cpp_tree(sdist: Path) -> Path:
    """The llama.cpp source tree vendored in the llama-cpp-python sdist (its converter and gguf-py)."""
    root = WORK / "llama_cpp_src"
    tree = root / sdist.name.replace(".tar.gz", "") / "vendor" / "llama.cpp"
    if not (tree / "conversion" / "kimi_k3.py").exists():
        root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as archive:
            archive.extractall(root, filter="data")
    return tree


def build_gguf(checkpoint: Path, tree: Path) -> Path:
    out = checkpoint.parent / "k3-mxfp4-bf16-v2.gguf"
    if out.exists():
        return out
    staged = checkpoint.parent / "llama_cpp_view"  # the same shards, the config with the released keys
    staged.mkdir(exist_ok=True)
    for path in checkpoint.iterdir():
        target = staged / path.name
        if path.name != "config.json" and not target.exists():
            target.symlink_to(path)
    config = json.loads((checkpoint / "config.json").read_text())
    flat = {**config.get("text_config", config), **{k: v for k, v in config.items() if k != "text_config"}}
    flat.update(CONFIG_KEYS_FOR_LLAMA_CPP)
    flat["num_key_value_heads"] = flat["num_attention_heads"]  # MLA: one kv head per query head before absorption
    (staged / "config.json").write_text(json.dumps(flat, indent=1))
    print("converting with llama.cpp's kimi_k3 converter (once)...", file=sys.stderr)
    subprocess.run([sys.executable, "-c", CONVERT, str(tree), str(staged), str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    return out


def reference_logits(checkpoint: Path, prompt: list[int]) -> np.ndarray:
    """Logits [T, V] of the slow fp32 oracle (`k3serve.model.reference`), experts decoded as they are routed."""
    from collections.abc import Mapping

    from k3serve.model.reference import ReferenceModel
    from k3serve.weights.checkpoint import Checkpoint

    stored = Checkpoint(checkpoint)

    class LazyTensors(Mapping):  # read a tensor when the oracle asks for it: 8 of 64 experts per layer, not 1.4 GB
        def __init__(self) -> None:
            self.names, self.cache = set(stored.index.names()), {}

        def __getitem__(self, name: str) -> np.ndarray:
            if name not in self.names:
                raise KeyError(name)
            if name not in self.cache:
                self.cache[name] = stored.read(name)
            return self.cache[name]

        def __iter__(self):
            return iter(self.names)

        def __len__(self) -> int:
            return len(self.names)

    return ReferenceModel(stored.config, LazyTensors()).forward(prompt)


# ------------------------------------------------------------------------------------------------ one run
def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM). Not getrusage's ru_maxrss: Linux carries that across execve,
    so a child would report its parent's peak if that was higher."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def run_k3serve(spec: dict) -> dict:
    from k3serve.loading import load_model
    from k3serve.model.interface import ForwardItem

    model = load_model(spec["checkpoint"]).model
    prompt = np.asarray(spec["prompt"], np.int64)
    warm = model.new_cache()
    model.forward([ForwardItem(prompt[:8], warm)])
    model.forward([ForwardItem(prompt[8:9], warm)])
    cache = model.new_cache()
    started = time.perf_counter()
    result = model.forward([ForwardItem(prompt, cache, all_logits=spec["logits"])])
    prefill_s = time.perf_counter() - started
    logits = result.logits[0]
    token = int(np.argmax(logits[-1]))
    greedy = [token]
    started = time.perf_counter()
    for _ in range(spec["decode_steps"]):
        logits_step = model.forward([ForwardItem(np.array([token]), cache)]).logits[0][-1]
        token = int(np.argmax(logits_step))
        greedy.append(token)
    decode_s = time.perf_counter() - started
    return {"prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": spec["decode_steps"] / decode_s,
            "peak_rss_mib": peak_rss_mib(),
            "greedy": greedy[:10], "logits": logits.tolist() if spec["logits"] else None}


def run_llama_cpp(spec: dict) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = False  # --no-repack: the AMX repack segfaults at the first decode on this CPU
    model = llama_cpp.llama_model_load_from_file(spec["gguf"].encode(), params)
    ctx_params = llama_cpp.llama_context_default_params()
    ctx_params.n_ctx = 1024
    ctx_params.n_batch = ctx_params.n_ubatch = 512
    ctx_params.n_threads = ctx_params.n_threads_batch = spec["threads"]
    ctx = llama_cpp.llama_init_from_model(model, ctx_params)
    vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    memory = llama_cpp.llama_get_memory(ctx)

    def decode(ids: list[int], start: int, all_logits: bool) -> None:
        batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
        for i, token in enumerate(ids):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = all_logits or i == len(ids) - 1
        batch.n_tokens = len(ids)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        llama_cpp.llama_batch_free(batch)

    def last_logits(i: int = -1) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab_size,)).copy()

    prompt = list(spec["prompt"])
    decode(prompt[:8], 0, False)
    decode(prompt[8:9], 8, False)
    llama_cpp.llama_memory_clear(memory, True)
    started = time.perf_counter()
    decode(prompt, 0, spec["logits"])
    prefill_s = time.perf_counter() - started
    logits = np.stack([last_logits(i) for i in range(len(prompt))]) if spec["logits"] else None
    token = int(np.argmax(last_logits()))
    greedy = [token]
    started = time.perf_counter()
    for step in range(spec["decode_steps"]):
        decode([token], len(prompt) + step, False)
        token = int(np.argmax(last_logits()))
        greedy.append(token)
    decode_s = time.perf_counter() - started
    return {"prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": spec["decode_steps"] / decode_s,
            "peak_rss_mib": peak_rss_mib(),
            "greedy": greedy[:10], "logits": logits.tolist() if logits is not None else None}


def child(engine: str, spec: dict, memory_limit: int | None = None) -> dict:
    """One measurement in a fresh process (its own peak RSS); with `memory_limit`, inside a memory cgroup of that
    many bytes that counts page cache (`confined`)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "NUMBA_NUM_THREADS": str(spec["threads"])}
    if engine == "llama.cpp" and spec.get("llama_omp_wait_policy"):
        env["OMP_WAIT_POLICY"] = spec["llama_omp_wait_policy"]
    command = [sys.executable, __file__, "--child", engine, json.dumps(spec)]
    if memory_limit is not None:
        command = confined(command, memory_limit)
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ streaming
CGROUP = Path("/sys/fs/cgroup/memory/k3bench-peers")  # cgroup v1; page cache is charged to the group


def confined(command: list[str], limit: int) -> list[str]:
    """`command` run inside CGROUP with its memory (page cache included) limited to `limit` bytes."""
    try:
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as error:
        raise RuntimeError(f"memory cgroup {CGROUP} not writable ({error}): needs root and cgroup v1") from error
    return ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh", *command]


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (POSIX_FADV_DONTNEED), so a run starts cold without dropping
    the other jobs' caches."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def streaming_comparison(checkpoint: Path, gguf: Path, spec: dict, limits: list[int], rounds: int) -> dict:
    """Under each memory limit, alternated and cold: k3serve streaming from its packed store (RAM budget half the
    limit, O_DIRECT reads, LFU expert cache: `bench_stream.py`'s worker) against llama.cpp on its mmap'd GGUF.
    Decode seconds per token, medians."""
    from k3serve.weights.pack import pack_checkpoint
    from k3serve.weights.store import PackedStore

    store = checkpoint.parent / "packed-natural"
    if not (store / "store.json").exists():
        pack_checkpoint(checkpoint, store)
    packed = PackedStore(store)
    ours = {"store": str(store), "prompts": [spec["prompt"][:24]], "tokens": spec["decode_steps"] + 1}
    theirs = {**spec, "prompt": spec["prompt"][:24], "logits": False}
    out = {}
    for limit in sorted(limits):
        runs: dict[str, list[float]] = {"k3serve": [], "llama.cpp": []}
        options = {"ram_budget": limit // 2, "io": "direct", "cache": "lfu"}
        for _ in range(rounds):
            evict([packed.expert_path, packed.trunk_path])
            command = confined([sys.executable, str(HERE / "bench_stream.py"), "--worker",
                                json.dumps({**ours, "options": options})], limit)
            done = subprocess.run(command, capture_output=True, text=True, check=True,
                                  env={**os.environ, "OMP_NUM_THREADS": str(spec["threads"]),
                                       "NUMBA_NUM_THREADS": str(spec["threads"])})
            runs["k3serve"].append(json.loads(done.stdout.strip().splitlines()[-1])["s_per_token"])
            evict([gguf])
            runs["llama.cpp"].append(1 / child("llama.cpp", theirs, memory_limit=limit)["decode_tok_s"])
        med = {engine: statistics.median(values) for engine, values in runs.items()}
        out[f"{limit >> 20} MiB"] = {"s_per_token": med, "k3serve_speedup": med["llama.cpp"] / med["k3serve"],
                                     "k3serve_options": options, "all_runs": runs}
    return out


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    from k3serve.host import describe_host

    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        spec = json.loads(sys.argv[3])
        print(json.dumps((run_k3serve if sys.argv[2] == "k3serve" else run_llama_cpp)(spec)))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdist", type=Path, default=Path("/tmp/llama_sdist/llama_cpp_python-0.3.36.tar.gz"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--inner", type=int, default=16)
    parser.add_argument("--latent", type=int, default=32)
    parser.add_argument("--reference-positions", type=int, default=0,
                        help="also compare both engines' logits with the fp32 oracle over this many prompt "
                             "positions (slow: about 30 s per position on this machine)")
    parser.add_argument("--llama-omp-wait-policy", choices=("ACTIVE", "PASSIVE"), default=None,
                        help="OMP_WAIT_POLICY for llama.cpp (default: its own; k3serve sleeps its workers)")
    parser.add_argument("--memory-limits", default=None,
                        help="instead of the resident comparison: streaming under these cgroup memory limits, "
                             "e.g. 768M,1G (k3serve's packed store vs llama.cpp's mmap, cold; needs root)")
    args = parser.parse_args()
    if args.memory_limits:
        from k3serve.units import parse_size

        checkpoint = widened_checkpoint(args.inner, args.latent)
        gguf = build_gguf(checkpoint, llama_cpp_tree(args.sdist))
        from k3serve.weights.checkpoint import Checkpoint

        vocab = Checkpoint(checkpoint).config.vocab_size
        prompt = np.random.default_rng(0).integers(0, vocab - 8, size=args.prompt_len).tolist()
        spec = {"gguf": str(gguf), "prompt": prompt, "threads": args.threads, "decode_steps": args.decode_steps}
        result = streaming_comparison(checkpoint, gguf, spec, [parse_size(x) for x in args.memory_limits.split(",")],
                                      args.rounds)
        for limit, r in result.items():
            print(f"limit {limit}: k3serve streaming {r['s_per_token']['k3serve']:.3f} s/token, llama.cpp mmap "
                  f"{r['s_per_token']['llama.cpp']:.3f} s/token: k3serve at {r['k3serve_speedup']:.2f}x "
                  f"llama.cpp's speed")
        print(json.dumps({"benchmark": "peers_streaming", "machine": describe_host(), "rounds": args.rounds,
                          "decode_steps": args.decode_steps, "threads": args.threads, "limits": result}))
        return

    bandwidth = triad_bandwidth()
    checkpoint = widened_checkpoint(args.inner, args.latent)
    gguf = build_gguf(checkpoint, llama_cpp_tree(args.sdist))
    moved = bytes_per_token(checkpoint)
    from k3serve.config import K3Config  # noqa: F401  (the child imports the rest)
    from k3serve.weights.checkpoint import Checkpoint

    vocab = Checkpoint(checkpoint).config.vocab_size
    prompt = np.random.default_rng(0).integers(0, vocab - 8, size=args.prompt_len).tolist()
    spec = {"checkpoint": str(checkpoint), "gguf": str(gguf), "prompt": prompt, "threads": args.threads,
            "decode_steps": args.decode_steps, "logits": True, "llama_omp_wait_policy": args.llama_omp_wait_policy}
    ours, theirs = child("k3serve", spec), child("llama.cpp", spec)  # agreement (all logits), also a warm-up
    a, b = np.asarray(ours["logits"], np.float64), np.asarray(theirs["logits"], np.float64)
    agreement = {
        "relative_rms": float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2))),
        "same_top5_last": sorted(np.argsort(-a[-1])[:5].tolist()) == sorted(np.argsort(-b[-1])[:5].tolist()),
        "top5_positions_agreeing": float(np.mean([set(np.argsort(-x)[:5]) == set(np.argsort(-y)[:5])
                                                  for x, y in zip(a, b)])),
        "greedy_k3serve": ours["greedy"], "greedy_llama_cpp": theirs["greedy"],
        "same_greedy": ours["greedy"] == theirs["greedy"],
    }
    if args.reference_positions:  # which engine departs from the fp32 oracle, position by position
        n = min(args.reference_positions, len(prompt))
        ref = reference_logits(checkpoint, prompt[:n]).astype(np.float64)

        def rel(x: np.ndarray, y: np.ndarray) -> float:
            return float(np.sqrt(np.mean((x - y) ** 2) / np.mean(y ** 2)))

        agreement["reference"] = {
            "positions": n, "k3serve_relative_rms": rel(a[:n], ref), "llama_cpp_relative_rms": rel(b[:n], ref),
            "k3serve_per_position": [round(rel(a[i], ref[i]), 6) for i in range(n)],
            "llama_cpp_per_position": [round(rel(b[i], ref[i]), 6) for i in range(n)]}
    spec["logits"] = False
    runs: dict[str, list[dict]] = {"k3serve": [], "llama.cpp": []}
    for _ in range(args.rounds):
        for engine in ("k3serve", "llama.cpp"):
            runs[engine].append(child(engine, spec))
    med = {engine: {key: statistics.median(r[key] for r in rs) for key in ("prefill_tok_s", "decode_tok_s",
                                                                            "peak_rss_mib")}
           for engine, rs in runs.items()}
    ratio = {key: med["k3serve"][key] / med["llama.cpp"][key] for key in med["k3serve"]}
    limit = {engine: moved["k3serve_total" if engine == "k3serve" else "stored_total"] / (bandwidth * 1e9)
             for engine in med}
    fraction = {engine: limit[engine] * med[engine]["decode_tok_s"] for engine in med}
    record = {
        "benchmark": "peers", "machine": {**describe_host(), "mxfp4_isa": _mxfp4_isa()}, "triad_gb_s": round(bandwidth, 2),
        "fixture": {"checkpoint": str(checkpoint), "gguf": str(gguf), "widen": [args.inner, args.latent]},
        "bytes_per_token": moved, "rounds": args.rounds, "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps, "threads": args.threads, "agreement": agreement,
        "llama_omp_wait_policy": args.llama_omp_wait_policy or "llama.cpp default",
        "median": med, "k3serve_over_llama_cpp": {k: round(v, 3) for k, v in ratio.items()},
        "fraction_of_bandwidth_at_decode": {k: round(v, 3) for k, v in fraction.items()},
        "all_runs": {e: [{k: v for k, v in r.items() if k != "logits"} for r in rs] for e, rs in runs.items()},
    }
    print(f"machine: {record['machine']} | triad {bandwidth:.1f} GB/s")
    print(f"K3 widened, {args.threads} threads: decode k3serve {med['k3serve']['decode_tok_s']:.1f} vs llama.cpp "
          f"{med['llama.cpp']['decode_tok_s']:.1f} tok/s ({ratio['decode_tok_s']:.2f}x) | prefill "
          f"{ratio['prefill_tok_s']:.2f}x | peak RSS {ratio['peak_rss_mib']:.2f}x | decode at "
          f"{fraction['k3serve']:.0%} / {fraction['llama.cpp']:.0%} of the triad bandwidth | same greedy "
          f"{agreement['same_greedy']}, same top-5 {agreement['same_top5_last']} | logits relative RMS "
          f"{agreement['relative_rms']:.1e} | medians of {args.rounds}")
    if "reference" in agreement:
        ref = agreement["reference"]
        print(f"against the fp32 oracle over {ref['positions']} positions: k3serve {ref['k3serve_relative_rms']:.1e}, "
              f"llama.cpp {ref['llama_cpp_relative_rms']:.1e}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
