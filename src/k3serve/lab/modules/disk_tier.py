"""20. The prefix cache's disk tier: TTFT of a returning conversation restored from NVMe against recomputed, as the
prefix grows; and the same at full scale, from the simulator."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np

from k3serve.config import full_k3_config
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.lab.registry import Figure, LabModule, LabResult, Param
from k3serve.lab.timing import WARM_UP_MESSAGE, repeats_param
from k3serve.lab.verdict import crossing, judge
from k3serve.lab.workloads import run_all
from k3serve.sim.returning import checkpoint_bytes

REPLY_TOKENS = 8  # turn 1's reply
NEW_TOKENS = 32  # the returning turn's new message
MAX_MODEL_LEN = 4096
SIM_RECORD = "disk_tier_sim.json"  # lab/recorded/: `k3serve sim k3 --returning-prompt 4096` at 8 and 64 GiB
STREAMED_BUDGETS = {"streamed-4MiB": 4 << 20, "streamed-8MiB": 8 << 20}  # the weights' RAM budget


def _finish(engine: LLMEngine, request_id: str):
    """Step the engine until nothing is left; the final output of `request_id`."""
    return run_all(engine)[request_id]


class _Conversation:
    """Turn 1 of a prefix_tokens-token conversation in an engine whose RAM tier holds 2 checkpoints, pushed out of
    RAM by two unrelated requests (to the disk tier when it has one); then returning turns, each timed."""

    def __init__(self, loaded, folder: str | None, o_direct: bool, prefix_tokens: int, seed: int) -> None:
        self.model = loaded.model
        config = EngineConfig(max_seqs=4, max_batch_tokens=2048, max_model_len=MAX_MODEL_LEN,
                              kv_cache_bytes=64 << 20, num_state_checkpoints=2,
                              prefix_cache_dir=folder, prefix_cache_disk_bytes=1 << 30 if folder else 0)
        self.engine = LLMEngine(self.model, config, stop_ids=(),
                                model_identity=loaded.identity if folder else None)
        self.disk = self.engine.scheduler.prefix_cache.disk
        if self.disk is not None and not o_direct:
            self.disk.direct = False  # through the page cache: a repeat's read may come from memory
        rng = np.random.default_rng(seed)
        vocab = self.model.config.vocab_size
        self.rng, self.vocab = rng, vocab
        prompt = [int(t) for t in rng.integers(3, vocab, prefix_tokens)]
        first = _finish(self.engine, self.engine.add_request(prompt, SamplingParams(max_tokens=REPLY_TOKENS,
                                                                                    ignore_eos=True)))
        self.history = prompt + list(first.outputs[0].token_ids)
        for _ in range(2):
            _finish(self.engine, self.engine.add_request([int(t) for t in rng.integers(3, vocab, 24)],
                                                         SamplingParams(max_tokens=REPLY_TOKENS, ignore_eos=True)))

    def returning_turn(self) -> dict:
        """One returning turn (the history plus NEW_TOKENS new ones, each turn its own), its RAM tier emptied first:
        the prefix comes from disk or is computed again. The first token's time is the figure."""
        self.engine.scheduler.prefix_cache.clear()
        turn = self.history + [int(t) for t in self.rng.integers(3, self.vocab, NEW_TOKENS)]
        read_before = self.engine.metrics.counter("prefix_cache_disk_read_bytes", "").value
        out = _finish(self.engine, self.engine.add_request(turn, SamplingParams(max_tokens=1, ignore_eos=True)))
        return {"ttft_s": out.ttft_seconds, "cached_tokens": out.num_cached_tokens, "turn_tokens": len(turn),
                "disk_read_bytes": self.engine.metrics.counter("prefix_cache_disk_read_bytes", "").value - read_before}


def _recompute(loaded, turn_tokens: int, seed: int) -> float:
    """TTFT of a turn_tokens-token prompt with no prefix cache at all: every position computed."""
    model = loaded.model
    engine = LLMEngine(model, EngineConfig(max_seqs=4, max_batch_tokens=2048, max_model_len=MAX_MODEL_LEN,
                                           kv_cache_bytes=64 << 20, enable_prefix_caching=False), stop_ids=())
    prompt = [int(t) for t in np.random.default_rng(seed).integers(3, model.config.vocab_size, turn_tokens)]
    return _finish(engine, engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))).ttft_seconds


def _sim_record() -> dict:
    return json.loads(resources.files("k3serve.lab").joinpath("recorded", SIM_RECORD).read_text())


def _scratch_folder(root: Path) -> tempfile.TemporaryDirectory:
    """A fresh folder for this run's tiers under `root`, after removing those of runs whose process is gone (a
    cancelled run's worker is killed before its `TemporaryDirectory` can clean up)."""
    root.mkdir(parents=True, exist_ok=True)
    for folder in root.glob("run-*-*"):
        pid = folder.name.split("-")[1]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"run-{os.getpid()}-", dir=root)


def _sweep(prefix_tokens: int) -> list[int]:
    return sorted({max(16, prefix_tokens // 8), max(16, prefix_tokens // 2), prefix_tokens})


def _weights(lab, choice: str):
    """The lab's model resident, or its packed store streamed under a RAM budget (a `LoadedModel`; the caller closes
    a streamed one's source)."""
    if choice == "resident":
        return lab.loaded()
    from k3serve.loading import load_model
    from k3serve.stream.options import StreamOptions

    return load_model(lab.packed("natural"), stream=StreamOptions(ram_budget=STREAMED_BUDGETS[choice]))


def run(params, progress, cancel, lab) -> LabResult:
    progress(0.01, "loading the model (a packed store is built on first use)")
    loaded = _weights(lab, params["weights"])
    try:
        return _run(params, progress, cancel, lab, loaded)
    finally:
        if params["weights"] != "resident":
            loaded.model.source.close()


def _run(params, progress, cancel, lab, loaded) -> LabResult:
    tier = params["disk_tier"]
    prefixes = _sweep(params["prefix_tokens"])
    repeats = params["repeats"]
    with _scratch_folder(Path(lab.root) / "disk-tier-runs") as scratch:
        def conversation(n: int, seed: int) -> _Conversation:
            folder = str(Path(scratch) / f"tier-{n}-{seed}") if tier else None
            return _Conversation(loaded, folder, params["o_direct"], n, seed)

        progress(0.02, WARM_UP_MESSAGE)
        warm = conversation(64, 99)
        warm.returning_turn()
        _recompute(loaded, 64 + REPLY_TOKENS + NEW_TOKENS, 99)
        rows: dict[int, dict] = {}
        total = len(prefixes) * repeats
        for i, n in enumerate(prefixes):
            cancel.check()
            progress(0.05 + 0.9 * i * repeats / total, f"prefix {n} tokens: turn 1 and two requests that evict it")
            talk = conversation(n, i)
            turns, recomputed = [], []
            for r in range(repeats):  # alternated: restored, recomputed, restored, ...
                cancel.check()
                progress(0.05 + 0.9 * (i * repeats + r) / total, f"prefix {n} tokens: round {r + 1} of {repeats}")
                turns.append(talk.returning_turn())
                recomputed.append(_recompute(loaded, turns[-1]["turn_tokens"], 1000 + r))
            direct = bool(talk.disk.direct) if talk.disk is not None else False
            rows[n] = {"restored_ms": 1e3 * statistics.median(t["ttft_s"] for t in turns),
                       "recomputed_ms": 1e3 * statistics.median(recomputed),
                       "cached_tokens": min(t["cached_tokens"] for t in turns),
                       "disk_read_bytes": statistics.median(t["disk_read_bytes"] for t in turns),
                       "turn_tokens": turns[-1]["turn_tokens"], "o_direct": direct}
    n = params["prefix_tokens"]
    chosen = rows[n]
    arm = "restored from the disk tier" if tier else "prefix cache in RAM only (tier off)"
    weights = ("resident (weights in RAM)" if params["weights"] == "resident" else
               f"packed and its experts and trunk streamed under a RAM budget of {params['weights'].split('-')[1]}")
    source = (f"{lab.model_name}, {weights}; the prefix cache's RAM tier: 2 checkpoints; turn 1 of N "
              f"tokens + {REPLY_TOKENS} generated, two short requests that push its checkpoint out of RAM, then the "
              f"returning turn (N + {REPLY_TOKENS} + {NEW_TOKENS} tokens, RAM tier emptied before each); disk tier "
              f"{'on, O_DIRECT ' + ('on' if chosen['o_direct'] else 'off (page cache)') if tier else 'off'}; "
              f"recomputed = the same turn with no prefix cache; medians of {repeats} alternated rounds")
    figures = [
        Figure("Time to first token of a returning conversation, by prefix length", "line", True, source,
               [{"name": arm, "x": prefixes, "y": [rows[p]["restored_ms"] for p in prefixes]},
                {"name": "recomputed", "x": prefixes, "y": [rows[p]["recomputed_ms"] for p in prefixes]}],
               x_label="prefix length (tokens)", y_label="time to first token (ms)", highlight=arm)]
    if tier:
        figures.append(Figure(
            "Bytes read back per restore, by prefix length", "line", True,
            source + "; beside it the checkpoint file the formula of sim/returning.py gives at that position",
            [{"name": "read from the disk tier", "x": prefixes, "y": [rows[p]["disk_read_bytes"] / 2**20
                                                                      for p in prefixes]},
             {"name": "formula: KDA state + MLA rows x position", "x": prefixes,
              "y": [checkpoint_bytes(lab.config, rows[p]["cached_tokens"]).file_bytes / 2**20 for p in prefixes]}],
            x_label="prefix length (tokens)", y_label="read per restore (MiB)"))
    sim = _sim_record()
    sim_rows = sim["rows"]
    rams = [r["ram"].replace("G", " GiB") for r in sim_rows]  # "8G" as `--ram` took it: 8 GiB
    figures.append(Figure(
        f"Full K3 (simulated): a returning {sim['prompt_tokens']}-token prompt on {sim['machine']}", "bar", False,
        f"full K3 shapes (full_k3_config), `{sim['command']}` at each RAM size ({sim['date']}): restore = one "
        f"checkpoint file read from NVMe + its blake2b check + the new position's step through streamed experts; "
        f"recompute = the prefill of every position in 2048-position steps",
        [{"name": "restored from NVMe", "x": rams, "y": [r["restore_seconds"] for r in sim_rows]},
         {"name": "recomputed", "x": rams, "y": [r["recompute_seconds"] for r in sim_rows]}],
        y_label="time to first token (s)", highlight="restored from NVMe"))
    metrics = {"ttft_ms": chosen["restored_ms"], "cached_tokens": float(chosen["cached_tokens"]),
               "disk_read_bytes": float(chosen["disk_read_bytes"]), "o_direct": float(chosen["o_direct"])}
    baseline = {"ttft_ms": chosen["recomputed_ms"], "cached_tokens": 0.0, "disk_read_bytes": 0.0, "o_direct": 0.0}
    labels = {"ttft_ms": f"TTFT of the returning turn at {n} tokens of prefix (ms)",
              "cached_tokens": "positions restored (not computed)", "disk_read_bytes": "bytes read from the disk tier",
              "o_direct": "O_DIRECT used (1) or the page cache (0)"}
    restored = [rows[p]["restored_ms"] for p in prefixes]
    recomputed = [rows[p]["recomputed_ms"] for p in prefixes]
    meet = crossing(prefixes, restored, recomputed, higher_is_better=False)
    # below the sweep: a restore costs about what it costs at the shortest prefix (the KDA state is constant and the
    # rows are small beside it), a recompute about the shortest prefix's time per position (prefill grows faster
    # than linearly with attention, so the shortest prefix's rate is the one that holds further down)
    shortest = prefixes[0]
    rate = recomputed[0] / shortest  # ms per position
    model = (f"at {shortest} tokens a restore took {restored[0]:.1f} ms and a recompute {1e3 * rate:.1f} ms per 1,000 "
             f"positions")
    if not tier:
        flips_when = "with the disk tier on, the returning turn would restore its prefix instead of computing it"
    elif meet is not None:
        flips_when = f"restoring and recomputing meet at about {meet:.0f} tokens of prefix in the sweep; {model}"
    elif restored[0] < recomputed[0]:
        flips_when = (f"it would lose below about {restored[0] / rate:.0f} tokens of prefix, where reading and "
                      f"checking the checkpoint takes longer than computing the positions it saves: {model}")
    else:
        flips_when = f"it did not win at any prefix swept; it would from where a recompute outgrows a restore: {model}"
    full = [f"{r['ram'].replace('G', ' GiB')}: {r['restore_seconds']:.1f} s restored vs {r['recompute_seconds']:.1f} s recomputed "
            f"({r['recompute_seconds'] / r['restore_seconds']:.1f}x)" for r in sim_rows]
    verdict = judge("The disk tier" if tier else "The RAM-only prefix cache", "recomputing the prefix", "ttft_ms",
                    f"time to first token at {n} tokens of prefix", chosen["restored_ms"], chosen["recomputed_ms"],
                    higher_is_better=False, flips_when=flips_when)
    progress(1.0, "done")
    k3 = checkpoint_bytes(full_k3_config(), sim["prompt_tokens"])
    notes = [f"restore vs recompute at {p} tokens: {rows[p]['recomputed_ms'] / rows[p]['restored_ms']:.2f}x "
             f"({rows[p]['cached_tokens']} positions restored, {rows[p]['disk_read_bytes'] / 2**20:.2f} MiB read)"
             for p in prefixes]
    notes += [f"full K3 (simulated, {sim['machine']}): one checkpoint at {sim['prompt_tokens']} positions is "
              f"{k3.file_bytes / 1e9:.3f} GB on disk (KDA state {k3.kda_state_bytes / 1e9:.3f} GB whatever the "
              f"length, MLA rows {k3.mla_row_bytes / 1e9:.3f} GB); " + "; ".join(full),
              "the embedded model is resident here, so recompute costs compute only; with weights=streamed every "
              "recomputed position also routes through experts read from disk (as benchmarks/bench_prefix_disk.py "
              "measures), and the simulated figure shows that at full scale" if params["weights"] == "resident" else
              f"weights {params['weights']}: every recomputed position routes through experts and trunk layers read "
              "from the packed store (through the page cache, which may hold them: this machine's time with a warm "
              "cache)"]
    return LabResult(metrics, baseline, figures, labels, metrics_name=arm, baseline_name="recomputed",
                     verdict=verdict, notes=notes,
                     related_commands=["python benchmarks/bench_prefix_disk.py --prompt-tokens 4000 --runs 3",
                                       sim["command"]])


MODULE = LabModule(
    id="disk_tier", number=20, title="The prefix cache's disk tier",
    summary="A returning conversation whose checkpoint left RAM: its prefix read back from NVMe against computed "
            "again, as the prefix grows.",
    explanation=(
        "A KDA layer's state after position p folds in every token before p, so a hybrid prefix cache can only "
        "resume at a saved checkpoint. When a checkpoint leaves RAM, the disk tier writes it whole (every MLA "
        "latent row under it and every KDA state, O_DIRECT, checksummed) and a later hit reads it back: "
        "restore ~ (KDA state + p x MLA row bytes) / disk rate, against recompute ~ p / prefill rate. The KDA "
        "state is constant, so short prefixes may not pay; long ones do, more so when every recomputed position "
        "must stream experts from disk."),
    params=(Param("prefix_tokens", "int", 2048, "the longest prefix of the sweep (also N/8 and N/2)", min=128,
                  max=MAX_MODEL_LEN - REPLY_TOKENS - NEW_TOKENS, unit="tokens"),
            Param("disk_tier", "bool", True, "the disk tier on (off: the RAM tier alone)"),
            Param("o_direct", "bool", True, "the tier reads and writes with O_DIRECT (off: through the page cache)"),
            Param("weights", "choice", "resident", "the model resident, or streamed from its packed store under a "
                  "RAM budget (every recomputed position then routes through experts read from disk)",
                  choices=("resident", *STREAMED_BUDGETS)),
            repeats_param(help="alternated rounds (medians)")),
    kind="both", run=run)
