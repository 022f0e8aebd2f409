"""The API server over the test double of the ``AsyncLLM`` contract (tests/fake_engine.py).

``engine``: a fresh :class:`FakeAsyncLLM` per test; ``client``: a ``TestClient`` of the app
serving it with the default ``ServerSettings`` (its lifespan runs inside the test). A test
module takes them with ``from fixtures_server import *  # noqa: F403``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient

from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings

__all__ = ["client", "engine"]


@pytest.fixture
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM()


@pytest.fixture
def client(engine: FakeAsyncLLM) -> Iterator[TestClient]:
    with TestClient(build_app(engine, ServerSettings())) as c:
        yield c
