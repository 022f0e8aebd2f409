"""API key, CORS and request-size bounds of the API server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient

from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def make_client(**settings) -> TestClient:
    return TestClient(build_app(FakeAsyncLLM(), ServerSettings(**settings)))


@pytest.fixture
def keyed() -> Iterator[TestClient]:
    with make_client(api_key=KEY) as client:
        yield client


def assert_401(response) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [70]}),
        ("GET", "/version", None),
        ("GET", "/metrics", None),
        ("GET", "/v1/unknown", None),
    ],
)
def test_every_route_but_health_needs_the_key(
    keyed: TestClient, method: str, path: str, body
) -> None:
    assert_401(keyed.request(method, path, json=body))
    assert_401(keyed.request(method, path, json=body, headers={"Authorization": "Bearer nope"}))
    assert_401(keyed.request(method, path, json=body, headers={"Authorization": KEY}))
    assert_401(keyed.request(method, path, json=body, headers={"Authorization": f"Basic {KEY}"}))
    ok = keyed.request(method, path, json=body, headers=AUTH)
    assert ok.status_code != 401


def test_key_is_accepted_with_any_case_scheme(keyed: TestClient) -> None:
    assert keyed.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_health_is_open(keyed: TestClient) -> None:
    assert keyed.get("/health").status_code == 200


def test_metrics_can_be_opened() -> None:
    with make_client(api_key=KEY, metrics_require_auth=False) as client:
        assert client.get("/metrics").status_code == 200
        assert_401(client.get("/v1/models"))


def test_no_key_means_no_auth() -> None:
    with make_client() as client:
        assert client.get("/v1/models").status_code == 200


def test_cors_off_by_default() -> None:
    with make_client() as client:
        response = client.get("/v1/models", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in response.headers
        preflight = client.options(
            "/v1/models",
            headers={"Origin": "http://a.example", "Access-Control-Request-Method": "GET"},
        )
        assert "access-control-allow-origin" not in preflight.headers


def test_cors_allowed_origins_and_preflight_without_key() -> None:
    with make_client(api_key=KEY, allowed_origins=["http://a.example"]) as client:
        preflight = client.options(
            "/v1/chat/completions",
            headers={
                "Origin": "http://a.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://a.example"
        response = client.get("/v1/models", headers={"Origin": "http://a.example", **AUTH})
        assert response.headers["access-control-allow-origin"] == "http://a.example"
        # errors carry CORS headers too, so browsers can read them
        response = client.get("/v1/models", headers={"Origin": "http://a.example"})
        assert response.status_code == 401
        assert response.headers["access-control-allow-origin"] == "http://a.example"
        other = client.get("/v1/models", headers={"Origin": "http://b.example", **AUTH})
        assert "access-control-allow-origin" not in other.headers


def test_body_over_the_limit_is_413() -> None:
    with make_client(max_request_body_bytes=2048) as client:
        small = client.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1})
        assert small.status_code == 200
        big = client.post("/v1/completions", json={"prompt": "x" * 5000})
        assert big.status_code == 413
        assert big.json()["error"]["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_413() -> None:
    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'"}'

    with make_client(max_request_body_bytes=2048) as client:
        response = client.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert response.status_code == 413
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_invalid_content_length_is_400() -> None:
    with make_client() as client:
        response = client.post(
            "/v1/completions",
            content=b"{}",
            headers={"content-type": "application/json", "content-length": "abc"},
        )
        assert response.status_code == 400


def test_headers_over_the_limit_are_431() -> None:
    with make_client(max_header_bytes=4096) as client:
        assert client.get("/health", headers={"X-Pad": "a" * 1000}).status_code == 200
        response = client.get("/health", headers={"X-Pad": "a" * 5000})
        assert response.status_code == 431
        assert response.json()["error"]["code"] == "request_headers_too_large"
