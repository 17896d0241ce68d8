"""Tenants (serve/tenants.py, cli/tenants.py): the file and its errors, key hashes, quotas over a sliding
minute, reload on SIGHUP; then over HTTP with the official openai client: 401, 429 with Retry-After and the
x-ratelimit-* headers, 400 naming the cap, per-tenant metrics, and a reload that drops no request."""

from __future__ import annotations

import argparse
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from openai import AuthenticationError as OpenAIAuthError
from openai import BadRequestError, OpenAI, RateLimitError

from k3serve.cli.main import main
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.loading import load_model
from k3serve.serve.api import create_app
from k3serve.cli.tenants import install_reload, registry_for_serve, warn_if_open
from k3serve.serve.tenants import (CapExceeded, QuotaExceeded, TenantRegistry, TenantsError, hash_key,
                                   parse_tenants)

MODEL = "k3-test"
ALICE, BOB, CAROL, OPS, DAVE = "sk-alice-123", "sk-bob-456", "sk-carol-789", "sk-ops-000", "sk-dave-321"


def _file(**tenants: dict) -> str:
    lines = []
    for name, fields in tenants.items():
        lines.append(f"[tenants.{name}]")
        for key, value in fields.items():
            if key == "keys":
                value = "[" + ", ".join(f'"{hash_key(k)}"' for k in value) + "]"
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


GOOD = _file(alice={"keys": [ALICE], "weight": 2.0, "priority": 1, "requests_per_minute": 3,
                    "tokens_per_minute": 400, "max_concurrent": 2, "kv_share": 0.5, "max_context": 96},
             bob={"keys": [BOB]}, ops={"keys": [OPS], "admin": "true"},
             dave={"keys": [DAVE], "requests_per_minute": 2, "tokens_per_minute": 1000})


def test_hash_key_is_sha256_hex_and_the_cli_prints_it(capsys):
    assert hash_key("abc") == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert main(["tenants", "hash-key", "abc"]) == 0
    assert capsys.readouterr().out.strip() == hash_key("abc")


def test_a_good_file_parses_into_tenants_and_shares():
    config = parse_tenants(GOOD)
    alice = config.get("alice")
    assert alice.keys == (hash_key(ALICE),) and alice.max_context == 96 and alice.kv_share == 0.5
    assert config.get("bob").requests_per_minute is None and config.get("bob").weight == 1.0
    assert config.shares()["alice"].weight == 2.0 and config.shares()["alice"].priority == 1
    assert ALICE not in GOOD  # only hashes are stored


@pytest.mark.parametrize("text, fragments", [
    ("[tenants.a\nkeys = 1", ["not valid TOML"]),
    (_file(a={"keys": [ALICE]}, b={"keys": [ALICE]}), ["tenant 'b'", "'keys'", "also a key of tenant 'a'"]),
    (_file(a={"keys": [ALICE], "requests_per_minute": 0}), ["tenant 'a'", "'requests_per_minute'"]),
    (_file(a={"keys": [ALICE], "tokens_per_minute": -5}), ["tenant 'a'", "'tokens_per_minute'"]),
    (_file(a={"keys": [ALICE], "max_concurrent": 1.5}), ["tenant 'a'", "'max_concurrent'"]),
    (_file(a={"keys": [ALICE], "weight": -1}), ["tenant 'a'", "'weight'"]),
    (_file(a={"keys": [ALICE], "kv_share": 0}), ["tenant 'a'", "'kv_share'"]),
    (_file(a={"keys": [ALICE], "burst": 3}), ["tenant 'a'", "unknown field 'burst'"]),
    (_file(a={"weight": 1}), ["tenant 'a'", "'keys'", "missing"]),
    ('[tenants.a]\nkeys = ["sk-plain-key"]\n', ["tenant 'a'", "'keys'", "never plain keys"]),
    ("[other]\nx = 1\n", ["unknown top-level"]),
])
def test_a_bad_file_names_the_tenant_and_field(text, fragments):
    with pytest.raises(TenantsError) as info:
        parse_tenants(text)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_a_bad_file_stops_the_server_before_it_starts(tmp_path, capsys):
    bad = tmp_path / "tenants.toml"
    bad.write_text(_file(a={"keys": [ALICE], "tokens_per_minute": 0}))
    assert main(["serve", "--tenants", str(bad), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "tenant 'a'" in err and "tokens_per_minute" in err and "Traceback" not in err


def test_serve_passes_scheduling_and_step_interruption_to_the_engine():
    from k3serve.cli.main import _engine_config, build_parser

    args = build_parser().parse_args(["serve", "--scheduling", "priority", "--step-interruption"])
    config = _engine_config(args)
    assert config.scheduling == "priority" and config.step_interruption is True
    # the server's default: on wherever it can help (the engine resolves it against its model and policy)
    assert _engine_config(build_parser().parse_args(["serve"])).step_interruption == "auto"
    assert _engine_config(build_parser().parse_args(["serve", "--step-interruption", "off"])).step_interruption \
        is False


def test_an_open_server_beyond_loopback_warns(capsys):
    registry = registry_for_serve(argparse.Namespace(tenants=None))
    assert registry.open
    warn_if_open(registry, "0.0.0.0")
    assert "without --tenants" in capsys.readouterr().err
    for host in ("127.0.0.1", "localhost", "::1"):
        warn_if_open(registry, host)
    warn_if_open(TenantRegistry(parse_tenants(GOOD)), "0.0.0.0")  # closed: no warning
    assert capsys.readouterr().err == ""


def test_quotas_over_a_sliding_minute_with_retry_after():
    now = [1000.0]
    registry = TenantRegistry(parse_tenants(GOOD), clock=lambda: now[0])
    assert registry.authenticate(f"Bearer {ALICE}") == "alice"
    first = registry.admit("alice", 100)
    assert first.headers["x-ratelimit-remaining-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-tokens"] == "300"
    second = registry.admit("alice", 100)
    with pytest.raises(QuotaExceeded) as info:  # two in flight
        registry.admit("alice", 10)
    assert info.value.reason == "max_concurrent"
    first.finish(tokens_used=40)  # corrected down from the estimate of 100
    second.finish(tokens_used=100)
    now[0] += 10
    with pytest.raises(QuotaExceeded) as info:  # 140 + 300 > 400
        registry.admit("alice", 300)
    assert info.value.reason == "tokens_per_minute"
    assert info.value.headers["x-ratelimit-limit-tokens"] == "400"
    assert info.value.headers["x-ratelimit-remaining-tokens"] == "260"
    assert info.value.headers["retry-after"] == "50"  # the first request leaves the window 60 s after it came
    registry.admit("alice", 10).finish()
    with pytest.raises(QuotaExceeded) as info:  # the 4th request in a minute
        registry.admit("alice", 10)
    assert info.value.reason == "requests_per_minute" and info.value.retry_after == 50
    now[0] += 51
    registry.admit("alice", 10).finish()  # the window slid
    assert registry.in_flight("alice") == 0
    for _ in range(50):  # bob has no quota
        registry.admit("bob", 10_000)


def test_caps_a_request_can_never_fit():
    registry = TenantRegistry(parse_tenants(GOOD))

    def capacity(kv_share):
        return int(4 * kv_share), int(1000 * kv_share)

    with pytest.raises(CapExceeded) as info:
        registry.check_caps("alice", [90], 10, 1, capacity)
    assert info.value.cap == "max_context"
    with pytest.raises(CapExceeded) as info:
        registry.check_caps("alice", [90] * 4, 6, 2, capacity)  # 360 + 48 tokens > 400
    assert info.value.cap == "tokens_per_minute"
    with pytest.raises(CapExceeded) as info:
        registry.check_caps("alice", [10], 10, 3, capacity)  # 3 sequences > half of 4
    assert info.value.cap == "kv_share"
    registry.check_caps("alice", [10], 10, 2, capacity)
    registry.check_caps("bob", [5000], 5000, 64, capacity)


def test_sighup_reloads_and_a_bad_file_keeps_the_old_config(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)
    applied = []
    registry = TenantRegistry.from_file(path, on_reload=applied.append)
    previous = signal.getsignal(signal.SIGHUP)
    install_reload(registry)
    try:
        path.write_text(_file(carol={"keys": [CAROL]}))
        os.kill(os.getpid(), signal.SIGHUP)
        _wait(lambda: len(applied) == 1)
        assert registry.authenticate(f"Bearer {CAROL}") == "carol"
        path.write_text(_file(dave={"keys": [ALICE], "weight": 0}))
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.5)
        assert len(applied) == 1 and registry.authenticate(f"Bearer {CAROL}") == "carol"
        with pytest.raises(Exception, match="incorrect API key"):
            registry.authenticate(f"Bearer {ALICE}")
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_reload_the_engines_refuse_keeps_the_old_config_and_logs_why(tmp_path, caplog):
    import logging

    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)

    def refuse(config) -> None:
        raise RuntimeError("replica 1 is restarting")

    registry = TenantRegistry.from_file(path, on_reload=refuse)
    caplog.set_level(logging.INFO, logger="k3serve.serve.tenants")
    path.write_text(_file(carol={"keys": [CAROL]}))
    assert registry.reload() is False  # nothing raised out of the reload (SIGHUP's thread printed a traceback)
    assert registry.authenticate(f"Bearer {ALICE}") == "alice"  # the old configuration, whole
    with pytest.raises(Exception, match="incorrect API key"):
        registry.authenticate(f"Bearer {CAROL}")
    messages = [r.getMessage() for r in caplog.records]
    assert any("tenants reload refused" in m and "replica 1 is restarting" in m for m in messages), messages
    assert not any("tenants reloaded" in m for m in messages)


def _wait(condition, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


# ---- over HTTP ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory, run_server):
    path = Path(tmp_path_factory.mktemp("tenants")) / "tenants.toml"
    path.write_text(GOOD)
    loaded = load_model(None)
    engine = LLMEngine(loaded.model, EngineConfig(max_model_len=256, max_seqs=16, kv_cache_bytes=16 << 20,
                                                  scheduling="fair"), stop_ids=loaded.stop_ids)
    registry = TenantRegistry.from_file(path, on_reload=lambda config: engine.set_tenant_shares(config.shares()))
    with run_server(create_app(engine, loaded.tokenizer, MODEL, tenants=registry)) as url:
        yield url, engine, registry, path


def _client(url: str, key: str | None) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=key or "", max_retries=0, timeout=60)


def test_a_missing_or_unknown_key_is_401(tenant_server):
    url = tenant_server[0]
    with pytest.raises(OpenAIAuthError) as info:
        _client(url, "sk-nobody").completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"
    response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 401 and "missing API key" in response.json()["error"]["message"]
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # not behind a key


def test_a_request_over_a_cap_is_400_naming_it(tenant_server):
    url = tenant_server[0]
    with pytest.raises(BadRequestError) as info:
        _client(url, ALICE).completions.create(model=MODEL, prompt="def f(x):", max_tokens=200)
    assert info.value.body["param"] == "max_context" and "max_context = 96" in info.value.body["message"]


def test_quota_429_with_retry_after_and_rate_headers_then_success_for_others(tenant_server):
    url, engine, registry, _ = tenant_server
    client = _client(url, ALICE)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="import os", max_tokens=4)
    assert raw.headers["x-ratelimit-limit-requests"] == "3"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 400
    statuses = []
    for _ in range(3):
        try:
            client.completions.create(model=MODEL, prompt="import os", max_tokens=4)
            statuses.append(200)
        except RateLimitError as exc:
            statuses.append(429)
            headers = exc.response.headers
            assert int(headers["retry-after"]) >= 1
            for name in ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                         "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens"):
                assert name in headers
            assert headers["x-ratelimit-remaining-requests"] == "0"
    assert statuses == [200, 200, 429]
    out = _client(url, BOB).completions.create(model=MODEL, prompt="import os", max_tokens=4)
    assert out.usage.completion_tokens == 4  # bob is not limited by alice's quota
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {OPS}"}).text
    assert 'k3serve_tenant_rejections_total{reason="requests_per_minute",tenant="alice"} 1.0' in metrics
    assert 'k3serve_tenant_requests_total{tenant="bob"}' in metrics
    assert 'k3serve_tenant_virtual_counter{tenant="alice"}' in metrics
    assert 'k3serve_tenant_queue_seconds_bucket{le="+Inf",tenant="alice"}' in metrics
    assert 'k3serve_tenant_rejections_total{reason="unauthenticated",tenant="unknown"}' in metrics


def test_a_request_refused_as_over_the_context_is_not_charged(tenant_server):
    url = tenant_server[0]
    client = _client(url, DAVE)
    long_text = "x = 1\n" * 200  # over the server's 256-token context, under dave's 1000 tokens per minute
    for endpoint in ("completions", "chat", "completions", "chat"):  # charged, the third would be a 429
        with pytest.raises(BadRequestError) as info:
            if endpoint == "chat":
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_text}])
            else:
                client.completions.create(model=MODEL, prompt=long_text, max_tokens=8)
        assert info.value.body["code"] == "context_length_exceeded"
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"  # only this request counted
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) >= 1000 - 16
    assert tenant_server[2].in_flight("dave") == 0


def test_a_lease_refund_uncharges_the_request_and_its_tokens():
    now = [0.0]
    registry = TenantRegistry(parse_tenants(GOOD), clock=lambda: now[0])
    for _ in range(5):
        registry.admit("dave", 900).refund()
    lease = registry.admit("dave", 900)
    assert lease.headers["x-ratelimit-remaining-requests"] == "1"
    assert lease.headers["x-ratelimit-remaining-tokens"] == "100"
    lease.finish(50)
    assert registry.in_flight("dave") == 0


def test_metrics_need_an_admin_tenants_key(tenant_server):
    url = tenant_server[0]
    for headers, status, kind in (({}, 401, "authentication_error"),
                                  ({"Authorization": "Bearer sk-nobody"}, 401, "authentication_error"),
                                  ({"Authorization": f"Bearer {BOB}"}, 403, "permission_error")):
        response = httpx.get(url + "/metrics", headers=headers)
        assert response.status_code == status
        error = response.json()["error"]
        assert error["type"] == kind and set(error) == {"message", "type", "param", "code"}
        assert "alice" not in response.text
        assert status == 401 or "admin = true" in error["message"]
    response = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {OPS}"})
    assert response.status_code == 200 and "k3serve_http_requests_total" in response.text


def test_admin_must_be_a_boolean():
    with pytest.raises(TenantsError, match="tenant 'a': field 'admin'"):
        parse_tenants(_file(a={"keys": [ALICE], "admin": 1}))
    assert not parse_tenants(GOOD).get("alice").admin and parse_tenants(GOOD).get("ops").admin


def test_docs_pages_that_load_a_cdn_are_off_and_the_schema_stays(open_server):
    url = open_server[0]
    assert httpx.get(url + "/docs").status_code == 404
    assert httpx.get(url + "/redoc").status_code == 404
    assert "/v1/chat/completions" in httpx.get(url + "/openapi.json").json()["paths"]


def test_reload_keeps_requests_in_flight_and_refuses_a_bad_file(tenant_server):
    url, engine, registry, path = tenant_server
    bob = _client(url, BOB)
    stream = bob.completions.create(model=MODEL, prompt="class A:", max_tokens=24, stream=True,
                                    extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]
    path.write_text(_file(bob={"keys": [BOB], "weight": 3.0}, carol={"keys": [CAROL]}))
    assert registry.reload()
    chunks += list(stream)  # the request in flight carries on to its end
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length" and text
    assert _client(url, CAROL).completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1
    _wait(lambda: engine.scheduler.policy.share("bob").weight == 3.0)
    with pytest.raises(OpenAIAuthError):  # alice is gone from the new file
        _client(url, ALICE).completions.create(model=MODEL, prompt="x", max_tokens=1)
    path.write_text("[tenants.bob\n")
    assert not registry.reload()
    assert _client(url, CAROL).completions.create(model=MODEL, prompt="y", max_tokens=1).usage.completion_tokens == 1


# ---- open mode (no tenants file) ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def open_server(run_server):
    loaded = load_model(None)
    engine = LLMEngine(loaded.model, EngineConfig(max_model_len=256, max_seqs=16, kv_cache_bytes=16 << 20,
                                                  scheduling="fair"), stop_ids=loaded.stop_ids)
    with run_server(create_app(engine, loaded.tokenizer, MODEL)) as url:
        yield url, engine


def _complete(url: str, key: str | None, prompt: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(url + "/v1/completions", headers=headers, timeout=60,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    return response


def test_an_open_server_keeps_no_state_or_label_per_client_key(open_server):
    url, engine = open_server
    for i in range(40):  # every client invents its own key
        _complete(url, f"sk-random-{i:04d}-{'x' * 40}", "x = 1")
    _complete(url, None, "x = 1")
    metrics = httpx.get(url + "/metrics").text  # open mode: no key needed
    assert set(re.findall(r'tenant="([^"]*)"', metrics)) == {"anonymous"}
    assert "sk-random" not in metrics
    assert set(engine.scheduler.policy.counters) == {"anonymous"}


def test_an_open_server_still_keeps_keys_apart_in_the_prefix_cache(open_server):
    url, engine = open_server
    hits = engine.metrics.counter("prefix_cache_hit_tokens")
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    _complete(url, "sk-first", prompt)
    before = hits.value
    _complete(url, "sk-second", prompt)  # another key: a miss
    _complete(url, None, prompt)  # no key: a miss
    assert hits.value == before
    _complete(url, "sk-first", prompt + "print(fibonacci(10))\n")  # the same key: a hit on the shared prefix
    assert hits.value > before
