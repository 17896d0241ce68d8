"""Parameter validation, the reproducing command and the registry's discovery of module files."""

from __future__ import annotations

import dataclasses

import pytest

from k3serve.lab.registry import LabModule, LabParamError, Param, get_module, modules, UnknownModuleError


def _module() -> LabModule:
    return LabModule(id="demo", number=99, title="demo", summary="s", explanation="e", kind="simulated",
                     params=(Param("count", "int", 4, min=1, max=8), Param("rate", "float", 0.5, min=0, max=1),
                             Param("policy", "choice", "lru", choices=("lru", "lfu")), Param("flag", "bool", False)),
                     run=lambda *a: None)


def test_defaults_fill_in_and_strings_parse():
    module = _module()
    assert module.validate({}) == {"count": 4, "rate": 0.5, "policy": "lru", "flag": False}
    assert module.validate({"count": "7", "rate": "0.25", "flag": "true"}) == \
        {"count": 7, "rate": 0.25, "policy": "lru", "flag": True}
    assert module.validate({"count": 6.0})["count"] == 6


@pytest.mark.parametrize("raw, param", [({"nope": 1}, "nope"), ({"count": 9}, "count"), ({"count": 0}, "count"),
                                        ({"count": 2.5}, "count"), ({"rate": "x"}, "rate"),
                                        ({"rate": float("nan")}, "rate"), ({"policy": "fifo"}, "policy"),
                                        ({"flag": "maybe"}, "flag"), ({"count": True}, "count")])
def test_bad_parameters_name_themselves(raw, param):
    with pytest.raises(LabParamError) as info:
        _module().validate(raw)
    assert info.value.param == param and repr(param) in str(info.value)


def test_command_lists_only_changed_parameters():
    module = _module()
    assert module.command(module.validate({})) == "k3serve lab run demo"
    assert module.command(module.validate({"count": 5, "flag": True}), model="/m") == \
        "k3serve lab run demo --model /m --param count=5 --param flag=true"


def test_a_default_outside_its_range_is_refused_at_declaration():
    with pytest.raises(LabParamError):
        Param("x", "int", 0, min=1, max=2)


def test_registry_finds_every_module_file_with_unique_ids_and_numbers():
    found = modules()
    assert {"anatomy", "mxfp4", "recurrent_state", "cache_policies", "rollback"} <= set(found)
    numbers = [m.number for m in found.values()]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    for module in found.values():
        assert module.kind in ("measured", "simulated", "both") and module.explanation and module.summary
    with pytest.raises(UnknownModuleError):
        get_module("no-such-module")


def _limits(lab) -> dict:
    return {"count": (2, lab.max_count)}


def test_limits_narrow_the_declared_range_to_the_model():
    class Lab:
        max_count = 6

    module = dataclasses.replace(_module(), limits=_limits)
    assert module.validate({"count": 8})["count"] == 8  # without a lab: the declared range
    assert module.validate({"count": 6}, Lab())["count"] == 6
    for bad in (7, 1):
        with pytest.raises(LabParamError) as info:
            module.validate({"count": bad}, Lab())
        assert info.value.param == "count"
    count = next(p for p in module.to_json(Lab())["params"] if p["name"] == "count")
    assert (count["min"], count["max"]) == (2, 6)


@pytest.mark.parametrize("kind, labels, log_y", [
    ("bar", {"y_label": "ms"}, False),  # a unit, but not in parentheses
    ("bar", {"y_label": "time (KiB/100)"}, False),  # not a unit
    ("line", {"x_label": "requests in flight", "y_label": "latency (ms)"}, False),  # a numeric x without a unit
    ("bar", {"y_label": "latency (ms)"}, True),  # log-scale bars exaggerate
])
def test_a_figure_without_an_axis_unit_or_with_log_bars_is_refused(kind, labels, log_y):
    from k3serve.lab.registry import Figure, FigureError

    with pytest.raises(FigureError):
        Figure("t", kind, True, "s", [{"name": "a", "x": [1], "y": [1]}], log_y=log_y, **labels)


def test_a_figure_states_its_axis_units():
    from k3serve.lab.registry import Figure

    figure = Figure("t", "line", False, "s", [{"name": "a", "x": [1], "y": [1]}], x_label="budget (MiB)",
                    y_label="time per token (ms/token)", highlight="a").to_json()
    assert (figure["x_unit"], figure["y_unit"], figure["highlight"]) == ("MiB", "ms/token", "a")
