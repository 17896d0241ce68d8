"""The memory floor, live: the engine at its computed minimum budget inside a memory cgroup of that size plus the
interpreter's own memory, on a fixture with the full K3's proportions (k3serve.weights.proportioned), with output
identical to the same weights held whole.

The child process joins a fresh cgroup (v1, /sys/fs/cgroup/memory; root), runs the reference first (the bf16 trunk
with no budget: every weight in RAM, and the float32 resident model's tokens), frees it, takes its own memory as
the baseline (VmRSS, and the cgroup's usage), sets the cgroup's limit to usage + the minimum + SLACK, resets its
peak (clear_refs), then loads the streaming engine at the minimum and generates. Peak RSS over the baseline is the
engine's weight memory plus activations; the minimum is what the budget splitter charges.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_memory_floor.py --hidden 1024 [--trunk-precision mxfp4]

`--trunk-precision q8_0|mxfp4` packs the fixture's trunk so (`k3serve pack --trunk-precision`); the reference is
then the same quantized store held whole (the float32 resident model's tokens are recorded, not expected equal).

Prints one summary line and a JSON record (--json FILE writes it too).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
SLACK = 16 << 20  # activations, caches, the logits, thread stacks: the stated overhead beyond the interpreter's
PROMPT_TOKENS = 40  # a prefill over kernels.BF16_KERNEL_MAX_TOKENS: the widening transient the minimum charges


def prompt(num_tokens: int) -> list[int]:
    return [(7 * i * i + 3 * i + 1) % 997 + 3 for i in range(num_tokens)]
NEW_TOKENS = 6


def cgroups_writable() -> str | None:
    """None when a child memory cgroup can be made here, else why not."""
    if not (CGROUP_ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {CGROUP_ROOT}"
    if not os.access(CGROUP_ROOT, os.W_OK):
        return f"{CGROUP_ROOT} is not writable (not root?)"
    return None


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(store_dir: Path, checkpoint_dir: Path, cgroup: Path, prompt_tokens: int) -> dict:
    (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    import numpy as np

    from k3serve.engine.generate import generate
    from k3serve.engine.sampling import SamplingParams
    from k3serve.loading import load_model
    from k3serve.stream.budget import minimum_budget_bytes
    from k3serve.stream.options import StreamOptions
    from k3serve.weights.store import PackedStore

    store = PackedStore(store_dir)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    PROMPT = prompt(prompt_tokens)
    minimum = minimum_budget_bytes(store, trunk_dtype="bf16")

    def run(ram: int | None) -> tuple[list[int], np.ndarray, str]:
        loaded = load_model(store.path, stream=StreamOptions(ram_budget=ram, trunk_dtype="bf16"))
        try:
            tokens = generate(loaded.model, PROMPT, params)[0]
            return tokens, loaded.model.logits(PROMPT), loaded.model.source.plan.lines()[0]
        finally:
            loaded.model.source.close()

    want_tokens, want_logits, _ = run(None)  # the same weights held whole (and the kernels warmed)
    resident = load_model(checkpoint_dir).model
    resident_tokens = generate(resident, PROMPT, params)[0]
    del resident
    gc.collect()
    baseline_rss = _status("VmRSS")
    usage = int((cgroup / "memory.usage_in_bytes").read_text())
    limit = usage + minimum + SLACK
    (cgroup / "memory.limit_in_bytes").write_text(str(limit))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
    tokens, logits, plan = run(minimum)
    peak_rss = _status("VmHWM")
    return {
        "minimum_bytes": minimum, "baseline_rss": baseline_rss, "peak_rss": peak_rss,
        "peak_over_baseline": peak_rss - baseline_rss, "cgroup_limit": limit, "cgroup_usage_at_start": usage,
        "cgroup_failcnt": int((cgroup / "memory.failcnt").read_text()), "plan": plan,
        "tokens": tokens, "tokens_identical": tokens == want_tokens,
        "logits_identical": bool(np.array_equal(logits, want_logits)),
        "resident_float32_tokens_identical": tokens == resident_tokens,
        "trunk_bytes": store.globals.size + sum(b.size for b in store.layers),
    }


def build_fixture(root: Path, hidden: int, trunk_precision: str = "bf16") -> tuple[Path, Path]:
    from k3serve.weights.pack import pack_checkpoint
    from k3serve.weights.proportioned import proportioned_config
    from k3serve.weights.synthetic import write_random_checkpoint

    suffix = "" if trunk_precision == "bf16" else f"-{trunk_precision}"
    checkpoint, packed = root / f"ckpt-{hidden}", root / f"packed-{hidden}{suffix}"
    if not (packed / "store.json").exists():
        if not (checkpoint / "config.json").exists():
            write_random_checkpoint(proportioned_config(hidden), checkpoint, seed=0)
        pack_checkpoint(checkpoint, packed, trunk_precision=trunk_precision)
    return checkpoint, packed


def measure(root: Path, hidden: int, prompt_tokens: int = PROMPT_TOKENS, trunk_precision: str = "bf16") -> dict:
    """Build (or reuse) the fixture under `root`, run the child in a fresh cgroup, remove the cgroup."""
    why = cgroups_writable()
    if why is not None:
        raise RuntimeError(why)
    checkpoint, packed = build_fixture(root, hidden, trunk_precision)
    cgroup = CGROUP_ROOT / f"k3serve-floor-{os.getpid()}"
    cgroup.mkdir()
    try:
        out = subprocess.run([sys.executable, __file__, "--child", str(packed), str(checkpoint), str(cgroup),
                              str(prompt_tokens)],
                             capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        if out.returncode != 0:
            oom = int((cgroup / "memory.failcnt").read_text())
            raise RuntimeError(f"the child failed (rc {out.returncode}, cgroup failcnt {oom}):\n{out.stderr[-3000:]}")
        record = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        cgroup.rmdir()
    record["hidden"], record["prompt_tokens"], record["trunk_precision"] = hidden, prompt_tokens, trunk_precision
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024, help="the fixture's hidden size (default: 1024)")
    parser.add_argument("--root", type=Path, default=None, help="where the fixture is built (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                        help=f"prompt length (default {PROMPT_TOKENS}; from 32 on the prefill widens bf16 blocks)")
    parser.add_argument("--trunk-precision", choices=("bf16", "q8_0", "mxfp4"), default="bf16",
                        help="the fixture's trunk as packed (default: bf16, as stored)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        store_dir, checkpoint_dir, cgroup, prompt_tokens = args.child
        print(json.dumps(child(Path(store_dir), Path(checkpoint_dir), Path(cgroup), int(prompt_tokens))))
        return
    root = args.root or Path(tempfile.mkdtemp(prefix="k3serve-floor-"))
    r = measure(root, args.hidden, args.prompt_tokens, args.trunk_precision)
    mib = 1 << 20
    print(f"memory floor, {r['trunk_precision']} trunk, hidden {r['hidden']}, prompt {r['prompt_tokens']}: "
          f"minimum {r['minimum_bytes'] / mib:.2f} MiB, peak RSS over the "
          f"baseline {r['peak_over_baseline'] / mib:.2f} MiB, cgroup limit {r['cgroup_limit'] / mib:.1f} MiB "
          f"(failcnt {r['cgroup_failcnt']}), tokens identical {r['tokens_identical']}, logits identical "
          f"{r['logits_identical']}, float32 resident tokens identical {r['resident_float32_tokens_identical']}")
    print(json.dumps(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
