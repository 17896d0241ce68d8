"""Schemathesis against the server's own /openapi.json on loopback: bodies that fit the schema and bodies that do
not, a bounded number of each per operation (deterministic: derandomized), and never a 5xx; afterwards the server
is healthy, the engine idle and its pools intact, and a normal request is served."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.loading import load_model
from k3serve.serve.api import create_app

MODEL = "k3-fuzz"
MAX_EXAMPLES = 40  # per operation and mode: ~300 requests in all, ~30 s on 2 shared cores


@pytest.fixture(scope="module")
def served(run_server):
    loaded = load_model(None)
    # a short context bounds what any fuzzed request can cost: prompt + max_tokens <= 48 tokens, n <= 16
    engine = LLMEngine(loaded.model, EngineConfig(max_model_len=48, max_seqs=32, max_batch_tokens=256,
                                                  kv_cache_bytes=16 << 20), stop_ids=loaded.stop_ids)
    with run_server(create_app(engine, loaded.tokenizer, MODEL, default_max_tokens=4)) as url:
        yield url, engine


def _aim_at_the_model(case):
    """Bodies that fit the schema name the served model, so that they reach the engine instead of stopping at 404
    (the unknown-model path is covered by the bodies that do not fit)."""
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL
    return case


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_the_fuzzer_finds_no_server_error(served, mode):
    url, engine = served
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    statuses: dict[int, int] = {}
    for operation in operations:
        if operation.path == "/metrics" or (mode == GenerationMode.NEGATIVE and operation.method.upper() == "GET"):
            continue

        strategy = operation.as_strategy(generation_mode=mode)

        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy.map(_aim_at_the_model) if mode == GenerationMode.POSITIVE else strategy)
        def fuzz(case) -> None:
            response = case.call(base_url=url, timeout=60)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert error["message"] and error["type"]

        fuzz()
    assert sum(statuses.values()) >= MAX_EXAMPLES, statuses
    if mode == GenerationMode.POSITIVE:
        assert statuses.get(200, 0) > 0, f"no fuzzed request was served: {statuses}"
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
