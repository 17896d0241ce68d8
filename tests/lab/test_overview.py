"""The overview: which record fills each slot (a run here over the stored one), its badge, the full K3 slots'
figures and verdicts, and the shipped stored runs (every module at its defaults, each with a verdict)."""

from __future__ import annotations

import json
import math

import pytest

from k3serve.lab.overview import HEADLINES, STORED_RUNS_PATH, load_stored_runs, overview, stored_runs_json

MODULES = [{"id": "full_scale", "number": 16, "title": "Full scale"}, {"id": "mxfp4", "number": 2, "title": "MXFP4"}]


def _record(module: str, measured: bool, metrics: dict, baseline: dict, date: str,
            sentence: str = "X won here.") -> dict:
    return {"id": module, "measured": measured, "metrics": metrics, "baseline": baseline, "labels": {},
            "metrics_name": "on", "baseline_name": "off", "command": f"k3serve lab run {module}", "date": date,
            "verdict": {"outcome": "won", "factor": 2.0, "metric": next(iter(metrics)), "sentence": sentence,
                        "flips_when": "it would flip below 3"}}


FULL_SCALE = _record("full_scale", False, {"s_per_token": 50.0, "s_per_token_at_8_gib": None,
                                           "s_per_token_at_64_gib": 40.0},
                     {"s_per_token": 22.0, "s_per_token_at_8_gib": 24.0, "s_per_token_at_64_gib": 20.0},
                     "2026-12-01T00:00:00+00:00")


def test_stored_runs_fill_the_overview_and_a_run_here_replaces_them():
    stored = {"date": "2026-12-01T00:00:00+00:00", "machine": "a machine", "command": "k3serve lab run --all",
              "runs": {"full_scale": FULL_SCALE, "mxfp4": _record("mxfp4", True, {"bits": 4.25}, {"bits": 8.0},
                                                                     "2026-12-01T00:00:00+00:00")}}
    body = overview(MODULES, stored, {})
    slots = {h["slot"]: h for h in body["headlines"]}
    assert set(slots) == {h.slot for h in HEADLINES}
    eight, sixty_four = slots["full_k3_8gb"], slots["full_k3_64gb"]
    assert eight["verdict"]["outcome"] == "lost" and "does not fit 8 GiB" in eight["verdict"]["sentence"]
    assert "it would flip below 3" in eight["verdict"]["sentence"].lower()
    assert sixty_four["verdict"]["outcome"] == "lost" and sixty_four["verdict"]["factor"] == pytest.approx(0.5)
    assert sixty_four["text"] == "k3serve: 40.0 s/token; C engine: 20.0 s/token"
    assert eight["badge"] == "simulated" and eight["date"] == FULL_SCALE["date"] and eight["machine"] == "a machine"
    assert slots["peers"]["status"] == "not yet run" and slots["serving"]["status"] == "not yet run"
    rows = {r["module"]: r for r in body["modules"]}
    assert rows["mxfp4"]["badge"] == "recorded" and rows["mxfp4"]["source"] == "stored run"
    here = _record("mxfp4", True, {"bits": 4.25}, {"bits": 8.0}, "2026-12-06T08:00:00+00:00", "MXFP4 won again.")
    rows = {r["module"]: r for r in overview(MODULES, stored, {"mxfp4": here})["modules"]}
    assert rows["mxfp4"]["badge"] == "measured" and rows["mxfp4"]["source"] == "run on this server"
    assert rows["mxfp4"]["date"] == here["date"] and rows["mxfp4"]["verdict"]["sentence"] == "MXFP4 won again."


def test_a_module_that_fills_a_generic_slot_shows_its_own_verdict_and_figure():
    peers = _record("peers", True, {"tok_per_s": 30.0}, {"tok_per_s": 20.0}, "2026-12-06T08:00:00+00:00",
                    "k3serve won here.")
    body = overview(MODULES + [{"id": "peers", "number": 18, "title": "Peers"}],
                    {"date": None, "machine": None, "command": "", "runs": {}}, {"peers": peers})
    slot = next(h for h in body["headlines"] if h["slot"] == "peers")
    assert slot["status"] == "done" and slot["value"] == 30.0 and slot["baseline"] == 20.0
    assert slot["verdict"]["sentence"] == "k3serve won here." and slot["badge"] == "measured"
    assert next(h for h in body["headlines"] if h["slot"] == "full_k3_8gb")["status"] == "not yet run"


def test_a_run_that_shows_a_record_is_badged_recorded_with_the_records_date():
    # peers without llama.cpp (CI): the run here succeeds but its figures are a record of an earlier measurement
    shown = _record("peers", True, {"decode_tok_s": 87.0}, {"decode_tok_s": 199.0}, "2026-12-07T09:00:00+00:00",
                    "k3serve lost here.")
    shown["series"] = [{"measured": True, "recorded": "2026-12-06", "mark": "recorded 2026-12-06"}]
    measured = dict(shown, series=[{"measured": True, "recorded": None, "mark": "measured on this machine"}])
    modules = MODULES + [{"id": "peers", "number": 18, "title": "Peers"}]
    stored = {"date": "2026-12-01T00:00:00+00:00", "machine": "a machine", "command": "", "runs": {"peers": measured}}
    for latest, badge, date in (({"peers": shown}, "recorded", "2026-12-06"),
                                ({"peers": measured}, "measured", "2026-12-07T09:00:00+00:00")):
        body = overview(modules, stored, latest)
        slot = next(h for h in body["headlines"] if h["slot"] == "peers")
        row = next(r for r in body["modules"] if r["module"] == "peers")
        for entry in (slot, row):
            assert entry["badge"] == badge and entry["date"] == date and entry["source"] == "run on this server"
            assert entry["recorded"] == (date if badge == "recorded" else None)
    assert slot["value"] == 87.0 and slot["baseline"] == 199.0 and slot["verdict"]["sentence"] == "k3serve lost here."
    # the stored run of a live measurement: recorded (stored), with the stored run's date and machine
    row = next(r for r in overview(modules, stored, {})["modules"] if r["module"] == "peers")
    assert (row["badge"], row["date"], row["machine"]) == ("recorded", measured["date"], "a machine")


def test_a_malformed_stored_runs_file_is_an_error_naming_it(tmp_path):
    bad = tmp_path / "stored_runs.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="stored_runs.json"):
        load_stored_runs(bad)
    bad.write_text("[]")
    with pytest.raises(ValueError, match="no 'runs'"):
        load_stored_runs(bad)
    assert load_stored_runs(tmp_path / "missing.json")["runs"] == {}
    written = stored_runs_json({}, "k3serve lab run --all")
    assert written["machine"] and written["date"].endswith("+00:00") and written["model"] is None


def test_stored_runs_of_another_model_are_not_shown():
    from k3serve.lab.overview import stored_runs_for

    stored = {"model": None, "runs": {"mxfp4": {}}, "date": "2026-12-06", "machine": "m", "command": "c"}
    assert stored_runs_for(stored, None) == (stored, None)
    shown, why = stored_runs_for(stored, "/models/other-k3")
    assert shown["runs"] == {} and "embedded model" in why and "/models/other-k3" in why


def test_the_shipped_stored_runs_are_every_module_at_its_defaults_with_a_verdict():
    from k3serve.lab.fixtures import LabFixtures
    from k3serve.lab.registry import modules

    stored = json.loads(STORED_RUNS_PATH.read_text())
    assert stored["command"].startswith("k3serve lab run --all") and stored["machine"] and stored["date"]
    lab = LabFixtures()
    registry = modules()
    # every module, in page order: a module added since shows "not yet run" until `k3serve lab run --all` again
    assert list(stored["runs"]) == list(registry), set(registry) ^ set(stored["runs"])
    for module_id, record in stored["runs"].items():
        assert record["params"] == registry[module_id].validate({}, lab), module_id
        assert record["command"] == f"k3serve lab run {module_id}"
        verdict = record["verdict"]
        assert verdict["outcome"] in ("won", "lost", "even") and verdict["sentence"] and verdict["flips_when"]
        value = record["metrics"][verdict["metric"]]
        assert value is not None and math.isfinite(value), module_id
    # every headline slot fills from them before any click, speed against llama.cpp and serving throughput included
    body = overview([m.to_json() for m in registry.values()], stored, {})
    for slot in body["headlines"]:
        assert slot["status"] == "done" and slot["verdict"]["sentence"], slot["slot"]
        assert slot["badge"] in ("recorded", "simulated") and slot["date"], slot["slot"]
    slots = {h["slot"]: h for h in body["headlines"]}
    for slot, metric in (("peers", "decode_tok_s"), ("serving", "tok_per_s")):
        assert slots[slot]["metric"] == metric and math.isfinite(slots[slot]["value"]), slots[slot]
        assert slots[slot]["baseline"] > 0 and slots[slot]["verdict"]["outcome"] in ("won", "lost", "even")


def test_docs_lab_md_quotes_the_shipped_verdicts_and_marks_the_timings():
    from pathlib import Path

    from k3serve.lab.overview import is_timing

    docs = " ".join((Path(__file__).resolve().parents[2] / "docs" / "LAB.md").read_text().split())
    stored = load_stored_runs()
    assert stored["date"][:10] in docs and stored["machine"] in docs
    for module_id, record in stored["runs"].items():
        row = f"| `{module_id}` | {record['verdict']['outcome']} |"
        assert row in docs, row
        if is_timing(record):  # a timing moves with the machine and its load: the docs say so instead
            assert f"| `{module_id}` | {record['verdict']['outcome']} | a timing" in docs, module_id
        else:  # bytes, counts, shapes and simulations repeat exactly: the docs quote the page's sentence
            assert " ".join(record["verdict"]["sentence"].split()) in docs, module_id
