"""Expert parallelism: the tiny oracle's experts split over owners (Ray actors on the session's local Ray, and
in-process owners), the trunk on the front. Greedy tokens and logits are the bits of one process."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from k3serve.cluster.expert_parallel import (ExpertOwnerCore, ExpertParallelSource, LocalOwners, split_by_owner,
                                             trunk_budget)
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLM
from k3serve.engine.sampling import SamplingParams
from k3serve.errors import K3Error
from k3serve.model.k3 import K3Model
from k3serve.stream.shard_source import ShardOptions
from k3serve.stream.options import StreamOptions
from k3serve.stream.source import StreamingSource

PROMPTS = [[1, 5, 9, 200, 17, 33, 4], [7, 7, 250, 2], list(range(40, 75))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ENGINE = EngineConfig(max_model_len=256, max_seqs=4, max_batch_tokens=64, kv_cache_bytes=4 << 20)


@pytest.fixture(scope="module")
def stores(tiny_shards):
    """The packed store (the front's trunk) and shards i/2 and i/4 of it."""
    return tiny_shards


@pytest.fixture(scope="module")
def one_process(tiny_model):
    return [out.outputs[0].token_ids for out in LLM(tiny_model, ENGINE).generate(PROMPTS, GREEDY)]


def _front(packed, owners, infos) -> K3Model:
    # float32: compared byte for byte with the float32 resident model
    front = StreamOptions(ram_budget=trunk_budget(packed), trunk_dtype="float32")
    return K3Model(ExpertParallelSource(StreamingSource(packed, front), owners, infos))


def test_split_gives_each_owner_its_run_of_pairs_in_order():
    ids = np.array([0, 1, 5, 6, 7])  # experts with pairs, ascending; 4 per owner
    tokens = np.array([0, 2, 1, 1, 2, 0, 3, 2])  # pairs grouped by expert; token 3 only on owner 1
    starts, ends = np.array([0, 2, 3, 5, 7]), np.array([2, 3, 5, 7, 8])
    z = np.arange(8, dtype=np.float32).reshape(4, 2)  # [T=4, LT=2]
    calls = split_by_owner(ids, z, tokens, starts, ends, experts_per_owner=4)
    assert [c.owner for c in calls] == [0, 1]
    first, second = calls
    assert first.expert_ids.tolist() == [0, 1] and first.starts.tolist() == [0, 2] and first.ends.tolist() == [2, 3]
    assert np.array_equal(first.z[first.tokens], z[tokens[:3]]) and first.z.shape == (3, 2)  # distinct tokens only
    assert second.expert_ids.tolist() == [5, 6, 7] and second.ends.tolist() == [2, 4, 5]
    assert np.array_equal(second.z[second.tokens], z[tokens[3:]]) and second.z.shape == (4, 2)


def test_in_process_owners_under_small_budgets_give_the_bits_of_one_process(stores, tiny_model, one_process):
    packed, shards = stores
    owners = LocalOwners([ExpertOwnerCore(str(path), ShardOptions(ram_budget=3 * packed.expert_stride), i)
                          for i, path in enumerate(shards[4])])
    model = _front(packed, owners, owners.infos)
    ids = PROMPTS[2]
    assert np.array_equal(model.logits(ids, "full"), tiny_model.logits(ids, "full"))
    assert np.array_equal(model.logits(ids[:12], "incremental"), tiny_model.logits(ids[:12], "incremental"))
    llm = LLM(model, ENGINE)
    assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)] == one_process
    stats = model.source.stats().owners
    assert all(s.expert_requests > 0 and s.expert_misses > s.expert_retained >= 0 for s in stats)
    assert model.source.network.calls > model.source.network.layers > 0
    model.source.check_integrity()
    model.source.close()


def test_owners_must_hold_their_own_shard(stores):
    packed, shards = stores
    owners = LocalOwners([ExpertOwnerCore(str(path), ShardOptions(), i) for i, path in enumerate(shards[2])])
    with pytest.raises(K3Error, match="needs shard 0/4"):
        ExpertParallelSource(StreamingSource(packed, StreamOptions(ram_budget=trunk_budget(packed))), owners,
                             owners.infos + owners.infos)
    with pytest.raises(K3Error, match="owner 1 opened .* which is shard 0/2"):
        ExpertOwnerCore(str(shards[2][0]), ShardOptions(), 1)
    owners.close()


def test_owners_as_ray_actors_give_the_bits_of_one_process(local_ray, stores, tiny_model, one_process):
    from k3serve.cluster.expert_actors import load_expert_parallel

    packed, shards = stores
    front = StreamOptions(ram_budget=trunk_budget(packed), trunk_dtype="float32")  # byte for byte with float32
    ep = load_expert_parallel(packed.path, shards[2], front, ShardOptions(ram_budget=3 * packed.expert_stride),
                              cpus_per_owner=0.25)
    try:
        model = ep.loaded.model
        assert os.getpid() not in {info.pid for info in ep.source.infos}  # the experts run elsewhere
        assert np.array_equal(model.logits(PROMPTS[0], "full"), tiny_model.logits(PROMPTS[0], "full"))
        assert [out.outputs[0].token_ids for out in LLM(model, ENGINE).generate(PROMPTS, GREEDY)] == one_process
        per_owner = ep.source.stats().owners
        assert [s.expert_requests > 0 and s.expert_bytes_read > 0 for s in per_owner] == [True, True]
        assert ep.source.network.bytes_received > 0 and ep.source.network.per_owner_calls[1] > 0
        ep.source.check_integrity()
    finally:
        ep.source.close()
    import ray
    from ray.exceptions import RayActorError

    # closing the source stopped the owners: ray.kill is asynchronous, so a call made at once may still be served;
    # within 30 s every call must fail with RayActorError
    deadline = time.monotonic() + 30
    with pytest.raises(RayActorError):
        while time.monotonic() < deadline:
            ray.get(ep.source.owners.actors[0].info.remote(), timeout=30)
            time.sleep(0.2)


def _crashing_owners(shards, budget, marker, max_restarts):
    """Ray owners whose owner 1 exits in the middle of a call whenever `marker` exists (it deletes the marker
    first, so its next incarnation runs on)."""
    import ray

    from k3serve.cluster.expert_actors import OwnerActor, RayOwners

    class CrashingOwner(OwnerActor):
        def run(self, call):
            if self.core.info.index == 1 and os.path.exists(marker):
                os.remove(marker)
                os._exit(1)
            return super().run(call)

    return RayOwners(shards, ShardOptions(ram_budget=budget), cpus_per_owner=0.25, max_restarts=max_restarts,
                     actor_class=ray.remote(CrashingOwner))


def test_an_owner_that_dies_mid_call_is_restarted_and_its_calls_give_the_same_bits(local_ray, stores, one_process,
                                                                                    tmp_path):
    packed, shards = stores
    marker = tmp_path / "crash-owner-1"
    owners = _crashing_owners(shards[2], 3 * packed.expert_stride, str(marker), max_restarts=2)
    first_pid = owners.infos[1].pid
    run_all, calls = owners.run_all, []

    def crash_twice(batch):  # owner 1 dies inside the 3rd and the 20th layer's calls
        calls.append(len(batch))
        if len(calls) in (3, 20):
            marker.touch()
        return run_all(batch)

    owners.run_all = crash_twice
    model = _front(packed, owners, owners.infos)
    try:
        llm = LLM(model, ENGINE)
        assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)] == one_process
        assert len(calls) > 20 and not marker.exists()
        assert owners.restarts == [0, 2] and owners.infos[1].pid != first_pid
        model.source.check_integrity()
        # /metrics: the restarts, the calls, and each owner's counters (owner 1's since its last start)
        snap, per_owner = llm.engine.metrics.snapshot(), model.source.stats().owners
        assert snap["expert_owner_restarts"] == {"0": 0, "1": 2}
        assert snap["expert_parallel_calls"] == model.source.network.calls > 0
        assert snap["expert_parallel_bytes_received"] == model.source.network.bytes_received > 0
        assert snap["expert_owner_requests"] == {str(i): s.expert_requests for i, s in enumerate(per_owner)}
        assert 0 < per_owner[1].steps < model.source.stats().stream.steps  # owner 1 counts from its restart
    finally:
        model.source.close()


def test_an_owner_that_cannot_restart_fails_the_call_with_a_clear_error(local_ray, stores, tmp_path):
    packed, shards = stores
    marker = tmp_path / "crash-owner-1"
    owners = _crashing_owners(shards[2], None, str(marker), max_restarts=0)
    model = _front(packed, owners, owners.infos)
    try:
        marker.touch()
        with pytest.raises(K3Error, match=r"expert owner 1 died and its calls were lost \(no restarts"):
            model.logits(PROMPTS[2], "full")
        assert owners.restarts == [0, 0]
    finally:
        model.source.close()
