"""The `peers` module without llama.cpp (what CI runs): the recorded figures, marked with their date and command;
the verdict and ratios computed from the numbers; an under-RAM row that cannot run is skipped by itself, saying
why. The live comparison is tests/peers/test_lab_peers.py (needs the `peers` extra)."""

from __future__ import annotations

import math

import pytest

from k3serve.lab import peers
from k3serve.lab.modules import peers as module
from k3serve.lab.registry import CancelToken, result_json


def _measured(under_ram: bool = True) -> dict:
    row = {"k3serve": {"decode_tok_s": 80.0, "prefill_tok_s": 600.0, "peak_rss_mib": 180.0},
           "llama.cpp": {"decode_tok_s": 100.0, "prefill_tok_s": 500.0, "peak_rss_mib": 120.0}}
    under = {"k3serve": {"decode_tok_s": 60.0, "prefill_tok_s": 400.0, "peak_rss_mib": 170.0},
             "llama.cpp": {"decode_tok_s": 30.0, "prefill_tok_s": 200.0, "peak_rss_mib": 110.0}}
    return {"rows": {"in RAM": row, "under RAM": under if under_ram else {"k3serve": None, "llama.cpp": None}},
            "limits_mib": {"k3serve": 177.0, "llama.cpp": 117.0} if under_ram else {},
            "under_ram_skipped": None if under_ram else "no cgroup-v1 memory controller at /x",
            "failures": [], "weights_mib": 5.6, "k3serve_ram_budget_mib": 4.3 if under_ram else None,
            "gguf": "k3-x1-x1.gguf", "machine": {"cpu": "a CPU", "cores": 2, "load_average": 3.0},
            "params": module.MODULE.validate({}), "date": "2026-12-06", "command": "python -m k3serve.lab.modules.peers"}


def test_the_verdict_and_ratios_follow_the_numbers():
    result = module.build_result(_measured(), None)
    verdict = result.verdict
    assert verdict.outcome == "lost" and verdict.factor == pytest.approx(0.8) and verdict.metric == "decode_tok_s"
    assert "0.80x llama.cpp's speed on the same file" in verdict.sentence and "2.00x under a memory limit" in \
        verdict.sentence
    # k3serve's step 12.5 ms, llama.cpp's 10.0 ms; under RAM the ratio is already on the other side of 1
    assert "below llama.cpp's 10.0 ms (it took 12.5 ms)" in verdict.flips_when
    assert "already flips under RAM (2.00x" in verdict.flips_when
    assert result.metrics["decode_tok_s"] == 80.0 and result.baseline["decode_tok_s"] == 100.0
    assert result.metrics["under_ram_decode_tok_s"] == 60.0 and result.baseline["under_ram_decode_tok_s"] == 30.0
    ratio = next(f for f in result.figures if f.title == "k3serve / llama.cpp")
    assert {t["name"]: t["y"] for t in ratio.traces} == {"in RAM": [0.8, 1.2, 1.5], "under RAM": [2.0, 2.0, 170 / 110]}
    assert all(f.recorded is None and f.to_json()["mark"] == "measured on this machine" for f in result.figures)


def test_an_under_ram_row_that_cannot_run_is_skipped_alone_and_says_why():
    result = module.build_result(_measured(under_ram=False), None)
    assert all(t["x"] == ["in RAM"] for f in result.figures for t in f.traces if t["name"] in ("k3serve",
                                                                                             "llama.cpp"))
    assert "under_ram_decode_tok_s" not in result.metrics and result.metrics["decode_tok_s"] == 80.0
    assert "under RAM skipped: no cgroup-v1 memory controller at /x" in result.notes
    assert "under a memory limit" not in result.verdict.sentence


def test_without_llama_cpp_the_recorded_figures_are_shown_with_date_and_command(lab_fixtures, monkeypatch):
    monkeypatch.setattr(peers, "llama_cpp_missing", lambda: "llama-cpp-python is not installed (test)")
    stored = module.load_recorded()
    params = module.MODULE.validate({}, lab_fixtures)
    result = module.MODULE.run(params, lambda *a: None, CancelToken(), lab_fixtures)
    record = result_json(module.MODULE, params, result, 0.0)
    assert record["measured"] and record["series"]
    for figure in record["series"]:
        assert figure["mark"] == f"recorded {stored['date']}" and figure["recorded"] == stored["date"]
        assert figure["source"].startswith(f"recorded {stored['date']} on {stored['machine']['cpu']} (")
    first = result.notes[0]
    assert first.startswith("recorded figures, not measured by this run: llama-cpp-python is not installed (test).")
    assert stored["command"] in first and stored["date"] in first
    rows = stored["rows"]
    assert result.metrics["decode_tok_s"] == rows["in RAM"]["k3serve"]["decode_tok_s"]
    assert result.verdict.factor == pytest.approx(rows["in RAM"]["k3serve"]["decode_tok_s"]
                                                  / rows["in RAM"]["llama.cpp"]["decode_tok_s"])
    assert all(math.isfinite(v) for v in result.metrics.values())


def test_the_recorded_figures_are_a_live_run_of_this_module_at_its_defaults():
    stored = module.load_recorded()
    assert stored["command"].startswith("python -m k3serve.lab.modules.peers")
    assert module.MODULE.validate(stored["params"]) == stored["params"]
    for row in ("in RAM", "under RAM"):
        for engine in module.ENGINES:
            runs = stored["runs"][row][engine]
            assert len(runs) == stored["params"]["repeats"] >= 3
            for key in module.KEYS:  # the stored medians are the medians of the stored runs
                values = sorted(r[key] for r in runs)
                assert stored["rows"][row][engine][key] == pytest.approx(values[len(values) // 2])


def test_a_missing_converter_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.delenv("K3SERVE_LLAMA_CPP_TREE", raising=False)
    monkeypatch.setenv("K3SERVE_LLAMA_CPP_SDIST", str(tmp_path / "none.tar.gz"))
    with pytest.raises(peers.PeerUnavailable, match="none.tar.gz"):
        peers.converter_tree(tmp_path / "cache")
    monkeypatch.setenv("K3SERVE_LLAMA_CPP_TREE", str(tmp_path))
    with pytest.raises(peers.PeerUnavailable, match="no conversion/kimi_k3.py"):
        peers.converter_tree(tmp_path / "cache")


def test_no_memory_cgroup_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "CGROUP_ROOT", tmp_path / "nothing")
    assert "no cgroup-v1 memory controller" in peers.cgroup_problem()


def test_the_converter_is_unpacked_from_the_sdist_once_and_only_its_python(tmp_path, monkeypatch):
    import tarfile

    root = tmp_path / "src" / "llama_cpp_python-0.3.36"
    files = {"vendor/llama.cpp/conversion/kimi_k3.py": "converter", "vendor/llama.cpp/gguf-py/gguf/__init__.py": "",
             "vendor/llama.cpp/convert_hf_to_gguf.py": "", "vendor/llama.cpp/ggml/src/big.c": "not needed",
             "llama_cpp/__init__.py": "not needed"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        archive.add(root, arcname=root.name)
    monkeypatch.delenv("K3SERVE_LLAMA_CPP_TREE", raising=False)
    monkeypatch.setenv("K3SERVE_LLAMA_CPP_SDIST", str(sdist))
    tree = peers.converter_tree(tmp_path / "cache")
    assert tree == tmp_path / "cache" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    assert (tree / "conversion" / "kimi_k3.py").read_text() == "converter"
    assert (tree / "gguf-py" / "gguf" / "__init__.py").exists() and (tree / "convert_hf_to_gguf.py").exists()
    assert not (tree / "ggml").exists() and not (tmp_path / "cache" / "llama_cpp_python-0.3.36" / "llama_cpp").exists()
    sdist.unlink()  # the second time the unpacked tree is used
    assert peers.converter_tree(tmp_path / "cache") == tree


def test_k3serve_streams_under_at_least_the_plans_minimum(tiny_store):
    from k3serve.stream.budget import minimum_budget_bytes
    from k3serve.stream.options import StreamOptions
    from k3serve.weights.store import PackedStore

    store = tiny_store.path
    minimum = minimum_budget_bytes(PackedStore(store), None, StreamOptions().trunk_dtype)
    for fraction in (0.1, 0.9):
        budget, share = module._k3serve_budget(store, fraction)
        assert share == int(fraction * module._store_bytes(store)) and budget == max(share, minimum)
    assert module._k3serve_budget(store, 0.1)[0] == minimum  # a tenth of the tiny store cannot run a layer


def test_a_budget_raised_to_the_plans_minimum_is_said_in_the_notes():
    measured = {**_measured(), "k3serve_ram_budget_mib": 4.5, "k3serve_ram_share_mib": 4.4}
    note = next(n for n in module.build_result(measured, None).notes if n.startswith("under RAM: each engine"))
    assert "RAM budget 4.5 MiB, the plan's minimum: 50% of the store, 4.4 MiB, is below it)" in note
    plain = next(n for n in module.build_result(_measured(), None).notes if n.startswith("under RAM: each engine"))
    assert "RAM budget 4.3 MiB)" in plain and "minimum" not in plain
