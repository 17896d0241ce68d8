"""18. Peers on the same work: k3serve and llama.cpp on the same GGUF file, in RAM and under a memory limit."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
from pathlib import Path

import numpy as np

from k3serve.errors import K3Error
from k3serve.lab.registry import Figure, LabModule, LabResult, Param, Verdict
from k3serve.lab.streaming import WIDENINGS
from k3serve.lab.timing import repeats_param
from k3serve.lab.verdict import sentence_case

ENGINES = ("k3serve", "llama.cpp")
ROWS = ("in RAM", "under RAM")
KEYS = ("decode_tok_s", "prefill_tok_s", "peak_rss_mib")
EVEN_BAND = 0.05
RECORDED = Path(__file__).resolve().parents[1] / "recorded" / "peers.json"


# ------------------------------------------------------------------------------------------------ live
def _limits(lab) -> dict[str, tuple[float, float]]:
    return {"threads": (1, os.cpu_count() or 1)}


def _pack(gguf: Path, out: Path) -> Path:
    from k3serve.lab.fixtures import _atomic_dir
    from k3serve.weights.pack import pack_checkpoint

    return _atomic_dir(out, lambda staging: pack_checkpoint(gguf, staging))


def _k3serve_budget(store: Path, fraction: float) -> tuple[int, int]:
    """(the RAM budget k3serve streams under, fraction x the store's bytes): the larger of that share and the
    plan's minimum at the default trunk dtype (a bf16 trunk's widening transient alone can exceed half a tiny store)."""
    from k3serve.stream.budget import minimum_budget_bytes
    from k3serve.stream.options import StreamOptions
    from k3serve.weights.store import PackedStore

    share = int(fraction * _store_bytes(store))
    return max(share, minimum_budget_bytes(PackedStore(store), None, StreamOptions().trunk_dtype)), share


def _store_bytes(store: Path) -> int:
    from k3serve.weights.store import PackedStore

    packed = PackedStore(store)
    return packed.trunk_path.stat().st_size + packed.expert_path.stat().st_size


def measure_live(params, progress, cancel, lab) -> dict:
    """The comparison on this machine: {"rows": {row: {engine: medians}}, "runs", "limits_mib", ...}."""
    from k3serve.lab import peers

    inner, latent = WIDENINGS[params["experts"]]
    folder = lab.root / "peers"
    progress(0.01, "llama.cpp's converter: the lab model to GGUF (once; it imports torch)")
    tree = peers.converter_tree(folder / "llama_cpp_src")
    cancel.check()
    gguf = peers.build_gguf(lab.widened_dir(inner, latent), tree, folder / f"k3-x{inner}-x{latent}.gguf")
    cancel.check()
    store = _pack(gguf, folder / f"packed-from-gguf-x{inner}-x{latent}")
    weights = gguf.stat().st_size
    vocab = lab.config.vocab_size
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, vocab - 8, params["prompt_tokens"])]
    spec = {"gguf": str(gguf), "store": str(store), "prompt": prompt, "threads": params["threads"],
            "decode_tokens": params["decode_tokens"]}
    repeats = params["repeats"]
    cgroup = peers.cgroup_problem() if params["under_ram"] else "not asked for (--param under_ram=false)"
    steps = repeats * 2 * (2 if cgroup is None else 1)
    done = 0

    def step(message: str) -> None:
        nonlocal done
        cancel.check()
        progress(0.05 + 0.93 * done / steps, message)
        done += 1

    runs: dict[str, dict[str, list[dict]]] = {row: {e: [] for e in ENGINES} for row in ROWS}
    # NOTE: no warm-up process: each fresh process warms itself up (the load, numba's kernel cache, an untimed
    # prefill and decode step) before it times anything (peers.py)
    for r in range(repeats):  # alternated, one fresh process per run
        for engine in ENGINES:
            step(f"in RAM, repeat {r + 1}: {engine}")
            runs["in RAM"][engine].append(peers.measure(engine, spec))
    medians = {row: {e: {k: statistics.median(x[k] for x in rs) for k in KEYS} if rs else None
                     for e, rs in by_engine.items()} for row, by_engine in runs.items()}
    limits: dict[str, float] = {}
    failures: list[str] = []
    if cgroup is None:
        withheld = (1 - params["ram_fraction"]) * weights
        budget, share = _k3serve_budget(store, params["ram_fraction"])
        for engine in ENGINES:  # each engine gets its own in-RAM peak minus the same withheld weight bytes
            limits[engine] = medians["in RAM"][engine]["peak_rss_mib"] * 2**20 - withheld
        for r in range(repeats):
            for engine in ENGINES:
                step(f"under RAM, repeat {r + 1}: {engine} in a {limits[engine] / 2**20:.0f} MiB memory cgroup")
                files = [gguf] if engine == "llama.cpp" else [store / "trunk.bin", store / "experts.bin"]
                peers.evict(files)
                run_spec = {**spec, "ram_budget": budget} if engine == "k3serve" else spec
                try:
                    with peers.memory_cgroup(int(limits[engine])) as group:
                        runs["under RAM"][engine].append(peers.measure(engine, run_spec, group))
                except K3Error as error:
                    failures.append(f"{engine} under RAM, repeat {r + 1}: {error}")
        medians["under RAM"] = {e: {k: statistics.median(x[k] for x in rs) for k in KEYS} if rs else None
                                for e, rs in runs["under RAM"].items()}
    else:
        medians["under RAM"] = {e: None for e in ENGINES}
    from k3serve.host import describe_host

    return {"rows": medians, "runs": runs, "limits_mib": {e: v / 2**20 for e, v in limits.items()},
            "under_ram_skipped": cgroup, "failures": failures, "weights_mib": weights / 2**20,
            "k3serve_ram_budget_mib": budget / 2**20 if cgroup is None else None,
            "k3serve_ram_share_mib": share / 2**20 if cgroup is None else None,
            "gguf": gguf.name, "machine": describe_host(), "params": dict(params),
            "date": datetime.date.today().isoformat()}


# ------------------------------------------------------------------------------------------------ recorded
def load_recorded(path: Path = RECORDED) -> dict:
    """The last recorded comparison (written by `python -m k3serve.lab.modules.peers --record`)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise K3Error(f"no recorded peer figures at {path}, and the live comparison cannot run here") from None


# ------------------------------------------------------------------------------------------------ the result
def _ratio(rows: dict, row: str, key: str) -> float:
    ours, theirs = rows[row]["k3serve"], rows[row]["llama.cpp"]
    if not ours or not theirs or not theirs[key]:
        return float("nan")
    return ours[key] / theirs[key]


def _verdict(rows: dict, limits_mib: dict) -> Verdict:
    """k3serve's decode speed against llama.cpp's in RAM; it flips where k3serve's step time crosses llama.cpp's,
    or (when measured) where the other row's ratio lands on the other side of 1. Worded as `verdict.judge` words
    the other modules' verdicts (the outcome, the factor, then the flip condition as a sentence)."""
    factor = _ratio(rows, "in RAM", "decode_tok_s")
    outcome = "even" if abs(factor - 1) <= EVEN_BAND else ("won" if factor > 1 else "lost")
    ours_ms = 1e3 / rows["in RAM"]["k3serve"]["decode_tok_s"]
    theirs_ms = 1e3 / rows["in RAM"]["llama.cpp"]["decode_tok_s"]
    head = {"won": "k3serve won here", "lost": "k3serve lost here",
            "even": "k3serve was even with llama.cpp here"}[outcome]
    sentence = f"{head}: it decoded {factor:.2f}x llama.cpp's speed on the same file (batch 1, in RAM)"
    under = _ratio(rows, "under RAM", "decode_tok_s")
    if np.isfinite(under):
        sentence += f", and {under:.2f}x under a memory limit"
    direction = "rose above" if factor > 1 else "fell below"
    flips = (f"it would flip if k3serve's decode step {direction} llama.cpp's {theirs_ms:.1f} ms (it took "
             f"{ours_ms:.1f} ms)")
    if np.isfinite(under) and (under > 1) != (factor > 1):
        flips += (f"; it already flips under RAM ({under:.2f}x with {limits_mib.get('k3serve', float('nan')):.0f} "
                  f"and {limits_mib.get('llama.cpp', float('nan')):.0f} MiB limits)")
    return Verdict(outcome, factor, "decode_tok_s", f"{sentence}. {sentence_case(flips)}.", flips)


def build_result(measured: dict, recorded: str | None, why_recorded: str = "") -> LabResult:
    rows, limits = measured["rows"], measured.get("limits_mib", {})
    p = measured["params"]
    shown = [row for row in ROWS if all(rows[row][e] for e in ENGINES)]
    where = f"recorded {recorded} on {measured['machine']['cpu']} ({measured['machine']['cores']} cores): " \
        if recorded else ""
    source = (f"{where}the lab model (experts widened {p['experts']}) as one GGUF ({measured['gguf']}, "
              f"{measured['weights_mib']:.1f} MiB, llama.cpp's converter), a {p['prompt_tokens']}-token prompt then "
              f"{p['decode_tokens']} greedy steps at batch 1, {p['threads']} threads each, fresh processes, "
              f"alternated, medians of {p['repeats']}" + ("" if recorded else " on this machine"))

    def bars(title: str, key: str, label: str) -> Figure:
        return Figure(title, "bar", True, source,
                      [{"name": e, "x": shown, "y": [rows[row][e][key] for row in shown]} for e in ENGINES],
                      y_label=label, highlight="k3serve", recorded=recorded)

    figures = [bars("Decode speed, batch 1", "decode_tok_s", "decoded tokens per second (tok/s)"),
               bars(f"Prefill speed, {p['prompt_tokens']}-token prompt", "prefill_tok_s",
                    "prompt tokens per second (tok/s)"),
               bars("Peak resident memory (VmHWM)", "peak_rss_mib", "peak RSS (MiB)")]
    ratios = {row: {k: _ratio(rows, row, k) for k in KEYS} for row in shown}
    figures.append(Figure("k3serve / llama.cpp", "bar", True, source,
                          [{"name": row, "x": ["decode", "prefill", "peak RSS"],
                            "y": [ratios[row][k] for k in KEYS]} for row in shown],
                          y_label="k3serve over llama.cpp (x)", recorded=recorded))
    metrics = {k: rows["in RAM"]["k3serve"][k] for k in KEYS}
    baseline = {k: rows["in RAM"]["llama.cpp"][k] for k in KEYS}
    labels = {"decode_tok_s": "decode, batch 1, in RAM (tok/s)", "prefill_tok_s": "prefill, in RAM (tok/s)",
              "peak_rss_mib": "peak RSS, in RAM (MiB)"}
    if "under RAM" in shown:
        for k in KEYS:
            metrics[f"under_ram_{k}"] = rows["under RAM"]["k3serve"][k]
            baseline[f"under_ram_{k}"] = rows["under RAM"]["llama.cpp"][k]
        labels.update({"under_ram_decode_tok_s": "decode under RAM (tok/s)",
                       "under_ram_prefill_tok_s": "prefill under RAM (tok/s)",
                       "under_ram_peak_rss_mib": "peak RSS under RAM (MiB)"})
    verdict = _verdict(rows, limits)
    notes = []
    if recorded:
        notes.append(f"recorded figures, not measured by this run: {why_recorded} They were measured on "
                     f"{recorded} by `{measured['command']}` on {measured['machine']['cpu']} "
                     f"({measured['machine']['cores']} cores, load average {measured['machine']['load_average']:.1f})")
    notes.append(verdict.sentence)
    for row in shown:
        r = ratios[row]
        notes.append(f"{row}: k3serve / llama.cpp decode {r['decode_tok_s']:.2f}x, prefill {r['prefill_tok_s']:.2f}x, "
                     f"peak RSS {r['peak_rss_mib']:.2f}x")
    if limits:
        budget_mib, share_mib = measured["k3serve_ram_budget_mib"], measured.get("k3serve_ram_share_mib")
        raised = (f", the plan's minimum: {p['ram_fraction']:.0%} of the store, {share_mib:.1f} MiB, is below it"
                  if share_mib is not None and budget_mib > share_mib else "")
        notes.append(f"under RAM: each engine in a cgroup-v1 memory group (page cache counted) limited to its own "
                     f"in-RAM peak RSS minus {1 - p['ram_fraction']:.0%} of the weights: k3serve "
                     f"{limits['k3serve']:.0f} MiB (streaming from a store packed from the GGUF, RAM budget "
                     f"{budget_mib:.1f} MiB{raised}), llama.cpp {limits['llama.cpp']:.0f} MiB (the "
                     "GGUF memory-mapped); the files' pages evicted before each run")
    if measured.get("under_ram_skipped"):
        notes.append(f"under RAM skipped: {measured['under_ram_skipped']}")
    notes += measured.get("failures", [])
    notes.append("each engine at its own defaults but the thread count (both get --param threads); llama.cpp with "
                 "use_extra_bufts off (its AMX repack crashed on this project's CPU); token ids fed to both "
                 "(placeholder vocabulary in the GGUF)")
    return LabResult(metrics, baseline, figures, labels, metrics_name="k3serve", baseline_name="llama.cpp",
                     notes=notes, verdict=verdict,
                     related_commands=["python benchmarks/bench_peers.py --rounds 3",
                                       "python benchmarks/bench_peers.py --memory-limits 768M,1G --rounds 3",
                                       "python benchmarks/bench_families_peers.py --rounds 3"])


def run(params, progress, cancel, lab) -> LabResult:
    from k3serve.lab import peers

    why = "--param source=recorded." if params["source"] == "recorded" else None
    if why is None:
        why = peers.llama_cpp_missing()
    if why is None:
        try:
            peers.converter_tree(lab.root / "peers" / "llama_cpp_src")
        except peers.PeerUnavailable as error:
            why = str(error)
    if why is not None:
        progress(0.5, "llama.cpp is not available here: showing the recorded figures")
        stored = load_recorded()
        progress(1.0, "done")
        return build_result(stored, stored["date"], why if why.endswith(".") else why + ".")
    measured = measure_live(params, progress, cancel, lab)
    progress(1.0, "done")
    return build_result(measured, None)


MODULE = LabModule(
    id="peers", number=18, title="Peers on the same work",
    summary="k3serve and llama.cpp on the same GGUF file: decode and prefill tok/s and peak RSS, in RAM and under a "
            "memory limit.",
    explanation=(
        "The same weights, two engines. The lab model is converted to GGUF by llama.cpp's own converter "
        "(MXFP4 experts repacked without requantizing, bf16 trunk), and both engines load that one file: "
        "llama.cpp memory-maps it, k3serve reads it as a K3 checkpoint. Each run is a fresh process (load, an "
        "untimed warm-up, then a timed prefill and greedy decode at batch 1), the engines alternate, and the "
        "figures are medians. Under RAM, each engine runs in a memory cgroup whose limit is its own in-RAM peak "
        "minus part of the weights: llama.cpp's mmap then pages weights in and out through the page cache, while "
        "k3serve streams experts from a store packed from the same GGUF into a RAM budget. Without llama.cpp "
        "(the optional `peers` extra) the module shows the last recorded figures, marked with their date."),
    params=(Param("source", "choice", "auto", "auto: measure if llama.cpp is installed, else show the recorded "
                  "figures; recorded: always the recorded ones", choices=("auto", "recorded")),
            Param("experts", "choice", "1x", "experts widened (exactly: the same routing), for more weight bytes",
                  choices=tuple(WIDENINGS)),
            Param("prompt_tokens", "int", 32, "prompt for the prefill figure", min=16, max=1024, unit="tokens"),
            Param("decode_tokens", "int", 16, "greedy decode steps timed", min=2, max=256, unit="tokens"),
            Param("threads", "int", 2, "threads for each engine", min=1, max=256),
            Param("under_ram", "bool", True, "also run under a memory cgroup (needs root and cgroup v1)"),
            Param("ram_fraction", "float", 0.5, "under RAM: the share of the weights that fits", min=0.1, max=0.9),
            repeats_param()),
    kind="measured", run=run, limits=_limits)


def _record(argv: list[str]) -> int:
    """`python -m k3serve.lab.modules.peers [--param NAME=VALUE ...]`: measure live and store the result as the
    recorded figures (k3serve/lab/recorded/peers.json), with its date and this command."""
    import argparse

    from k3serve.lab import peers
    from k3serve.lab.fixtures import LabFixtures
    from k3serve.lab.registry import CancelToken

    parser = argparse.ArgumentParser(description=_record.__doc__)
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)
    lab = LabFixtures()
    params = MODULE.validate(dict(item.split("=", 1) for item in args.param), lab)
    if params["source"] != "auto" or (why := peers.llama_cpp_missing()) is not None:
        raise SystemExit(why or "recording measures live: leave source at auto")
    measured = measure_live(params, lambda f, m: print(f"[{100 * f:5.1f}%] {m}", flush=True), CancelToken(), lab)
    measured["command"] = " ".join(shlex.quote(x) for x in ["python", "-m", "k3serve.lab.modules.peers", *argv])
    RECORDED.parent.mkdir(parents=True, exist_ok=True)
    RECORDED.write_text(json.dumps(measured, indent=1) + "\n")
    print(f"wrote {RECORDED}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_record(sys.argv[1:]))
