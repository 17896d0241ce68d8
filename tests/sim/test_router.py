"""The simulator's router mode: its model of a replica's prefix cache hits exactly where the engine's does, the
real router routes the simulated requests, and bad input is a clear error."""

from __future__ import annotations

import json

import numpy as np
import pytest

from k3serve.cli.main import main
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import ConfigError
from k3serve.sim.router import ReplicaCache, RouterSimConfig, ratio_row, simulate_router

SYSTEM, QUESTION, REPLY = 128, 32, 8


@pytest.mark.parametrize("policy,slots", [("lru", 4), ("slru", 4), ("slru", 7)])
def test_the_cache_model_hits_exactly_where_the_engine_does(tiny_model, policy, slots):
    """Requests of 6 prefix groups one after another through one engine (the tiny hybrid oracle: KDA and MLA
    layers) and through `ReplicaCache`: the same requests hit, under evictions."""
    rng = np.random.default_rng(3)
    vocab = tiny_model.config.vocab_size
    systems = [rng.integers(3, vocab, SYSTEM).tolist() for _ in range(6)]
    groups = rng.integers(0, 6, 40).tolist()
    engine = LLMEngine(tiny_model, EngineConfig(max_model_len=256, block_size=16, max_seqs=1, kv_cache_bytes=64 << 20,
                                                num_state_checkpoints=slots, checkpoint_every_blocks=8,
                                                prefix_cache_policy=policy, prefix_wait_tokens=0), stop_ids=())
    model = ReplicaCache(slots, policy)
    engine_hits, model_hits = [], []
    for request, group in enumerate(groups):
        engine.add_request(systems[group] + rng.integers(3, vocab, QUESTION).tolist(),
                           SamplingParams(max_tokens=REPLY, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    engine_hits.append(out.num_cached_tokens)
        hit = model.admit(group)
        model.prefilled(group, request, hit, SYSTEM, SYSTEM + QUESTION)
        model.finished(request, SYSTEM + QUESTION + REPLY - 1)
        model_hits.append(SYSTEM if hit else 0)
    assert engine_hits == model_hits
    assert 0 < sum(h > 0 for h in model_hits) < len(groups) - 6  # some hits, and evictions cost some
    if policy == "slru":  # the recently-evicted list sent some re-saved checkpoints straight to protected
        assert engine.metrics.snapshot()["prefix_cache_checkpoints_recurring"] > 0


def test_the_simulated_cluster_routes_every_request_and_cache_aware_keeps_groups_together():
    config = RouterSimConfig(replicas=2, checkpoints=64, groups=8, per_group=6, clients=4)
    ca = simulate_router(config)
    rr = simulate_router(RouterSimConfig(**{**config.__dict__, "router": "round-robin"}))
    for result in (ca, rr):
        assert sum(result.requests_per_replica) == 48 and result.prompt_tokens == 48 * (128 + 32)
    # a cache that holds everything: cache-aware misses once per group, round-robin once per group and replica
    assert ca.cached_tokens == (48 - 8) * 128 and ca.decisions == {"no_match": 8, "prefix_match": 40}
    assert rr.cached_tokens == (48 - 16) * 128 and rr.decisions == {"round_robin": 48}
    assert simulate_router(config).as_dict() == ca.as_dict()  # deterministic


def test_more_replicas_widen_the_gap_over_round_robin():
    ratios = {r: np.median(ratio_row(RouterSimConfig(replicas=r, checkpoints=8), seeds=3).ratios) for r in (2, 4, 8)}
    assert 1 < ratios[2] < ratios[4] < ratios[8], ratios


@pytest.mark.parametrize("kwargs,message", [
    ({"router": "random"}, "unknown router"), ({"policy": "lfu"}, "unknown prefix-cache policy"),
    ({"replicas": 0}, "replicas must be at least 1"), ({"checkpoints": 0}, "checkpoints must be at least 1"),
    ({"prefill_ms": 0}, "prefill-ms > 0")])
def test_bad_configurations_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RouterSimConfig(**kwargs)


def test_the_command_prints_a_row_per_configuration_and_writes_json(tmp_path, capsys):
    out = tmp_path / "router.json"
    assert main(["sim", "router", "--replicas", "2,4", "--per-group", "4", "--checkpoints", "8", "--seeds", "2",
                 "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len([line for line in lines if line.split() and line.split()[0] in ("2", "4")]) == 2
    rows = json.loads(out.read_text())["rows"]
    assert [r["replicas"] for r in rows] == [2, 4] and all(len(r["ratios"]) == 2 for r in rows)
    assert main(["sim", "router", "--policy", "lfu"]) == 2
    assert "k3serve: error: unknown prefix-cache policy 'lfu'" in capsys.readouterr().err
