"""`--ram-controller` through the command line (cli/ram_control.py): generate and serve attach the controller to a
streamed model under one --ram-budget, the moves reach the run report and /metrics, and the flags that cannot
apply are refused with a message before any model loads."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.cli.main import build_parser, main
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import UsageError


def _generate(capsys, *flags: str) -> tuple[str, str]:
    code = main(["generate", "--prompt-ids", "5,6,7,8,9,10,11", "--max-tokens", "10", "--ignore-eos",
                 "--ram-budget", "3M", *flags])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out.strip(), captured.err


def test_generate_with_the_controller_gives_the_same_tokens_and_reports_the_pools(capsys):
    plain, plain_report = _generate(capsys)
    tokens, report = _generate(capsys, "--ram-controller", "--ram-controller-interval", "1")
    assert tokens == plain and len(tokens.split(",")) == 10
    assert "RAM pools" not in plain_report
    pools = next(line for line in report.splitlines() if line.startswith("RAM pools"))
    # one budget: the weights' fixed part, the expert slots and the sequence's KV blocks
    assert "of 3.00 MiB" in pools and "fixed" in pools and "experts" in pools and "kv" in pools


def test_serve_attaches_the_controller_and_its_moves_reach_the_metrics():
    from k3serve.cli.main import _engine_config
    from k3serve.cli.ram_control import attach_from_args, check_ram_controller_args
    from k3serve.cli.stream import load_for_run
    from k3serve.engine.engine import LLMEngine

    args = build_parser().parse_args(["serve", "--ram-budget", "3M", "--pin-trunk", "0", "--ram-controller", "--ram-controller-interval",
                                      "1", "--ram-controller-step", "64K", "--max-model-len", "128",
                                      "--state-checkpoints", "4", "--kv-cache-mib", "1"])
    check_ram_controller_args(args)
    config = _engine_config(args)
    loaded = load_for_run(args)
    try:
        engine = LLMEngine(loaded.model, config, stop_ids=())
        controller = attach_from_args(engine, args)
        assert controller is not None and engine.ram_steering is not None
        ledger = controller.pools
        assert ledger.budget_bytes == 3 << 20 and set(ledger.pools) == {"fixed", "experts", "checkpoints", "kv"}
        assert ledger.pools["checkpoints"].size_bytes == engine.scheduler.prefix_cache.checkpoint_bytes  # one
        rng = np.random.default_rng(3)
        system = [int(t) for t in rng.integers(3, 500, 48)]
        for round_ in range(4):  # a shared prefix: block ghosts and recurrences for the controller to price
            for group in range(3):
                engine.add_request(system[: 32 + 8 * group] + [int(t) for t in rng.integers(3, 500, 4)],
                                   SamplingParams(max_tokens=3, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
                ledger.check_integrity()  # never over the budget, every pool within its caps
        snapshot = engine.metrics.snapshot()
        assert snapshot["ram_budget_bytes"] == 3 << 20
        for name in ("experts", "checkpoints", "kv"):
            assert snapshot[f"ram_pool_bytes_{name}"] == ledger.pools[name].size_bytes
        assert controller.moves and snapshot["ram_controller_moves"] == len(controller.moves)
    finally:
        loaded.model.experts.close()


@pytest.mark.parametrize("argv, named", [
    (["generate", "--prompt-ids", "5,6", "--ram-controller"], "give --ram-budget"),
    (["serve", "--ram-controller"], "give --ram-budget"),
    (["generate", "--prompt-ids", "5,6", "--ram-controller-interval", "4"], "add --ram-controller"),
    (["serve", "--ram-budget", "8M", "--ram-controller-step", "1M"], "add --ram-controller"),
    (["cluster", "--ram-budget", "1G", "--ram-controller"], "not offered by `cluster`"),
])
def test_flags_that_cannot_apply_are_refused_before_a_model_loads(argv, named, capsys):
    assert main(argv) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("budget, named", [("2408704", "lower --max-model-len"), ("3M", "--pin-trunk SIZE pins less")])
def test_a_budget_without_room_for_the_kv_floor_names_what_takes_it(budget, named):
    """The weights' minimum (2408704 bytes) runs the model without the controller; with it, the KV blocks of one
    4096-token sequence must fit in the same budget, and they do not. At 3M the plan pins trunk layers first."""
    from k3serve.cli.main import _engine_config
    from k3serve.cli.ram_control import attach_from_args
    from k3serve.cli.stream import load_for_run
    from k3serve.engine.engine import LLMEngine

    args = build_parser().parse_args(["serve", "--ram-budget", budget, "--ram-controller", "--max-model-len", "4096",
                                      "--kv-cache-mib", "4"])
    loaded = load_for_run(args)
    try:
        engine = LLMEngine(loaded.model, _engine_config(args), stop_ids=())
        with pytest.raises(UsageError, match="too small for --ram-controller") as error:
            attach_from_args(engine, args)
        assert "KV blocks one longest sequence needs" in str(error.value) and named in str(error.value)
        assert engine.ram_steering is None
    finally:
        loaded.model.experts.close()


def test_the_step_flag_is_a_size(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--ram-controller", "--ram-controller-step", "lots"])
    assert exit_info.value.code == 2 and "--ram-controller-step" in capsys.readouterr().err
    with pytest.raises(UsageError, match="add --ram-controller"):
        from k3serve.cli.ram_control import check_ram_controller_args

        check_ram_controller_args(build_parser().parse_args(["generate", "--prompt-ids", "1",
                                                             "--ram-controller-interval", "2"]))
