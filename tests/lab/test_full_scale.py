"""The full-scale module's levers (issue 34): each switch moves the simulated full K3 the right way, fewer bytes
read per token giving fewer seconds per token, and the run shows one ladder series per lever set."""

from __future__ import annotations

import pytest

from k3serve.lab.registry import CancelToken, LabParamError, get_module
from k3serve.lab.modules.full_scale import LOSSLESS, Levers, Projection

RAM_GIB = 64  # every lever set fits here on main and after the memory floor


@pytest.fixture(scope="module")
def projection():
    params = get_module("full_scale").validate({"tokens": 1, "costs": False})
    return Projection(params)


def _at(projection, levers):
    result = projection.k3serve(RAM_GIB, levers)
    assert result is not None, projection.refused
    return result


@pytest.mark.parametrize("levers", [Levers(trunk_dtype="q8_0"), Levers(trunk_dtype="mxfp4"),
                                    Levers(expert_top_p="0.7"), Levers(experts_kept=8.1),
                                    Levers(speculative_io_aware=True)], ids=lambda lv: lv.describe())
def test_a_lever_that_reads_fewer_bytes_takes_fewer_seconds_per_token(projection, levers):
    lossless, levered = _at(projection, LOSSLESS), _at(projection, levers)
    assert levered.bytes_per_token < 0.95 * lossless.bytes_per_token
    assert levered.s_per_token < lossless.s_per_token
    assert levered.dollars_per_million_tokens < lossless.dollars_per_million_tokens


def test_the_lossy_levers_order_by_bytes(projection):
    q8, mx = _at(projection, Levers(trunk_dtype="q8_0")), _at(projection, Levers(trunk_dtype="mxfp4"))
    assert mx.plan["pinned_trunk_bytes"] < q8.plan["pinned_trunk_bytes"]  # every layer pinned in both
    assert mx.bytes_per_token < q8.bytes_per_token and mx.s_per_token < q8.s_per_token  # room for more experts
    assert _at(projection, Levers(expert_top_p="0.7")).experts_kept_per_token < \
        _at(projection, Levers(expert_top_p="0.9")).experts_kept_per_token < 16


def test_drives_read_the_same_bytes_in_less_time(projection):
    lossless, striped = _at(projection, LOSSLESS), _at(projection, Levers(drives=2))
    assert striped.bytes_per_token == pytest.approx(lossless.bytes_per_token)
    assert striped.s_per_token < 0.95 * lossless.s_per_token


def test_float32_is_the_heavier_lossless_choice(projection):
    wide = _at(projection, Levers(trunk_dtype="float32"))
    assert wide.bytes_per_token > _at(projection, LOSSLESS).bytes_per_token
    assert Levers(trunk_dtype="float32").lossless and not Levers(trunk_dtype="q8_0").lossless


def test_the_run_shows_a_series_per_lever_set_and_the_quality_caveat():
    module = get_module("full_scale")
    params = module.validate({"trunk_dtype": "q8_0", "experts_kept": 8.1, "tokens": 1, "costs": True,
                              "ram_gb": 64})
    result = module.run(params, lambda *_: None, CancelToken(), None)
    ladder = result.figures[0]
    names = [t["name"] for t in ladder.traces]
    assert names[0].startswith("k3serve lossless") and names[1].startswith("k3serve with the levers")
    lossless, levered = ladder.traces[0]["y"], ladder.traces[1]["y"]
    assert all(b < a for a, b in zip(lossless, levered) if a is not None)  # lighter at every rung both run
    assert any("bounds nothing for the 2.78T model" in n and "q8_0" in n for n in result.notes)
    assert any("2.694 -> 2.811" in n for n in result.notes)
    cost = next(f for f in result.figures if f.title.startswith("Cost"))
    assert len(cost.traces) == 2 and len(cost.traces[0]["x"]) == 4
    assert all(b < a for a, b in zip(cost.traces[0]["y"][:3], cost.traces[1]["y"][:3]) if a is not None)
    verdict = result.verdict
    assert verdict.outcome in ("won", "lost", "even") and verdict.flips_when and "q8_0" in verdict.flips_when
    assert result.metrics["s_per_token_at_64_gib"] == pytest.approx(lossless[4])  # headline: lossless


def test_top_p_and_experts_kept_are_one_switch():
    with pytest.raises(LabParamError, match="experts_kept"):
        get_module("full_scale").validate({"expert_top_p": "0.7", "experts_kept": 8.1})
