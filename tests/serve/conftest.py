"""Serving fixtures: `run_server(app)` runs an app under uvicorn on a free loopback port."""

from __future__ import annotations

import pytest

from k3serve.serve.threaded import serve_in_thread


@pytest.fixture(scope="session")
def run_server():
    """`with run_server(app) as url:` serves `app` on 127.0.0.1 until the block ends."""
    return serve_in_thread
