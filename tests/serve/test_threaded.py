"""serve_in_thread: the app answers while the block runs and the port is closed after it."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from k3serve.serve.threaded import serve_in_thread


def test_the_app_answers_inside_the_block_and_not_after():
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, str]:
        return {"answer": "pong"}

    with serve_in_thread(app) as url:
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/ping").json() == {"answer": "pong"}
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/ping", timeout=2)
