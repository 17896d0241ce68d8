"""The answers-first overview at the top of the lab page: the headline figures, each with its verdict sentence, its
badge and the module that measures it, then every module's verdict (what each mechanism buys).

The figures come from the last stored runs: `lab/web/stored_runs.json`, shipped with the package and rewritten by
`k3serve lab run --all` (every module at its defaults, with the date, the machine and the command), and are replaced
by any run made on this server afterwards (marked with its own date). A module without a stored run or a run here
shows "not yet run". Badges:

    measured    measured on this machine, by a run on this server
    recorded    measured, but by the stored run (its date and machine say where), or a record a run shows instead
                of measuring (figures carrying `Figure.recorded`: peers without llama.cpp; the record's date)
    simulated   computed by a model (shapes, a simulator, an exact replay), wherever it ran
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3serve.host import describe_host
from k3serve.lab.verdict import judge, sentence_case

STORED_RUNS_PATH = Path(__file__).parent / "web" / "stored_runs.json"
STORED_RUNS_VERSION = 1
RUN_ALL_COMMAND = "k3serve lab run --all"


@dataclass(frozen=True)
class Headline:
    """One headline slot: the module that fills it and, for a figure the module reports among others, its metric
    (None: the module's own verdict and first metric)."""

    slot: str
    title: str
    module: str
    metric: str | None = None
    ram_gib: int | None = None  # the full K3 slots: the RAM the metric is at


HEADLINES = (
    Headline("full_k3_8gb", "The full K3 in 8 GB against the C engine", "full_scale", "s_per_token_at_8_gib", 8),
    Headline("full_k3_64gb", "The full K3 in 64 GB against the C engine", "full_scale", "s_per_token_at_64_gib", 64),
    Headline("peers", "Speed against llama.cpp on the same file", "peers"),
    Headline("serving", "Serving throughput (a real server under the openai client)", "serving"),
)


def machine_description() -> str:
    """The CPU model, its cores, the RAM and the load when asked, e.g. 'AMD EPYC, 2 cores, 23.5 GiB RAM, load 1.2'
    (k3serve.host's description; the load says how shared the machine was)."""
    host = describe_host()
    try:
        ram = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB RAM"
    except (ValueError, OSError, AttributeError):
        ram = ""
    return f"{host['cpu']}, {host['cores']} cores{ram}, load {host['load_average']:.1f}"


def stored_runs_json(records: dict[str, dict], command: str = RUN_ALL_COMMAND, model: str | None = None) -> dict:
    """The stored-runs file's content: {version, date, machine, command, model, runs: {module id: run record}};
    `model` is the lab's --model (None: the embedded model)."""
    return {"version": STORED_RUNS_VERSION,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_description(), "command": command, "model": model, "runs": records}


def stored_runs_for(stored: dict, model: str | None) -> tuple[dict, str | None]:
    """The stored runs if they were made on the lab's model (`model`: its --model, None for the embedded one), else
    none and the reason: figures of one model never stand for another's."""
    if stored.get("model") == model or not stored.get("runs"):
        return stored, None
    return empty_stored_runs(), (f"the stored runs are of {stored.get('model') or 'the embedded model'}, not of "
                                 f"{model or 'the embedded model'}: their figures are not shown")


def empty_stored_runs() -> dict:
    return {"version": STORED_RUNS_VERSION, "date": None, "machine": None, "command": RUN_ALL_COMMAND, "runs": {}}


def load_stored_runs(path: Path = STORED_RUNS_PATH) -> dict:
    """The stored runs, or none (`empty_stored_runs`) when the file is missing; a malformed file is a ValueError
    naming it."""
    if not path.is_file():
        return empty_stored_runs()
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the lab's stored runs ({exc}); rewrite it with "
                         f"`{RUN_ALL_COMMAND}`") from exc
    if not isinstance(stored, dict) or not isinstance(stored.get("runs"), dict):
        raise ValueError(f"{path}: not a stored-runs file (no 'runs' object); rewrite it with `{RUN_ALL_COMMAND}`")
    return stored


TIME_UNITS = re.compile(r"\b(ms|s|seconds?|tok/s|MiB/s)\b|per second|TTFT", re.IGNORECASE)


def is_timing(record: dict) -> bool:
    """Whether the verdict compares times measured on a machine (ms, tok/s, MiB/s): such a figure moves with the
    machine and its load, while bytes, counts, ratios of shapes and simulations repeat exactly."""
    verdict = record.get("verdict") or {}
    label = record.get("labels", {}).get(verdict.get("metric", ""), verdict.get("metric", ""))
    return bool(record.get("measured")) and bool(TIME_UNITS.search(label))


def recorded_date(record: dict) -> str | None:
    """The date of the record a result shows instead of measuring (its figures' `recorded`, see `Figure.recorded`:
    the peers module without llama.cpp), or None when the run measured or simulated its own figures."""
    return next((f["recorded"] for f in record.get("series", []) if f.get("recorded")), None)


def _badge(record: dict, stored: bool) -> str:
    if not record.get("measured"):
        return "simulated"
    return "recorded" if stored or recorded_date(record) else "measured"


def _first_metric(record: dict) -> tuple[str, float | None, float | None]:
    verdict = record.get("verdict") or {}
    key = verdict.get("metric") if verdict.get("metric") in record["metrics"] else next(iter(record["metrics"]), "")
    return key, record["metrics"].get(key), record["baseline"].get(key)


def _entry(record: dict | None, stored: dict, from_store: bool) -> dict:
    """Where a figure came from: its badge, date, machine and command."""
    if record is None:
        return {"status": "not yet run"}
    entry = {"status": "done", "badge": _badge(record, from_store), "timing": is_timing(record),
             "date": record.get("date") or stored.get("date"),
             "machine": stored.get("machine") if from_store else "this machine",
             "source": "stored run" if from_store else "run on this server", "command": record.get("command", ""),
             "recorded": recorded_date(record)}
    if entry["recorded"]:  # figures measured earlier, elsewhere: their date; their source line names the machine
        entry.update(date=entry["recorded"], machine=None)
    return entry


def _full_k3_headline(headline: Headline, record: dict) -> dict:
    """k3serve's seconds per token at the slot's RAM against the C engine's, and its own verdict there."""
    ours, theirs = record["metrics"].get(headline.metric), record["baseline"].get(headline.metric)
    module_verdict = record.get("verdict") or {}
    ladder = module_verdict.get("flips_when", "")
    if theirs is None:
        return {"value": None, "baseline": None, "text": "not in this run (the RAM ladder was off)",
                "verdict": module_verdict or None}
    if ours is None or not math.isfinite(ours):
        sentence = (f"k3serve lost here: it does not fit {headline.ram_gib} GiB, where the C engine's published "
                    f"split takes {theirs:.1f} s per token." + (f" {sentence_case(ladder)}." if ladder else ""))
        verdict = {"outcome": "lost", "factor": None, "metric": headline.metric, "sentence": sentence,
                   "flips_when": ladder}
        text = f"k3serve: does not fit; C engine: {theirs:.1f} s/token"
    else:
        judged = judge(f"k3serve at {headline.ram_gib} GiB", "the C engine's published split", headline.metric,
                       "time per token", ours, theirs, higher_is_better=False, flips_when=ladder)
        verdict = {"outcome": judged.outcome, "factor": judged.factor if math.isfinite(judged.factor) else None,
                   "metric": judged.metric, "sentence": judged.sentence, "flips_when": judged.flips_when}
        text = f"k3serve: {ours:.1f} s/token; C engine: {theirs:.1f} s/token"
    return {"value": ours, "baseline": theirs, "unit": "s/token", "text": text, "verdict": verdict}


def _module_headline(record: dict) -> dict:
    key, value, base = _first_metric(record)
    label = record.get("labels", {}).get(key, key)
    return {"value": value, "baseline": base, "label": label, "metric": key, "metrics_name": record.get("metrics_name"),
            "baseline_name": record.get("baseline_name"), "verdict": record.get("verdict")}


def overview(modules: list[dict], stored: dict, latest: dict[str, dict]) -> dict:
    """The overview: `modules` is the page's module list (id, number, title), `stored` the stored runs, `latest`
    this server's latest finished run of each module (which replaces the stored one)."""
    stored_runs = stored.get("runs", {})

    def record_of(module_id: str) -> tuple[dict | None, bool]:
        if module_id in latest:
            return latest[module_id], False
        return stored_runs.get(module_id), True

    titles = {m["id"]: m["title"] for m in modules}
    headlines = []
    for headline in HEADLINES:
        record, from_store = record_of(headline.module)
        entry = {"slot": headline.slot, "title": headline.title, "module": headline.module,
                 "module_title": titles.get(headline.module), **_entry(record, stored, from_store)}
        if record is not None:
            entry.update(_full_k3_headline(headline, record) if headline.metric else _module_headline(record))
        headlines.append(entry)
    rows = []
    for module in modules:
        record, from_store = record_of(module["id"])
        row = {"module": module["id"], "number": module["number"], "title": module["title"],
               **_entry(record, stored, from_store)}
        if record is not None:
            row.update(_module_headline(record))
        rows.append(row)
    return {"stored": {"date": stored.get("date"), "machine": stored.get("machine"), "command": stored.get("command"),
                       "modules": len(stored_runs)},
            "headlines": headlines, "modules": rows}


def verdicts_markdown(stored: dict) -> str:
    """The stored runs' verdicts as the table in docs/LAB.md: exact figures quoted, timings marked as such.

        python -c "from k3serve.lab.overview import *; print(verdicts_markdown(load_stored_runs()))"
    """
    lines = [f"Stored runs of {stored['date'][:10]} on {stored['machine']} (`{stored['command']}`):", "",
             "| # | module | outcome | verdict at the defaults |", "|---|---|---|---|"]
    for number, (module_id, record) in enumerate(stored["runs"].items(), start=1):
        verdict = record["verdict"]
        text = verdict["sentence"]
        if is_timing(record):
            text = f"a timing (it moves with the machine and its load); in the stored run: {text}"
        lines.append(f"| {number} | `{module_id}` | {verdict['outcome']} | {text} |")
    return "\n".join(lines)


def clean(value: Any) -> Any:
    """`value` with every non-finite float as None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value
