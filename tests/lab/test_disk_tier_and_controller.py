"""Lab modules 20 (the prefix cache's disk tier) and 21 (the RAM controller): what they report follows what ran."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from k3serve.config import full_k3_config
from k3serve.lab.registry import CancelToken, LabParamError, get_module
from k3serve.sim.full import SimConfig
from k3serve.sim.presets import resolve_machine
from k3serve.sim.returning import checkpoint_bytes


def _run(lab_fixtures, module_id: str, **params):
    module = get_module(module_id)
    return module.run(module.validate(params, lab_fixtures), lambda fraction, message: None, CancelToken(),
                      lab_fixtures)


@pytest.mark.parametrize("weights", ["resident", "streamed-4MiB"])
def test_disk_tier_reads_back_exactly_the_checkpoint_the_formula_sizes(lab_fixtures, weights):
    result = _run(lab_fixtures, "disk_tier", prefix_tokens=128, weights=weights)
    m = result.metrics
    # the returning turn restores turn 1's checkpoint (its prompt and reply, less the last sampled token)
    assert m["cached_tokens"] >= 128
    assert m["disk_read_bytes"] == checkpoint_bytes(lab_fixtures.config, int(m["cached_tokens"])).file_bytes
    read, formula = result.figures[1].traces
    assert read["y"] == formula["y"]  # every prefix of the sweep: bytes read == the file the formula gives
    assert result.verdict.metric == "ttft_ms" and result.verdict.flips_when
    assert result.figures[-1].measured is False and "simulated" not in result.figures[0].source
    assert ("resident" in result.figures[0].source) == (weights == "resident")


def test_disk_tier_off_recomputes_the_prefix(lab_fixtures):
    result = _run(lab_fixtures, "disk_tier", prefix_tokens=128, disk_tier=False)
    assert result.metrics["cached_tokens"] == 0 and result.metrics["disk_read_bytes"] == 0
    assert len(result.figures) == 2  # no bytes-read figure without a tier; the simulated one stays


def test_the_shipped_full_scale_record_matches_the_simulator_formulas():
    record = json.loads(resources.files("k3serve.lab").joinpath("recorded", "disk_tier_sim.json").read_text())
    sized = checkpoint_bytes(full_k3_config(), record["prompt_tokens"])
    machine = resolve_machine(record["machine"])
    assert {row["ram"] for row in record["rows"]} == {"8G", "64G"}
    for row in record["rows"]:
        assert row["checkpoint"]["file_bytes"] == sized.file_bytes
        assert row["read_seconds"] == pytest.approx(sized.file_bytes / machine.disk.bandwidth(sized.file_bytes, 1))
        assert row["restore_seconds"] < row["recompute_seconds"]
    assert SimConfig(machine=machine).batch == 1


def test_ram_controller_keeps_the_budget_and_lists_its_moves(lab_fixtures):
    params = {"groups": 2, "prefix_tokens": 64, "rounds": 2}
    result = _run(lab_fixtures, "ram_controller", **params)
    pools = result.figures[0].traces
    budget_mib = get_module("ram_controller").validate(params)["budget_kib"] / 1024
    steps = len(pools[0]["y"])
    assert steps > 0 and all(len(t["y"]) == steps for t in pools)
    for i in range(steps):  # the three pools never hold more than the budget together
        assert sum(t["y"][i] for t in pools) <= budget_mib + 1e-9
    assert result.baseline["moves"] == 0  # the default split does not move
    moves_note = next(n for n in result.notes if n.startswith("the controller's moves"))
    assert f"({int(result.metrics['moves'])})" in moves_note
    costs = result.figures[1].traces[0]
    assert costs["y"][0] == pytest.approx(result.metrics["cost_s"])
    assert costs["y"][1] == pytest.approx(result.baseline["cost_s"])


def test_ram_controller_refuses_a_budget_without_room_for_experts(lab_fixtures):
    with pytest.raises(LabParamError, match="budget_kib"):
        _run(lab_fixtures, "ram_controller", budget_kib=1024, fixed_checkpoints=16, fixed_blocks=96,
             groups=1, prefix_tokens=32, rounds=1, chats=8)
