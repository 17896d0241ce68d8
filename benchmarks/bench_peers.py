"""k3serve against llama.cpp: K3 and every family, at the tiny and the real-width fixtures, every precision pair.

    pip install -e '.[peers]'          # llama-cpp-python==0.3.36 (compiles ~13 min on 2 cores) and gguf
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llama_sdist   # its converter
    python benchmarks/bench_peers.py [--targets k3,qwen3_moe,...] [--sizes tiny,real] [--rounds 3]   # the matrix
    python benchmarks/bench_peers.py --quick --targets qwen3_moe --precisions int8                   # smoke test
    python benchmarks/bench_peers.py --k3-agreement --rounds 3        # K3 only: logits agreement, triad, bytes
    python benchmarks/bench_peers.py --memory-limits 768M,1G,1536M --rounds 3 --decode-steps 16   # streaming

The matrix (the default), per target (k3 or a family) and fixture size (benchmarks/family_fixture.py: "tiny" =
hidden 512, "real" = a released model's widths with 4 of its layers; K3's "tiny" is the shipped trained model,
its "real" the widened copy below, since one layer of the released K3's experts is 15.7 GB):
1. The files, once: the checkpoint (random bf16, released config spellings), then llama.cpp's own
   convert_hf_to_gguf.py (BF16, Q8_0) and llama_model_quantize (MXFP4_MOE from the BF16 file); K3 through its
   `conversion/kimi_k3.py` (MXFP4 experts repacked, bf16 trunk). Placeholder vocabularies; token ids fed.
2. Pairs: k3serve experts bf16 vs BF16, int8 vs Q8_0, mxfp4 vs MXFP4_MOE (k3serve loads the checkpoint with that
   expert precision and packs every expert before timing, as resident as llama.cpp's); K3: MXFP4 on both sides.
3. One fresh process per (engine, precision, wait policy) and round, engines alternated: load, an untimed warm-up
   of every shape, then prefill of each --prompt-lens (and --real-prompt-lens at real widths) at batch 1, decode
   of --decode-steps steps at each --batches size after a --decode-context-token prompt per sequence (llama.cpp:
   n_seq_max = the largest batch, one unified KV cache), and the process's peak RSS (VmHWM). 2 threads each.
4. Wait policies (--policies): "default" runs both with OMP_WAIT_POLICY, GOMP_SPINCOUNT and K3SERVE_WAIT_POLICY
   unset (each engine's own default: k3serve's adaptive thread governor, k3serve/threads.py; llama.cpp's libgomp
   spins, then sleeps), then ACTIVE and PASSIVE for both. Reported per figure: the ratio at the defaults, and each
   engine's best policy against the other's best.
5. The load average before and after each target and at the start of each run, in the record. --load-job N runs
   every measurement beside another job (an N-thread OpenBLAS matmul loop): the loaded-machine row.
One summary line per precision pair (defaults ratio first, best-policy ratio and the two policies in brackets) and
a JSON record on the last line (--out also writes it). Figures: docs/BENCHMARKS.md.

--k3-agreement, the K3-only comparison of the first figures, in one run:
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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import NamedTuple

import k3serve  # noqa: F401  (before numpy, as the CLI imports it: OpenBLAS's workers then sleep after a call)
import numpy as np

# llama.cpp's own converter (placeholder vocab) and the config keys it reads that our writer leaves out: one copy,
# shared with the lab's peers module
from k3serve.host import defaults_environment
from k3serve.lab.peers import CONFIG_KEYS_FOR_LLAMA_CPP, CONVERT_SCRIPT as CONVERT

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # family_fixture
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
    env = defaults_environment(spec["threads"])  # not this process's OMP_WAIT_POLICY, which k3serve set
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


# ------------------------------------------------------------------------------------------------ the matrix
# K3 and every family, each fixture size, each precision pair, prefill and decode at batch 1 and 8, each engine
# at its own defaults and at its best OpenMP wait policy. One fresh process per (engine, precision, policy) run
# measures every shape in turn; the processes alternate engines; medians over rounds.
PAIRS = {"bf16": "BF16", "int8": "Q8_0", "mxfp4": "MXFP4_MOE"}  # k3serve expert precision -> llama.cpp GGUF type
K3_PAIR = {"mxfp4": "MXFP4"}  # K3: MXFP4 experts as trained; llama.cpp's converter repacks them, bf16 trunk both
POLICIES = ("default", "ACTIVE", "PASSIVE")  # default: OMP_WAIT_POLICY / GOMP_SPINCOUNT unset (each engine's own)

# Run by `python -c` in a fresh process: llama.cpp's convert_hf_to_gguf.py with placeholder vocab (random models
# have no tokenizer; ids are fed) and one fix for a heuristic of llama.cpp's loader: a deepseek2 file without
# q_lora_rank loads only at 26 or 27 layers (where it guesses DeepSeek-V2-Lite / Moonlight), so a 4-layer
# Moonlight gets the key with 0, which the loader reads as "no q LoRA" (src/models/deepseek2.cpp).
FAMILY_CONVERT = r'''
import sys, runpy
tree = sys.argv[1]
sys.path[:0] = [tree + "/gguf-py", tree]
import gguf
import conversion.base as base

def placeholder_vocab(self):
    n = self.hparams["vocab_size"]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list([f"<t{i}>" for i in range(n)])
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
    self.gguf_writer.add_token_merges(["<t0> <t1>"])

_prepare = base.TextModel.prepare_metadata
def prepare_metadata(self, *a, **k):
    type(self).set_vocab = placeholder_vocab
    return _prepare(self, *a, **k)
base.TextModel.prepare_metadata = prepare_metadata
_params = base.TextModel.set_gguf_parameters
def set_gguf_parameters(self):
    _params(self)
    if self.hparams.get("model_type") == "deepseek_v3" and self.hparams.get("q_lora_rank") is None:
        self.gguf_writer.add_q_lora_rank(0)
base.TextModel.set_gguf_parameters = set_gguf_parameters
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(tree + "/convert_hf_to_gguf.py", run_name="__main__")
'''


def family_ggufs(checkpoint: Path, tree: Path, kinds: list[str]) -> dict[str, Path]:
    """The fixture's GGUFs by llama.cpp's own tools, once each: convert_hf_to_gguf.py --outtype bf16 (BF16) and
    q8_0 (Q8_0, every matrix), llama_model_quantize of the BF16 file to MXFP4_MOE (MXFP4 experts, the rest Q8_0)."""
    out = {kind: checkpoint.parent / f"{kind}.gguf" for kind in kinds}
    config = json.loads((checkpoint / "config.json").read_text())
    extra = ["--no-mtp"] if config["model_type"] == "qwen3_next" else []  # released files carry MTP; ours not
    for kind, outtype in (("BF16", "bf16"), ("Q8_0", "q8_0")):
        target = checkpoint.parent / f"{kind}.gguf"
        needed = kind in kinds or (kind == "BF16" and "MXFP4_MOE" in kinds and not out["MXFP4_MOE"].exists())
        if needed and not target.exists():
            print(f"converting {checkpoint.parent.name} to {kind} with llama.cpp's converter (once)...",
                  file=sys.stderr, flush=True)
            done = subprocess.run([sys.executable, "-c", FAMILY_CONVERT, str(tree), str(checkpoint), "--outfile",
                                   str(target), "--outtype", outtype, *extra], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"llama.cpp's converter failed on {checkpoint}: {done.stderr[-2000:]}")
    if "MXFP4_MOE" in kinds and not out["MXFP4_MOE"].exists():
        import llama_cpp

        print(f"quantizing {checkpoint.parent.name} to MXFP4_MOE with llama_model_quantize (once)...",
              file=sys.stderr, flush=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_MXFP4_MOE
        params.nthread = 2
        bf16 = checkpoint.parent / "BF16.gguf"
        if llama_cpp.llama_model_quantize(str(bf16).encode(), str(out["MXFP4_MOE"]).encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize to MXFP4_MOE failed on {bf16}")
        if "BF16" not in kinds:
            bf16.unlink()  # only the source of the quantization: the disk is shared
    return out


class Target(NamedTuple):
    label: str  # what the tables call it
    family: str  # "k3" or a family's model_type
    size: str
    checkpoint: Path
    ggufs: dict[str, Path]  # llama.cpp file type -> file
    pairs: dict[str, str]  # k3serve precision -> llama.cpp file type
    vocab: int
    note: str


def k3_target(size: str, tree: Path, args: argparse.Namespace) -> Target:
    """K3: the shipped trained model ("tiny", "smoke") or its widened copy ("real": the released K3's experts hold
    15.7 GB per layer, so no real-width K3 file fits; the widened one is the largest that does, 1.5 GB)."""
    from k3serve.lab.peers import build_gguf as build_k3_gguf
    from k3serve.loading import default_model_dir
    from k3serve.weights.checkpoint import Checkpoint

    if size == "real":
        checkpoint, note = widened_checkpoint(args.inner, args.latent), f"trained K3 widened {args.inner}x/{args.latent}x"
        gguf = build_gguf(checkpoint, llama_cpp_tree(args.sdist))
    else:
        checkpoint, note = Path(default_model_dir()), "the shipped trained K3 (6.9M parameters)"
        key = hashlib.sha256((checkpoint / "SHA256SUMS").read_bytes()).hexdigest()[:12]  # a new model, a new file
        gguf = build_k3_gguf(checkpoint, tree, WORK / "embedded" / f"k3-{key}.gguf")
    vocab = Checkpoint(checkpoint).config.vocab_size
    return Target(f"K3 {size}", "k3", size, checkpoint, {"MXFP4": gguf}, dict(K3_PAIR), vocab, note)


def family_target(family: str, size: str, tree: Path, precisions: list[str]) -> Target:
    import family_fixture

    checkpoint = family_fixture.fixture_dir(family, size)
    pairs = {ours: PAIRS[ours] for ours in precisions}
    ggufs = family_ggufs(checkpoint, tree, list(pairs.values()))
    config = json.loads((checkpoint / "config.json").read_text())
    note = (f"copies {family_fixture.RELEASED[family].name}: {family_fixture.RELEASED[family].cut}" if size == "real"
            else f"{size}: hidden {config['hidden_size']}, {config['num_hidden_layers']} layers")
    return Target(f"{family} {size}", family, size, checkpoint, ggufs, pairs, config["vocab_size"], note)


def run_shapes(spec: dict) -> dict:
    """One engine in this process: load, warm up every shape, then prefill each prompt length at batch 1 and decode
    `decode_steps` steps at each batch size after a `decode_context`-token prompt per sequence; peak RSS."""
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(3, spec["vocab"] - 8, size=n).tolist() for n in spec["prompt_lens"]}
    contexts = [rng.integers(3, spec["vocab"] - 8, size=spec["decode_context"]).tolist()
                for _ in range(max(spec["batches"]))]
    engine = (_K3ServeShapes if spec["engine"] == "k3serve" else _LlamaCppShapes)(spec)
    # warm-up: kernels compiled (the shortest prompt takes the prefill path every length takes), experts resident
    engine.prefill([prompts[min(prompts)]])
    engine.decode([[contexts[0][-1]]], 1)
    engine.reset()
    engine.prefill([c[:16] for c in contexts[:max(spec["batches"])]])
    engine.decode([[c[-1]] for c in contexts[:max(spec["batches"])]], 1)
    out: dict = {"load_avg_start": os.getloadavg()[0]}
    for n, prompt in prompts.items():
        engine.reset()
        started = time.perf_counter()
        engine.prefill([prompt])
        out[f"prefill_{n}_tok_s"] = n / (time.perf_counter() - started)
    for batch in spec["batches"]:
        engine.reset()
        first = engine.prefill(contexts[:batch])
        started = time.perf_counter()
        tokens = engine.decode([[t] for t in first], spec["decode_steps"])
        out[f"decode_b{batch}_tok_s"] = batch * spec["decode_steps"] / (time.perf_counter() - started)
        if batch == 1:
            out["greedy"] = tokens[0][:10]
    out["peak_rss_mib"] = peak_rss_mib()
    return out


class _K3ServeShapes:
    def __init__(self, spec: dict) -> None:
        from k3serve.loading import load_model
        from k3serve.model.families.moe import MoEBlock
        from k3serve.model.interface import ForwardItem

        self.item = ForwardItem
        options = {} if spec["family"] == "k3" else {"expert_precision": spec.get("expert_precision",
                                                                                   spec["precision"]),
                                                       "trunk_precision": spec.get("trunk_precision", "native")}
        self.model = load_model(spec["checkpoint"], **options).model  # as the CLI loads it
        for layer in getattr(self.model, "layers", []):  # resident like llama.cpp's: every expert packed first
            if isinstance(getattr(layer, "mlp", None), MoEBlock):
                for expert in range(layer.mlp.router.weight.shape[0]):
                    layer.mlp.experts.get(layer.mlp.layer, expert)
        self.caches: list = []

    def reset(self) -> None:
        self.caches = []

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        self.caches = [self.model.new_cache() for _ in prompts]
        result = self.model.forward([self.item(np.asarray(p, np.int64), c) for p, c in zip(prompts, self.caches)])
        return [int(np.argmax(logits[-1])) for logits in result.logits]

    def decode(self, last: list[list[int]], steps: int) -> list[list[int]]:
        tokens = [[t[0]] for t in last]
        for _ in range(steps):
            result = self.model.forward([self.item(np.array([seq[-1]]), c) for seq, c in zip(tokens, self.caches)])
            for seq, logits in zip(tokens, result.logits):
                seq.append(int(np.argmax(logits[-1])))
        return [seq[1:] for seq in tokens]


class _LlamaCppShapes:
    """llama.cpp at its defaults (n_batch 2048, n_ubatch 512, its own threadpool settings) but for the thread count,
    `use_extra_bufts` off (its AMX repack crashed at the first decode on the Xeon VM of the first figures), and
    `n_seq_max` = the largest batch with a unified KV cache sized for it."""

    def __init__(self, spec: dict) -> None:
        import llama_cpp

        self.lib = llama_cpp
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = False
        self.model = llama_cpp.llama_model_load_from_file(spec["gguf"].encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {spec['gguf']}")
        batch = max(spec["batches"])
        need = max(max(spec["prompt_lens"]), batch * (spec["decode_context"] + spec["decode_steps"] + 2))
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = -(-(need + 64) // 256) * 256
        ctx_params.n_batch = max(ctx_params.n_batch, need)
        ctx_params.n_seq_max = batch
        ctx_params.kv_unified = True
        ctx_params.n_threads = ctx_params.n_threads_batch = spec["threads"]
        self.ctx = llama_cpp.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {spec['gguf']}")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.positions: list[int] = []

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)
        self.positions = []

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, logits)
        batch = self.lib.llama_batch_init(len(rows), 0, 1)
        for i, (token, position, sequence, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = sequence, logits
        batch.n_tokens = len(rows)
        status = self.lib.llama_decode(self.ctx, batch)
        self.lib.llama_batch_free(batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed ({status})")

    def _argmax(self, i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,))))

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        rows = [(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
        self._decode(rows)
        self.positions = [len(prompt) for prompt in prompts]
        ends = np.cumsum([len(prompt) for prompt in prompts]) - 1
        return [self._argmax(int(i)) for i in ends]

    def decode(self, last: list[list[int]], steps: int) -> list[list[int]]:
        tokens = [[t[0]] for t in last]
        for _ in range(steps):
            self._decode([(seq[-1], self.positions[s], s, True) for s, seq in enumerate(tokens)])
            self.positions = [p + 1 for p in self.positions]
            for s, seq in enumerate(tokens):
                seq.append(self._argmax(s))
        return [seq[1:] for seq in tokens]


def shapes_child(spec: dict, policy: str) -> dict:
    """run_shapes in a fresh process under the wait policy `policy` (POLICIES); an error comes back as a record."""
    env = defaults_environment(spec["threads"])
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run([sys.executable, __file__, "--shapes-child", json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()
        return {"error": tail[-1] if tail else f"exit status {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


LOAD_JOB = """
import numpy as np
a = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)
while True:
    a = a @ a
    a /= np.abs(a).max()
"""


def load_job(threads: int) -> subprocess.Popen:
    """Another job on the machine for the loaded row: float32 1024x1024 matrix products on `threads` OpenBLAS
    threads, in a loop, at numpy's defaults otherwise (its threads spin, then sleep, as OpenBLAS's do)."""
    env = defaults_environment(threads)
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    return subprocess.Popen([sys.executable, "-c", LOAD_JOB], env=env, stdout=subprocess.DEVNULL)


# llama.cpp's file types whose non-expert matrices (attention, embedding, output, shared experts) are Q8_0
Q8_0_TRUNK_TYPES = ("Q8_0", "MXFP4_MOE")


def trunk_precision(target: Target, theirs: str, mode: str) -> str:
    """k3serve's --trunk-precision for a pair: as stored, or (mode "match") Q8_0 where the peer's file holds Q8_0."""
    return "q8_0" if mode == "match" and target.family != "k3" and theirs in Q8_0_TRUNK_TYPES else "native"


def measure_target(target: Target, args: argparse.Namespace) -> dict:
    """Every (engine, precision pair, policy) of `target`, alternated round by round in fresh processes; medians,
    each engine's default-policy figures and its best policy per figure, and the ratios of both."""
    prompt_lens = args.prompt_lens + (args.real_prompt_lens if target.size == "real" else [])
    base = {"threads": args.threads, "prompt_lens": prompt_lens, "batches": args.batches,
            "decode_context": args.decode_context, "decode_steps": args.decode_steps, "vocab": target.vocab,
            "family": target.family, "checkpoint": str(target.checkpoint)}
    configs = {}
    for ours, theirs in target.pairs.items():
        configs[("k3serve", ours)] = {**base, "engine": "k3serve", "precision": ours,
                                      "trunk_precision": trunk_precision(target, theirs, args.k3serve_trunk)}
        if args.k3serve_source == "gguf":  # the very file llama.cpp loads, its tensors at the types it stores
            # (expert precision "native": "int8" would requantize a Q8_0 file's experts to per-row int8)
            configs[("k3serve", ours)].update(checkpoint=str(target.ggufs[theirs]), trunk_precision="native",
                                              expert_precision="native")
        configs[("llama.cpp", theirs)] = {**base, "engine": "llama.cpp", "gguf": str(target.ggufs[theirs])}
    runs: dict[str, list[dict]] = {}
    for (engine, precision), spec in configs.items():  # untimed: numba compiles into its cache, pages come in
        if engine == "k3serve":
            shapes_child({**spec, "prompt_lens": [16], "decode_steps": 1}, args.policies[0])
    job = load_job(args.load_job) if args.load_job else None  # the loaded-machine row: another job on the cores
    try:
        load = [os.getloadavg()[0]]
        for round_ in range(args.rounds):
            for policy in args.policies:
                for (engine, precision), spec in configs.items():
                    key = f"{engine} {precision} {policy}"
                    print(f"  {target.label} round {round_ + 1}/{args.rounds}: {key}", file=sys.stderr, flush=True)
                    runs.setdefault(key, []).append(shapes_child(spec, policy))
        load.append(os.getloadavg()[0])
    finally:
        if job is not None:
            job.kill()
            job.wait()
    figures = [f"prefill_{n}_tok_s" for n in prompt_lens] + [f"decode_b{b}_tok_s" for b in args.batches] + [
        "peak_rss_mib"]
    median = {}
    for key, rs in runs.items():
        good = [r for r in rs if "error" not in r]
        median[key] = ({f: statistics.median(r[f] for r in good) for f in figures} if good
                       else {"error": rs[0]["error"]})

    def at(engine: str, precision: str, figure: str, policy: str) -> float | None:
        return median[f"{engine} {precision} {policy}"].get(figure)

    def best(engine: str, precision: str, figure: str) -> tuple[float | None, str | None]:
        measured = [(at(engine, precision, figure, p), p) for p in args.policies
                    if at(engine, precision, figure, p) is not None]
        if not measured:
            return None, None
        pick = min if figure == "peak_rss_mib" else max
        return pick(measured, key=lambda x: x[0])

    pairs = {}
    for ours, theirs in target.pairs.items():
        row: dict = {}
        for figure in figures:
            entry: dict = {}
            if "default" in args.policies:
                a, b = at("k3serve", ours, figure, "default"), at("llama.cpp", theirs, figure, "default")
                entry["defaults"] = {"k3serve": a, "llama.cpp": b, "ratio": (round(a / b, 3) if a and b else None)}
            (a, pa), (b, pb) = best("k3serve", ours, figure), best("llama.cpp", theirs, figure)
            entry["best"] = {"k3serve": a, "k3serve_policy": pa, "llama.cpp": b, "llama.cpp_policy": pb,
                             "ratio": (round(a / b, 3) if a and b else None)}
            row[figure] = entry
        pairs[f"{ours} vs {theirs}"] = row
    greedy = {key: rs[0].get("greedy") for key, rs in runs.items()}
    return {"target": target.label, "note": target.note, "checkpoint": str(target.checkpoint),
            "ggufs": {k: str(v) for k, v in target.ggufs.items()}, "load_average": load, "pairs": pairs,
            "median": median, "greedy_first_round": greedy,
            "all_runs": {k: [{f: v for f, v in r.items() if f != "greedy"} for r in rs] for k, rs in runs.items()}}


def summary_lines(result: dict) -> list[str]:
    """One line per precision pair: the defaults ratio first, then the best-policy ratio, per figure."""
    lines = []
    for pair, row in result["pairs"].items():
        parts = []
        for figure, entry in row.items():
            short = figure.replace("_tok_s", "").replace("peak_rss_mib", "RSS")
            default = entry.get("defaults", {}).get("ratio")
            best = entry["best"]
            parts.append(f"{short} {default if default is not None else '-'}x "
                         f"(best {best['ratio'] if best['ratio'] is not None else '-'}x: "
                         f"{best['k3serve_policy']}/{best['llama.cpp_policy']})")
        lines.append(f"{result['target']} {pair}: " + ", ".join(parts))
    return lines


def matrix(args: argparse.Namespace) -> None:
    """The one peers benchmark: every target of --targets at every size of --sizes."""
    from k3serve.host import describe_host
    from k3serve.lab.peers import converter_tree

    tree = args.llama_tree or converter_tree(WORK / "llama_cpp_src")
    results = []
    started = time.time()
    for size in args.sizes:
        for name in args.targets:
            print(f"{name} {size}: building the fixture and GGUFs (once)...", file=sys.stderr, flush=True)
            target = (k3_target(size, tree, args) if name == "k3"
                      else family_target(name, size, tree, args.precisions))
            result = measure_target(target, args)
            results.append(result)
            if args.delete_after and name != "k3":  # the real-width files take 10-17 GB each with their GGUFs
                shutil.rmtree(target.checkpoint.parent)
            for line in summary_lines(result):
                print(line, flush=True)
    record = {"benchmark": "peers_matrix", "machine": describe_host(), "rounds": args.rounds,
              "threads": args.threads, "policies": args.policies,
              "k3serve_mxfp4_activations": os.environ.get("K3SERVE_MXFP4_ACTIVATIONS", "f32"),
              "k3serve_int8_activations": os.environ.get("K3SERVE_INT8_ACTIVATIONS", "auto"),
              "k3serve_bf16_activations": os.environ.get("K3SERVE_BF16_ACTIVATIONS", "f32"),
              "k3serve_trunk": args.k3serve_trunk, "k3serve_source": args.k3serve_source,
              "load_job": ({"threads": args.load_job, "what": "float32 1024x1024 matmul loop, OpenBLAS"}
                           if args.load_job else None), "decode_context": args.decode_context,
              "decode_steps": args.decode_steps, "batches": args.batches, "prompt_lens": args.prompt_lens,
              "real_prompt_lens": args.real_prompt_lens, "wall_s": round(time.time() - started, 1),
              "how_to_read": "ratio = k3serve / llama.cpp (speed: > 1 is k3serve faster; RSS: < 1 is k3serve "
                             "smaller). 'defaults': both engines with OMP_WAIT_POLICY, GOMP_SPINCOUNT and K3SERVE_WAIT_"
                             "POLICY unset (k3serve then runs its adaptive thread governor, k3serve/threads.py, "
                             "PASSIVE before 2026-12-06 evening; llama.cpp's libgomp spins then sleeps); 'best': "
                             "each engine's best median over the policies run, per figure, policy named.",
              "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


# ------------------------------------------------------------------------------------------------ main
def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def main() -> None:
    from k3serve.host import describe_host

    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        spec = json.loads(sys.argv[3])
        print(json.dumps((run_k3serve if sys.argv[2] == "k3serve" else run_llama_cpp)(spec)))
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--shapes-child":
        print(json.dumps(run_shapes(json.loads(sys.argv[2]))))
        return
    import family_fixture

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", type=_csv(str), default=["k3", *family_fixture.FAMILIES],
                        help="k3 and families (default: all)")
    parser.add_argument("--sizes", type=_csv(str), default=["tiny", "real"],
                        help="fixture sizes: smoke, tiny, real (benchmarks/family_fixture.py)")
    parser.add_argument("--precisions", type=_csv(str), default=list(PAIRS),
                        help="k3serve expert precisions, each against its llama.cpp GGUF type (bf16 vs BF16, int8 "
                             "vs Q8_0, mxfp4 vs MXFP4_MOE; K3 has one pair, its MXFP4 experts on both sides)")
    parser.add_argument("--k3serve-trunk", choices=("native", "match"), default="native",
                        help="the families' trunk in k3serve: as stored (native: bf16), or match the peer's file "
                             "(--trunk-precision q8_0 against Q8_0 and MXFP4_MOE, whose trunk, embedding and "
                             "output llama.cpp holds in Q8_0; bf16 against BF16)")
    parser.add_argument("--k3serve-source", choices=("checkpoint", "gguf"), default="checkpoint",
                        help="what k3serve loads: the safetensors checkpoint (quantized at load as --k3serve-trunk "
                             "says), or gguf: the same GGUF file llama.cpp loads, held at the types it stores "
                             "(--k3serve-trunk is then moot)")
    parser.add_argument("--policies", type=_csv(str), default=list(POLICIES),
                        help="OpenMP wait policies run for both engines: default (unset), ACTIVE, PASSIVE")
    parser.add_argument("--load-job", type=int, default=0, metavar="THREADS",
                        help="run every measurement beside another job: a THREADS-thread OpenBLAS matmul loop "
                             "(the loaded-machine row; 0: none)")
    parser.add_argument("--prompt-lens", type=_csv(int), default=[512], help="prefill lengths, every size")
    parser.add_argument("--real-prompt-lens", type=_csv(int), default=[2048], help="and these at real widths")
    parser.add_argument("--batches", type=_csv(int), default=[1, 8], help="decode batch sizes (sequences)")
    parser.add_argument("--decode-context", type=int, default=64, help="prompt tokens per sequence before decode")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: smoke fixtures, 1 round, 64-token prefill, 4 decode steps, default and "
                             "PASSIVE policies (each option still overrides)")
    parser.add_argument("--llama-tree", type=Path, default=None,
                        help="a llama.cpp source tree (default: the sdist's, as the lab's peers module finds it)")
    parser.add_argument("--out", default=None, help="also write the JSON record here")
    parser.add_argument("--delete-after", action="store_true",
                        help="delete each family fixture's folder (checkpoint and GGUFs) once it is measured")
    parser.add_argument("--k3-agreement", action="store_true",
                        help="the K3-only comparison of earlier figures instead: logits agreement, triad bandwidth "
                             "and bytes per token, --prompt-len prefill, batch-1 decode")
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
    given = {a.split("=")[0] for a in sys.argv[1:] if a.startswith("--")}
    args = parser.parse_args()
    if args.quick:
        for option, value in (("--sizes", ["smoke"]), ("--rounds", 1), ("--prompt-lens", [64]),
                              ("--real-prompt-lens", []), ("--decode-steps", 4), ("--decode-context", 16),
                              ("--policies", ["default", "PASSIVE"])):
            if option not in given:
                setattr(args, option[2:].replace("-", "_"), value)
    unknown = [p for p in args.policies if p not in POLICIES] + [s for s in args.sizes if s not in family_fixture.SIZES]
    unknown += [t for t in args.targets if t != "k3" and t not in family_fixture.FAMILIES]
    unknown += [p for p in args.precisions if p not in PAIRS]
    if unknown:
        parser.error(f"unknown {', '.join(unknown)}: see --help")
    if not (args.memory_limits or args.k3_agreement):
        matrix(args)
        return
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
