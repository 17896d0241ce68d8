"""k3serve and llama.cpp on the same weights, for the lab's `peers` module: the GGUF (llama.cpp's own converter),
one measurement per fresh process, and a memory cgroup for the runs under RAM.

The GGUF is the lab model (or its widened copy) converted by `conversion/kimi_k3.py` of the llama.cpp tree that
llama-cpp-python 0.3.36 vendors (its sdist; the wheel does not carry the converter), the MXFP4 experts repacked
without requantizing and the bf16 trunk kept bf16, as `benchmarks/bench_peers.py` does. Our tokenizer is not one
llama.cpp knows, so the vocabulary is written as placeholder tokens and both engines are fed token ids. k3serve
loads that same file (`load_model(FILE.gguf)`); under RAM it streams from a store packed from it.

Each measurement is one fresh process (`python -m k3serve.lab.peers ENGINE SPEC`): load, an untimed prefill and
decode step (warm-up), then a timed prefill of the prompt and `decode_tokens` greedy steps at batch 1, and the
process's peak RSS (VmHWM). Under RAM the process runs inside a cgroup-v1 memory group whose limit counts the page
cache, the files' pages evicted first (POSIX_FADV_DONTNEED on these files only).

Where to find the converter: $K3SERVE_LLAMA_CPP_TREE (a llama.cpp source folder), else the sdist at
$K3SERVE_LLAMA_CPP_SDIST (default /tmp/llama_sdist/llama_cpp_python-0.3.36.tar.gz, as tests/peers use), unpacked
once into the lab's cache. The converter imports torch (llama.cpp's requirement, not k3serve's).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from k3serve.errors import K3Error
from k3serve.host import defaults_environment

LLAMA_CPP_VERSION = "0.3.36"
DEFAULT_SDIST = Path(f"/tmp/llama_sdist/llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz")
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory controller
# released K3 config keys llama.cpp's converter reads and our checkpoint writer leaves out
CONFIG_KEYS_FOR_LLAMA_CPP = {"architectures": ["KimiK3ForConditionalGeneration"], "hidden_act": "situ",
                             "mla_use_nope": True, "max_position_embeddings": 4096}

# llama.cpp's own converter on a K3 checkpoint folder (argv: llama.cpp tree, checkpoint, output GGUF); shared with
# benchmarks/bench_peers.py
CONVERT_SCRIPT = r'''
import sys
from pathlib import Path
tree, src, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
sys.path[:0] = [str(tree / "gguf-py"), str(tree)]
import gguf
from conversion.kimi_k3 import KimiK3Model

def placeholder_vocab(self):  # our BPE is not one llama.cpp knows: placeholder tokens, ids fed directly
    n = self.hparams["vocab_size"]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list([f"<t{i}>" for i in range(n)])
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
    self.gguf_writer.add_token_merges(["<t0> <t1>"])  # llama.cpp refuses a BPE vocab without merges
    self.gguf_writer.add_bos_token_id(self.hparams["bos_token_id"])
    self.gguf_writer.add_eos_token_id(self.hparams["eos_token_id"])

KimiK3Model.set_vocab = placeholder_vocab
KimiK3Model(src, gguf.LlamaFileType.MOSTLY_BF16, out).write()
'''


class PeerUnavailable(K3Error):
    """llama.cpp or its converter is missing here; the message says which and how to get it."""


# ------------------------------------------------------------------------------------------------ what is here
def llama_cpp_missing() -> str | None:
    """Why the live comparison cannot run here, or None when it can."""
    if importlib.util.find_spec("llama_cpp") is None:
        return (f"llama-cpp-python is not installed (the optional `peers` extra: pip install -e '.[peers]', "
                f"llama-cpp-python=={LLAMA_CPP_VERSION}, which compiles llama.cpp)")
    return None


def converter_tree(cache: Path) -> Path:
    """A llama.cpp source tree with `conversion/kimi_k3.py` and `gguf-py`, or PeerUnavailable saying where it was
    looked for."""
    named = os.environ.get("K3SERVE_LLAMA_CPP_TREE")
    if named:
        tree = Path(named)
        if (tree / "conversion" / "kimi_k3.py").exists():
            return tree
        raise PeerUnavailable(f"$K3SERVE_LLAMA_CPP_TREE={tree} has no conversion/kimi_k3.py")
    sdist = Path(os.environ.get("K3SERVE_LLAMA_CPP_SDIST", DEFAULT_SDIST))
    tree = cache / sdist.name.replace(".tar.gz", "") / "vendor" / "llama.cpp"
    if (tree / "conversion" / "kimi_k3.py").exists():
        return tree
    if not sdist.exists():
        raise PeerUnavailable(
            f"llama.cpp's converter is not here: set $K3SERVE_LLAMA_CPP_TREE to a llama.cpp source folder, or put "
            f"the sdist at {sdist} (pip download --no-deps --no-binary :all: llama-cpp-python=={LLAMA_CPP_VERSION} "
            f"-d {sdist.parent}) or name it with $K3SERVE_LLAMA_CPP_SDIST")
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in m.name
                   and any(part in m.name for part in ("/conversion/", "/gguf-py/", "convert_hf_to_gguf.py"))]
        archive.extractall(cache, members=members, filter="data")
    return tree


def build_gguf(checkpoint: Path, tree: Path, out: Path) -> Path:
    """`checkpoint` (a K3 folder) converted by llama.cpp's kimi_k3 converter to `out` (once: kept if it exists)."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = out.parent / f".view-{os.getpid()}"  # the same shards, the config with the released keys
    staged.mkdir(exist_ok=True)
    for path in checkpoint.iterdir():
        if path.name != "config.json" and not (staged / path.name).exists():
            (staged / path.name).symlink_to(path.resolve())
    config = json.loads((checkpoint / "config.json").read_text())
    flat = {**config.get("text_config", config), **{k: v for k, v in config.items() if k != "text_config"}}
    flat.update(CONFIG_KEYS_FOR_LLAMA_CPP)
    flat["num_key_value_heads"] = flat["num_attention_heads"]  # MLA: one kv head per query head before absorption
    (staged / "config.json").write_text(json.dumps(flat, indent=1))
    partial = out.with_name(out.name + f".{os.getpid()}.tmp")
    try:
        done = subprocess.run([sys.executable, "-c", CONVERT_SCRIPT, str(tree), str(staged), str(partial)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise K3Error(f"llama.cpp's converter failed on {checkpoint}: {done.stderr.strip()[-1500:]}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
        for path in staged.iterdir():
            path.unlink()
        staged.rmdir()
    return out


# ------------------------------------------------------------------------------------------------ cgroup
def cgroup_problem() -> str | None:
    """Why a memory cgroup cannot be made here (cgroup v1's memory controller, writable: root), or None."""
    if not (CGROUP_ROOT / "cgroup.procs").exists():
        return f"no cgroup-v1 memory controller at {CGROUP_ROOT} (cgroup v2 or a container without it)"
    probe = CGROUP_ROOT / f"k3lab-probe-{os.getpid()}"
    try:
        probe.mkdir()
        (probe / "memory.limit_in_bytes").write_text(str(1 << 30))
    except OSError as error:
        return f"cannot create a memory cgroup under {CGROUP_ROOT} ({error.strerror}: needs root, and a container " \
               "that lets it write there)"
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    return None


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A fresh cgroup-v1 memory group limited to `limit_bytes` (page cache counted); yields its folder and removes
    it after (its processes have exited by then)."""
    group = CGROUP_ROOT / f"k3lab-peers-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        yield group
    finally:
        for _ in range(50):  # the kernel frees a group a moment after its last process exits
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.02)


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache, so a run under RAM starts cold (other files are untouched)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(engine: str, spec: dict, group: Path | None = None, timeout_s: float = 300.0) -> dict:
    """One measurement of `engine` ("k3serve" or "llama.cpp") in a fresh process, inside `group` if given.
    Returns {prefill_tok_s, decode_tok_s, peak_rss_mib}, or K3Error with the child's last words."""
    env = defaults_environment(spec["threads"])  # each engine at its own defaults, not the server's wait policy
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    command = [sys.executable, "-m", "k3serve.lab.peers", engine, json.dumps(spec)]
    if group is not None:
        command = ["sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$@"', "sh", *command]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise K3Error(f"{engine} did not finish within {timeout_s:g} s") from None
    if done.returncode != 0:
        killed = " (killed: out of memory in the cgroup?)" if done.returncode in (-9, 137) else ""
        raise K3Error(f"{engine} exited with code {done.returncode}{killed}: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ the child
def _peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM; not ru_maxrss, which Linux carries across execve)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _run_k3serve(spec: dict) -> dict:
    from k3serve.loading import load_model
    from k3serve.model.interface import ForwardItem
    from k3serve.stream.options import StreamOptions

    if spec.get("ram_budget"):
        model = load_model(spec["store"], stream=StreamOptions(ram_budget=int(spec["ram_budget"]))).model
    else:
        model = load_model(spec["gguf"]).model
    prompt = np.asarray(spec["prompt"], np.int64)  # [T]
    warm = model.new_cache()
    model.forward([ForwardItem(prompt[:8], warm)])
    model.forward([ForwardItem(prompt[8:9], warm)])
    cache = model.new_cache()
    started = time.perf_counter()
    logits = model.forward([ForwardItem(prompt, cache)]).logits[0]  # [1, V]: the last position
    prefill_s = time.perf_counter() - started
    token = int(np.argmax(logits[-1]))
    started = time.perf_counter()
    for _ in range(spec["decode_tokens"]):
        token = int(np.argmax(model.forward([ForwardItem(np.array([token]), cache)]).logits[0][-1]))
    decode_s = time.perf_counter() - started
    return {"prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": spec["decode_tokens"] / decode_s,
            "peak_rss_mib": _peak_rss_mib()}


def _run_llama_cpp(spec: dict) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = False  # --no-repack: its AMX repack crashed at the first decode on this project's CPU
    model = llama_cpp.llama_model_load_from_file(spec["gguf"].encode(), params)
    if not model:
        raise K3Error(f"llama.cpp could not load {spec['gguf']}")
    ctx_params = llama_cpp.llama_context_default_params()
    ctx_params.n_ctx = max(256, len(spec["prompt"]) + spec["decode_tokens"] + 16)
    ctx_params.n_batch = ctx_params.n_ubatch = 512
    ctx_params.n_threads = ctx_params.n_threads_batch = spec["threads"]
    ctx = llama_cpp.llama_init_from_model(model, ctx_params)
    vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    def decode(ids: list[int], start: int) -> None:
        batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
        for i, token in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(ids) - 1
        batch.n_tokens = len(ids)
        failed = llama_cpp.llama_decode(ctx, batch)
        llama_cpp.llama_batch_free(batch)
        if failed:
            raise K3Error(f"llama_decode returned {failed}")

    def next_token() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(vocab_size,))))

    prompt = [int(t) for t in spec["prompt"]]
    decode(prompt[:8], 0)
    decode(prompt[8:9], 8)
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    started = time.perf_counter()
    decode(prompt, 0)
    prefill_s = time.perf_counter() - started
    token = next_token()
    started = time.perf_counter()
    for step in range(spec["decode_tokens"]):
        decode([token], len(prompt) + step)
        token = next_token()
    decode_s = time.perf_counter() - started
    return {"prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": spec["decode_tokens"] / decode_s,
            "peak_rss_mib": _peak_rss_mib()}


def main(argv: list[str]) -> int:
    engine, spec = argv[0], json.loads(argv[1])
    run = {"k3serve": _run_k3serve, "llama.cpp": _run_llama_cpp}[engine]
    print(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
