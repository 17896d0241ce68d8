"""`k3serve lab run` and `k3serve lab list` from the shell: the figures, the JSON record, bad parameters."""

from __future__ import annotations

import json

from k3serve.cli.main import main


def test_lab_run_prints_and_writes_the_record(tmp_path, capsys):
    out = tmp_path / "anatomy.json"
    assert main(["lab", "run", "anatomy", "--param", "trunk_precision=fp8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["command"] == "k3serve lab run anatomy --param trunk_precision=fp8"
    assert "command: k3serve lab run anatomy --param trunk_precision=fp8" in printed
    bf16 = tmp_path / "bf16.json"
    assert main(["lab", "run", "anatomy", "--json", str(bf16)]) == 0
    assert json.loads(bf16.read_text())["metrics"]["trunk_bytes"] == 2 * record["metrics"]["trunk_bytes"]


def test_lab_run_refuses_bad_parameters_naming_them(capsys):
    assert main(["lab", "run", "anatomy", "--param", "top_k=-1"]) == 2
    assert "top_k" in capsys.readouterr().err
    assert main(["lab", "run", "anatomy", "--param", "nonsense"]) == 2
    assert main(["lab", "run", "no-such-module"]) == 2


def test_lab_list_names_every_module(capsys):
    from k3serve.lab.registry import modules

    assert main(["lab", "list"]) == 0
    printed = capsys.readouterr().out
    for module_id in modules():
        assert module_id in printed


def test_lab_run_all_writes_the_stored_runs_the_overview_reads(tmp_path, capsys, monkeypatch):
    from k3serve.lab import registry
    from k3serve.lab.overview import load_stored_runs

    everything = registry.modules()
    two = {k: everything[k] for k in ("anatomy", "mxfp4")}  # the whole set takes minutes; the loop is the same
    monkeypatch.setattr(registry, "modules", lambda: two)
    out = tmp_path / "stored.json"
    assert main(["lab", "run", "--all", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    stored = load_stored_runs(out)
    assert stored["command"] == "k3serve lab run --all" and stored["machine"] and stored["date"]
    assert list(stored["runs"]) == ["anatomy", "mxfp4"]
    for module_id, record in stored["runs"].items():
        assert record["command"] == f"k3serve lab run {module_id}" and record["verdict"]["sentence"] in printed
    assert main(["lab", "run", "--all", "anatomy"]) == 2
    assert "give no module" in capsys.readouterr().err
    assert main(["lab", "run"]) == 2
    assert "--all" in capsys.readouterr().err
