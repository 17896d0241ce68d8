"""Helpers for the engine tests: run an engine until its requests finish, checking integrity after every step."""

from __future__ import annotations

import pytest

from k3serve.engine.engine import LLMEngine
from k3serve.engine.request import RequestOutput


def run_to_completion(engine: LLMEngine, check: bool = True) -> dict[str, RequestOutput]:
    """Step until nothing is left; returns each request's final output (exactly one per request)."""
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final, "a request finished twice"
                final[out.request_id] = out
        if check:
            engine.check_integrity()
    return final


@pytest.fixture
def drive():
    return run_to_completion
