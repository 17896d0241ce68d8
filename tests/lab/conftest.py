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
