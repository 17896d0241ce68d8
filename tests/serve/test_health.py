"""/health beyond "the engine runs": a corrupt expert store that fails request after request makes the server
report itself degraded, with the reason, while it keeps serving what it can (serve/health.py)."""

from __future__ import annotations

import httpx
import pytest

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.loading import default_model_dir, load_model
from k3serve.serve.api import create_app
from k3serve.serve.health import FailureWindow
from k3serve.stream.options import StreamOptions
from k3serve.weights.pack import pack_checkpoint
from k3serve.weights.store import PackedStore

MODEL = "k3-test"
CORRUPT = ("StoreCorruptError: expert blob of layer 1 expert 3 in /x/experts.bin at offset 4096 (100 bytes) failed "
           "its CRC-32 check twice; the store is corrupt: repack it with `k3serve pack`")


def test_the_window_names_server_faults_and_forgets_them_after_window_good_requests():
    window = FailureWindow(window=4)
    assert window.reason() is None
    window.record("RuntimeError: a request's own failure")  # one request's problem: not the server's
    window.record(None)
    assert window.reason() is None
    window.record(CORRUPT)
    reason = window.reason()
    assert reason is not None and "1 of the last 3 requests" in reason and "expert store is corrupt" in reason
    assert "layer 1 expert 3" in reason
    for _ in range(3):
        window.record(None)
    assert "1 of the last 4" in window.reason()  # still inside the window
    window.record(None)
    assert window.reason() is None
    with pytest.raises(ValueError):
        FailureWindow(window=0)


@pytest.fixture(scope="module")
def corrupt_store(tmp_path_factory):
    """The embedded model packed, with one byte flipped in every expert blob: each forward fails its CRC twice."""
    folder = tmp_path_factory.mktemp("corrupt") / "packed"
    pack_checkpoint(default_model_dir(), folder)
    store = PackedStore(folder)
    with open(folder / "experts.bin", "r+b") as f:
        for entry in store.experts.values():
            for offset in entry.offsets:
                f.seek(offset + 7)
                byte = f.read(1)
                f.seek(offset + 7)
                f.write(bytes([byte[0] ^ 0xFF]))
    return folder


def test_a_corrupt_store_makes_health_degraded_with_the_reason_and_the_server_keeps_answering(
        run_server, corrupt_store):
    loaded = load_model(corrupt_store, stream=StreamOptions(io="pread", cache="none"))
    engine = LLMEngine(loaded.model, EngineConfig(max_model_len=256, max_seqs=8, max_batch_tokens=256,
                                                  kv_cache_bytes=8 << 20), stop_ids=loaded.stop_ids)
    app = create_app(engine, loaded.tokenizer, MODEL)
    with run_server(app) as url, httpx.Client(base_url=url, timeout=120) as http:
        assert http.get("/health").json() == {"status": "ok"}  # nothing has failed yet
        statuses = []
        for i in range(6):
            response = http.post("/v1/completions", json={"model": MODEL, "prompt": f"hello {i}", "max_tokens": 2})
            statuses.append(response.status_code)
            if response.status_code == 500:
                assert "StoreCorruptError" in response.json()["error"]["message"]
        assert statuses.count(500) >= 1, statuses
        health = http.get("/health")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "degraded", body
        assert "expert store is corrupt" in body["reason"] and "experts.bin" in body["reason"]
        assert f"{statuses.count(500)} of the last 6 requests" in body["reason"]
        assert http.get("/v1/models").status_code == 200  # the server itself still answers
    engine.check_integrity()
