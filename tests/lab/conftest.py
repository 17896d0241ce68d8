"""The lab over the embedded model: one set of fixtures (model, held-out windows, trace, packed stores) and one
app per test session, so each is built once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def lab_fixtures():
    from k3serve.lab.fixtures import LabFixtures

    return LabFixtures()


@pytest.fixture(scope="session")
def lab_app(lab_fixtures):
    from k3serve.lab.api import create_lab_app

    app = create_lab_app(lab_fixtures)
    yield app
    app.state.lab_queue.close()


@pytest.fixture(scope="session")
def lab_client(lab_app):
    from fastapi.testclient import TestClient

    with TestClient(lab_app) as client:
        yield client


# parameters that keep each module's run short in tests (the page's defaults aim at ~10 s on 2 cores)
FAST_PARAMS = {
    "rollback": {"repeats": 3}, "recurrent_state": {"measure_tokens": 16}, "mxfp4": {"rows": 64},
    "cache_policies": {"tokens": 256},
    "budget_split": {"tokens": 3, "prompts": 1, "experts": "1x"},
    "prefetch": {"tokens": 3, "prompts": 1, "experts": "1x"},
    "coactivation": {"tokens": 3, "prompts": 1},
    "parallel_io": {"max_queue_depth": 4, "experts_per_batch": 16, "experts": "1x"},
    "paged_memory": {"requests": 8, "max_prompt": 128, "prompt_tokens": 64, "max_tokens": 8},
    "prefix_cache": {"system_tokens": 64, "requests": 3},
    "batching": {"max_concurrency": 2, "max_tokens": 3, "long_prompt_tokens": 64, "max_batch_tokens": 32},
    "speculative": {"tokens": 8, "excerpt_tokens": 32},
    "full_scale": {"ladder": False, "tokens": 1},
    "cluster_routing": {"requests": 4, "prefix_tokens": 32, "replicas": 2, "wave": 2},
    "cluster_scale": {"groups": 16, "max_replicas": 4, "seeds": 1},
    "tenants": {"seconds": 0.5, "flood_requests": 2, "flood_prompt_tokens": 32, "flood_max_tokens": 8},
    "peers": {"source": "recorded"},  # the live comparison is tests/peers/test_lab_peers.py (needs llama.cpp)
    "serving": {"max_concurrency": 2, "max_tokens": 4, "flood_streams": 2, "flood_prompt_tokens": 32,
                "flood_max_tokens": 8, "tenant_seconds": 0.5},
    "disk_tier": {"prefix_tokens": 256},
    "ram_controller": {"groups": 2, "prefix_tokens": 64, "rounds": 2},
}


@pytest.fixture(scope="session")
def fast_params():
    return FAST_PARAMS
