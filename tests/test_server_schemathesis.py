"""Property-based API fuzzing with schemathesis: whatever a client sends, no 5xx.

Schemathesis reads the server's own ``/openapi.json`` and generates requests for every
operation, valid ones and invalid ones (wrong types, missing fields, out-of-range values).
Every response must be below 500, and every error must be in OpenAI's shape.

* ``test_no_server_error_fake_engine``: the real app (``build_app``) over the fake engine of
  tests/fake_engine.py, called in-process through schemathesis' ASGI transport (fast).
* ``test_no_server_error_real_engine``: the same against a real ``chassis serve`` subprocess on
  the tiny random Llama, over HTTP, with fewer examples (each generation runs the model).

Examples are bounded and derandomized (a fixed seed derived from the test), so a run is
reproducible and its time bounded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from fake_engine import FakeAsyncLLM  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from server_process import ServerProcess, running_server  # noqa: E402

from chassis.serve.app import build_app  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # a hang guard; a loaded 2-core CI box took over 120 s

MODEL = "tiny"  # the served model name, of the fake engine and of the real server

_SETTINGS = {
    "derandomize": True,
    "deadline": None,
    "database": None,
    "suppress_health_check": list(HealthCheck),
}


def check_error_shape(response: Any) -> None:
    """A 4xx carries ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape)."""
    if response.status_code < 400:
        return
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def map_body(context: Any, body: Any) -> Any:
    """Most generated bodies name a random ``model``, which only earns a 404 (tested in
    test_server_routes.py); name the served one instead, so the fuzzing reaches generation."""
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        return {**body, "model": MODEL}
    return body


def call_and_check(case: Any, **kwargs: Any) -> None:
    """Send ``case``; fail on a 5xx (schemathesis' check) or a badly shaped error."""
    response = case.call(**kwargs)
    case.validate_response(response, checks=[not_a_server_error])
    check_error_shape(response)


# -- in-process, over the fake engine ---------------------------------------------------------

# The schema is read from one app; each test (one per operation) calls a fresh app, because
# schemathesis ends an app's lifespan after each test and a chassis app stays "shutting down"
# (503) once its lifespan has ended, as a server process does.
fake_schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(FakeAsyncLLM()))
fake_schema.hook(map_body)


@pytest.fixture
def fake_app() -> Any:
    return build_app(FakeAsyncLLM(model_name=MODEL))


@fake_schema.parametrize()
@settings(max_examples=100, **_SETTINGS)
def test_no_server_error_fake_engine(case: Any, fake_app: Any) -> None:
    call_and_check(case, app=fake_app)


# -- over HTTP, against a real chassis serve --------------------------------------------------


@pytest.fixture(scope="module")
def real_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with running_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("serve-fuzz"),
        max_model_len=128,
        num_kv_blocks=256,
    ) as server:
        yield server


# The schema is the real server's (same app code as above); it is loaded lazily, once the
# module's server is up.
real_schema = schemathesis.pytest.from_fixture("real_schema_fixture")


@pytest.fixture(scope="module")
def real_schema_fixture(real_server: ServerProcess) -> Any:
    schema = schemathesis.openapi.from_url(
        real_server.base + "/openapi.json", headers=real_server.headers
    )
    schema.hook(map_body)
    return schema


@pytest.mark.slow
@real_schema.parametrize()
@settings(max_examples=25, **_SETTINGS)
def test_no_server_error_real_engine(case: Any, real_server: ServerProcess) -> None:
    call_and_check(case, headers=real_server.headers)
