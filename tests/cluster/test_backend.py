"""Two replicas on a local Ray behind the HTTP API: the same answers as one process, the cache-aware router
sending a conversation back to its replica, and a replica killed mid-run."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from openai import OpenAI

from k3serve.engine.generate import generate
from k3serve.engine.sampling import SamplingParams
from k3serve.loading import default_model_dir, load_model
from k3serve.engine.request import RequestSpec

from .conftest import ENGINE, MAX_MODEL_LEN, MODEL

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of one process (the embedded model, resident)."""
    loaded = load_model(None)

    def run(prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
        tokens, _ = generate(loaded.model, prompt, params, stop_ids=loaded.stop_ids, max_context=MAX_MODEL_LEN)
        return tokens

    return run


async def _collect(stream, timeout: float = 120.0):
    async def run():
        outputs = [output async for output in stream]
        return outputs[-1]
    return await asyncio.wait_for(run(), timeout)


def _submit(backend, prompt, params=GREEDY, tenant="t"):
    return backend.submit(RequestSpec(tuple(prompt), params, tenant=tenant))


def _metric(url: str, line_start: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_front_answers_like_one_process(front, reference):
    url, _, tokenizer = front
    client = OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)
    prompt = "def fibonacci(n):"
    ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    expected = reference(ids)
    stop_ids = set(load_model(None).stop_ids)
    expected_text = tokenizer.decode([t for t in expected if t not in stop_ids and not tokenizer.is_special(t)])
    for _ in range(2):  # both replicas (the second request matches no whole block: least-load sends it elsewhere)
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert answer.choices[0].text == expected_text
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=6, temperature=0, stream=True)
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert _metric(url, 'k3serve_router_decisions_total{reason="no_match"}') >= 2
    assert _metric(url, 'k3serve_replica_load{replica="0"}') == 0.0


def test_a_conversation_goes_back_to_its_replica_and_hits_its_cache(front, reference):
    url, backend, _ = front

    async def scenario():
        turn1 = list(range(200, 280))  # 80 tokens: 5 whole blocks
        first = _submit(backend, turn1)
        out1 = await _collect(first)
        turn2 = turn1 + out1.outputs[0].token_ids + list(range(300, 320))
        second = _submit(backend, turn2)
        out2 = await _collect(second)
        return first, second, out2, turn2

    first, second, out2, turn2 = asyncio.run(scenario())
    assert second.route.replica == first.route.replica and second.route.reason == "prefix_match"
    assert out2.num_cached_tokens >= 80  # the replica's prefix cache served the first turn
    assert out2.outputs[0].token_ids == reference(turn2)  # a cache hit changes nothing
    assert _metric(url, "k3serve_cluster_prefix_hit_rate") > 0
    # the replica's own engine, read at the scrape: it generated both turns and holds their checkpoints
    served = f'{{replica="{first.route.replica}"}}'
    assert _metric(url, "k3serve_replica_engine_generation_tokens" + served) >= len(out2.outputs[0].token_ids) + 1
    assert _metric(url, "k3serve_replica_engine_prefix_cache_checkpoints" + served) >= 1


def test_bad_requests_are_refused_before_routing(front):
    url, backend, _ = front
    from k3serve.errors import RequestError

    for prompt in ([], [10**6], ["a"], [True]):
        with pytest.raises(RequestError):
            _submit(backend, prompt)
    response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5000], "max_tokens": 2})
    assert response.status_code == 400 and "0..1031" in response.json()["error"]["message"]
    assert sum(backend.router.load) == 0


def test_a_killed_replica_fails_over_and_comes_back(front, reference, local_ray):
    url, backend, _ = front
    ray = local_ray
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def scenario():
        streams = [_submit(backend, list(range(10 + 40 * i, 50 + 40 * i)), long) for i in range(4)]
        iterators = [s.__aiter__() for s in streams]
        for iterator in iterators:  # every request has streamed its first token
            output = await asyncio.wait_for(iterator.__anext__(), 60)
            assert output.outputs[0].token_ids
        victim = streams[0].route.replica
        assert {s.route.replica for s in streams} == {0, 1}
        ray.kill(backend.actors[victim], no_restart=False)
        # a new request on the dying replica, before the front has seen it die: it must be sent elsewhere
        retried = _submit(backend, list(range(10, 50)) + [7] * 40, GREEDY)  # prefix of streams[0]: the victim
        assert retried.route.replica == victim
        health = await asyncio.to_thread(httpx.get, url + "/health")

        async def drain(iterator):
            last = None
            async for output in iterator:
                last = output
            return last

        finals = await asyncio.wait_for(asyncio.gather(*(drain(it) for it in iterators)), 180)
        retried_final = await _collect(retried)
        return streams, finals, retried, retried_final, victim, health

    streams, finals, retried, retried_final, victim, health = asyncio.run(scenario())
    assert health.status_code == 200
    for stream, final in zip(streams, finals):
        assert final.finished
        if stream.route.replica == victim:
            assert final.error is not None and f"replica {victim} died" in final.error
        else:
            assert final.error is None and len(final.outputs[0].token_ids) == 400
    assert retried_final.error is None and retried.route.replica != victim
    assert retried_final.outputs[0].token_ids == reference(list(range(10, 50)) + [7] * 40)
    assert _metric(url, "k3serve_router_retries_total") >= 1
    assert _metric(url, f'k3serve_replica_failures_total{{replica="{victim}"}}') == 1
    assert sum(backend.router.load) == 0  # every request's load was released
    deadline = time.time() + 120  # Ray restarts the actor; the monitor puts it back
    while not backend.router.healthy[victim]:
        assert time.time() < deadline, "the killed replica did not come back"
        time.sleep(0.5)
    assert _metric(url, f'k3serve_replica_healthy{{replica="{victim}"}}') == 1.0

    async def after_restart():  # both replicas serve again (distinct prompts spread over the least loaded)
        streams = [_submit(backend, list(range(400 + 50 * i, 420 + 50 * i)), GREEDY) for i in range(2)]
        return streams, await asyncio.gather(*(_collect(s) for s in streams))

    streams, answers = asyncio.run(after_restart())
    assert {s.route.replica for s in streams} == {0, 1} and all(a.error is None for a in answers)


def test_a_replica_streaming_under_a_ram_budget_answers_like_one_process(local_ray, reference, tmp_path):
    from k3serve.cluster.backend import ClusterBackend
    from k3serve.cluster.router import RouterConfig
    from k3serve.cluster.spec import ReplicaSpec
    from k3serve.stream.options import StreamOptions
    from k3serve.weights.pack import pack_checkpoint

    packed = tmp_path / "packed"
    pack_checkpoint(default_model_dir(), packed)
    spec = ReplicaSpec(model=packed, stream=StreamOptions(ram_budget=4 << 20), engine=ENGINE, speculative=None)
    backend = ClusterBackend(spec, 1, RouterConfig(policy="least-load"))  # its own store, its own 4 MiB budget
    try:
        prompts = [list(range(10, 40)), list(range(600, 650))]
        finals = asyncio.run(asyncio.wait_for(_both(backend, prompts), 120))
        snap = backend.metrics.snapshot()  # the replica's streaming counters, read from it
    finally:
        backend.shutdown()
    assert [f.outputs[0].token_ids for f in finals] == [reference(p) for p in prompts]
    assert snap["replica_engine_weights_expert_bytes_read"]["0"] > 0
    assert 0 < snap["replica_engine_expert_retention"]["0"] < 1


async def _both(backend, prompts):
    return await asyncio.gather(*(_collect(_submit(backend, p)) for p in prompts))


def test_structured_output_is_served_by_the_replicas(front):
    import json

    url, backend, _ = front
    client = OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    answers = [client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"give json {i}"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}) for i in range(2)]
    for answer in answers:  # the grammar's text travelled and the replica masked every token with it
        assert answer.choices[0].finish_reason == "stop"
        parsed = json.loads(answer.choices[0].message.content)
        assert list(parsed) == ["a"] and isinstance(parsed["a"], int)
    assert sum(backend.router.load) == 0


def _own_backend(max_restarts: int, num_replicas: int = 2, cpus_per_replica: float = 0.5):
    """Replicas of a fraction of a CPU each (beside the session's front, in one CPU) behind least-load, restarted
    `max_restarts` times."""
    from k3serve.cluster.backend import ClusterBackend
    from k3serve.cluster.router import RouterConfig
    from k3serve.cluster.spec import ReplicaSpec

    return ClusterBackend(ReplicaSpec(model=None, stream=None, engine=ENGINE, speculative=None), num_replicas,
                          RouterConfig(policy="least-load"), max_restarts=max_restarts,
                          cpus_per_replica=cpus_per_replica)


def test_a_whole_request_on_a_dying_replica_starts_over_on_another(local_ray, reference):
    ray = local_ray
    long = SamplingParams(temperature=0.0, max_tokens=450, ignore_eos=True)
    prompt = list(range(20, 60))
    backend = _own_backend(max_restarts=0)

    async def scenario():
        stream = backend.submit(RequestSpec(tuple(prompt), long, tenant="t", streamed=False))
        iterator = stream.__aiter__()
        first = await iterator.__anext__()
        assert first.outputs[0].token_ids and not first.finished  # the replica has generated tokens, not all
        victim = stream.route.replica
        ray.kill(backend.actors[victim], no_restart=False)
        final = first
        async for output in iterator:
            final = output
        return stream, victim, final

    try:
        stream, victim, final = asyncio.run(asyncio.wait_for(scenario(), 180))
        retries = backend.metrics.snapshot()["router_retries_total"]
    finally:
        backend.shutdown()
    assert final.error is None, final.error  # not "died after streaming tokens": the client had received nothing
    assert stream.route.replica != victim and retries == 1
    assert final.outputs[0].token_ids == reference(prompt, long)  # started over: no token of the dead replica kept


def test_a_replica_dead_after_its_last_restart_is_gone_and_health_says_degraded(local_ray, caplog):
    import logging

    from k3serve.cli.cluster import front_tokenizer
    from k3serve.serve.api import create_app
    from k3serve.serve.threaded import serve_in_thread

    caplog.set_level(logging.WARNING, logger="k3serve.cluster.backend")
    backend = _own_backend(max_restarts=0)
    submitted = []
    submit = backend.submit

    def recording_submit(spec):
        submitted.append(spec.streamed)
        return submit(spec)

    backend.submit = recording_submit
    with serve_in_thread(create_app(backend, front_tokenizer(None), MODEL)) as url:
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        local_ray.kill(backend.actors[0], no_restart=False)  # idle: only the monitor can see it die
        deadline = time.time() + 60
        while (health := httpx.get(url + "/health")).json()["status"] == "ok":
            assert time.time() < deadline, "/health stayed ok with a replica gone for good"
            time.sleep(0.2)
        answer = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3},
                            timeout=120)
        assert answer.status_code == 200, answer.text  # the other replica serves
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "degraded"
    assert "replica 0 died after its last restart" in body["reason"] and "gone for good" in body["reason"]
    assert "1 of 2 replicas serve" in body["reason"]
    assert backend.gone == [True, False] and submitted == [False]  # the API says a whole response is not streamed
    messages = [r.getMessage() for r in caplog.records if r.name == "k3serve.cluster.backend"]
    assert any("replica 0 died" in m and "gone for good" in m for m in messages), messages
    assert not any("until Ray restarts it" in m for m in messages), messages


def _wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.2)


def test_a_restarted_replica_comes_back_with_the_current_tenant_shares(local_ray):
    from k3serve.engine.fairness import TenantShare

    ray = local_ray
    shares = {"alice": TenantShare(weight=3.0, priority=1, kv_share=0.5), "bob": TenantShare(kv_share=0.25)}
    backend = _own_backend(max_restarts=1)
    try:
        backend.set_tenant_shares(shares)
        assert ray.get([a.tenant_shares.remote() for a in backend.actors]) == [shares, shares]
        ray.kill(backend.actors[1], no_restart=False)  # idle: the monitor sees the new process
        _wait_until(lambda: backend.restarts[1] == 1 and backend.router.healthy[1], 120,
                    "the killed replica did not come back")
        assert ray.get(backend.actors[1].tenant_shares.remote()) == shares  # before it serves any request
        assert ray.get(backend.actors[0].tenant_shares.remote()) == shares
    finally:
        backend.shutdown()


def test_a_reload_while_replicas_die_and_restart_applies_everywhere_and_says_reloaded(local_ray, tmp_path, caplog):
    """The reload SIGHUP runs (`TenantRegistry.reload`), while one replica is dead for good and one restarts."""
    import logging

    from k3serve.engine.fairness import TenantShare
    from k3serve.serve.tenants import TenantRegistry

    ray = local_ray
    caplog.set_level(logging.INFO)
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.alice]\nkeys = ["sha256:' + "a" * 64 + '"]\nweight = 1.0\n')
    backend = _own_backend(max_restarts=1, num_replicas=3, cpus_per_replica=0.3)
    try:
        registry = TenantRegistry.from_file(path, on_reload=lambda config: backend.set_tenant_shares(config.shares()))
        backend.set_tenant_shares(registry.shares())
        path.write_text('[tenants.alice]\nkeys = ["sha256:' + "a" * 64 + '"]\nweight = 5.0\npriority = 2\n')
        new = {"alice": TenantShare(weight=5.0, priority=2)}
        ray.kill(backend.actors[0], no_restart=True)  # gone for good
        ray.kill(backend.actors[1], no_restart=False)  # Ray restarts it
        assert registry.reload() is True
        assert registry.shares() == new
        assert ray.get(backend.actors[2].tenant_shares.remote()) == new  # the serving replica took them at once
        _wait_until(lambda: backend.restarts[1] == 1 and backend.router.healthy[1], 120,
                    "the restarting replica did not come back")
        assert ray.get(backend.actors[1].tenant_shares.remote()) == new  # the restarted one before it served
    finally:
        backend.shutdown()
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("k3serve")]
    assert any(m.startswith("tenants reloaded from") for m in messages), messages
    assert not any("refused" in m for m in messages), messages
    assert not any(r.exc_info for r in caplog.records if r.name.startswith("k3serve"))


def test_shares_a_replica_refuses_are_undone_everywhere_and_the_reload_says_why(local_ray, tmp_path, caplog):
    import logging

    from k3serve.serve.tenants import TenantRegistry

    caplog.set_level(logging.INFO)
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.alice]\nkeys = ["sha256:' + "a" * 64 + '"]\nweight = 2.0\n')
    backend = _own_backend(max_restarts=0)
    try:
        registry = TenantRegistry.from_file(path, on_reload=lambda config: backend.set_tenant_shares(
            {**config.shares(), "mallory": "not a share"}))  # every replica's engine refuses this
        old = registry.shares()
        backend.set_tenant_shares(old)
        path.write_text('[tenants.alice]\nkeys = ["sha256:' + "a" * 64 + '"]\nweight = 7.0\n')
        assert registry.reload() is False
        assert registry.shares() == old and backend.shares == old
        assert local_ray.get([a.tenant_shares.remote() for a in backend.actors]) == [old, old]
    finally:
        backend.shutdown()
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("k3serve")]
    assert any("tenants reload refused" in m and "refused the tenant shares" in m for m in messages), messages
    assert not any(m.startswith("tenants reloaded") for m in messages), messages


def test_forced_tool_calls_and_json_mode_answer_like_serve(front):
    """Parity with `serve`: the same greedy grammar requests (a forced tool call, JSON mode) give the same replies
    from the replicas as from one process."""
    from k3serve.engine.engine import LLMEngine
    from k3serve.serve.api import create_app
    from k3serve.serve.threaded import serve_in_thread

    url, _, _ = front
    loaded = load_model(None)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    requests = [dict(tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                dict(tools=tools, tool_choice="required"), dict(response_format={"type": "json_object"})]

    def answers(base: str) -> list[str | None]:
        client = OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=120)
        return [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                               max_tokens=24, temperature=0, **extra).choices[0].message.content
                for extra in requests]

    cluster = answers(url)
    with serve_in_thread(create_app(LLMEngine(loaded.model, ENGINE, stop_ids=loaded.stop_ids), loaded.tokenizer,
                                    MODEL)) as local:
        single = answers(local)
    assert cluster == single
    assert cluster[0].startswith('{"name":"get_weather","arguments":{')  # the grammar held the replica's tokens


def test_a_replica_killed_for_good_with_restarts_left_is_reported_gone(local_ray):
    """Ray will not restart an actor killed with no_restart, whatever --max-restarts says: the front learns it from
    Ray's answer ("died", not "unavailable") instead of waiting for a restart that never comes."""
    backend = _own_backend(max_restarts=3)
    try:
        local_ray.kill(backend.actors[1], no_restart=True)
        _wait_until(lambda: backend.gone[1], 60, "the replica killed for good was never reported gone")
        reason = backend.degraded
    finally:
        backend.shutdown()
    assert reason is not None and "replica 1 died" not in reason  # its restarts were not used up
    assert "replica 1" in reason and "gone for good" in reason and "1 of 2 replicas serve" in reason
