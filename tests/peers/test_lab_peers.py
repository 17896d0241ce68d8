"""The lab's `peers` module live: llama.cpp and k3serve on the same GGUF (llama.cpp's converter on the lab model),
in RAM and, where a memory cgroup can be made, under RAM; fresh processes, alternated, medians of 3.

Needs the `peers` extra and llama.cpp's converter (the llama-cpp-python 0.3.36 sdist at $K3SERVE_LLAMA_CPP_SDIST,
default /tmp/llama_sdist/..., or a source tree at $K3SERVE_LLAMA_CPP_TREE); skips without the extra, fails with
the extra but no converter. About a minute on 2 cores (the GGUF is built once into the lab's cache)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("llama_cpp", reason="the peers extra is not installed (pip install -e '.[peers]'): the lab's "
                                        "live peer comparison is not tested")

from k3serve.lab import peers  # noqa: E402
from k3serve.lab.fixtures import LabFixtures  # noqa: E402
from k3serve.lab.modules import peers as module  # noqa: E402
from k3serve.lab.registry import CancelToken, RunCancelled  # noqa: E402


@pytest.fixture(scope="module")
def lab() -> LabFixtures:
    lab = LabFixtures()
    try:
        peers.converter_tree(lab.root / "peers" / "llama_cpp_src")
    except peers.PeerUnavailable as error:
        pytest.fail(f"the peers extra is installed but {error}")
    return lab


def test_the_live_comparison_measures_both_engines_on_one_file(lab):
    params = module.MODULE.validate({"prompt_tokens": 16, "decode_tokens": 4}, lab)
    messages = []
    result = module.MODULE.run(params, lambda f, m: messages.append(m), CancelToken(), lab)
    assert not any("recorded" in note for note in result.notes[:1])
    assert all(f.recorded is None and f.measured for f in result.figures)
    for key in module.KEYS:
        assert math.isfinite(result.metrics[key]) and result.metrics[key] > 0
        assert math.isfinite(result.baseline[key]) and result.baseline[key] > 0
    assert result.verdict.factor == pytest.approx(result.metrics["decode_tok_s"] / result.baseline["decode_tok_s"])
    in_ram = [m for m in messages if m.startswith("in RAM")]
    assert in_ram == [f"in RAM, repeat {r}: {e}" for r in (1, 2, 3) for e in module.ENGINES]  # alternated
    problem = peers.cgroup_problem()
    if problem is None:  # under RAM ran, each engine in its own limited cgroup
        assert "under_ram_decode_tok_s" in result.metrics and "under_ram_decode_tok_s" in result.baseline
        assert any(note.startswith("under RAM: each engine in a cgroup-v1 memory group") for note in result.notes)
    else:
        assert f"under RAM skipped: {problem}" in result.notes


def test_a_cancel_stops_between_processes(lab):
    cancel = CancelToken()

    def progress(fraction: float, message: str) -> None:
        if message.startswith("in RAM"):
            cancel.cancel()

    params = module.MODULE.validate({"prompt_tokens": 16, "decode_tokens": 4, "under_ram": False}, lab)
    with pytest.raises(RunCancelled):
        module.MODULE.run(params, progress, cancel, lab)
