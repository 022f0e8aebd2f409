"""Plugin HTTP routes (``chassis_register_routes``): included, guarded, and checked at start-up.

Plugins are registered with fake entry points (nothing installed); the app serves the test
double of the engine (tests/fake_engine.py), so each test runs in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi import APIRouter, HTTPException, Request
from fastapi.testclient import TestClient
from fixtures_plugins import FakeEntryPoint, fake_manager, isolated_plugins  # noqa: F401

from chassis.plugins import PluginLoadError, get_registries, hookimpl, set_plugin_manager
from chassis.serve.app import build_app
from chassis.serve.plugin_routes import get_engine, get_server_state
from chassis.serve.settings import ServerSettings

API_KEY = "secret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _router_plugin(routes: dict[str, Any]) -> object:
    """A plugin object whose ``chassis_register_routes`` registers ``routes``."""

    class Plugin:
        @hookimpl
        def chassis_register_routes(self, registry: Any) -> None:
            for name, router in routes.items():
                registry.register(name, router)

    return Plugin()


def _use_plugins(**plugins: object) -> None:
    eps = [FakeEntryPoint(name, f"{name}_module", obj=obj) for name, obj in plugins.items()]
    set_plugin_manager(fake_manager(general=eps))


def _demo_router() -> APIRouter:
    router = APIRouter(prefix="/demo")

    @router.get("/engine")
    async def engine_info(request: Request) -> dict[str, Any]:
        engine = get_engine(request)
        return {
            "model": engine.model_name,
            "same_state": get_server_state(request).engine is engine,
        }

    @router.post("/echo/{word}")
    async def echo(word: str, request: Request) -> dict[str, str]:
        return {"word": word, "body": (await request.body()).decode()}

    @router.get("/fail")
    async def fail() -> None:
        raise HTTPException(status_code=418, detail="the plugin is a teapot")

    @router.get("/crash")
    async def crash() -> None:
        raise RuntimeError("plugin bug")

    return router


@pytest.fixture
def client(isolated_plugins: None) -> Iterator[TestClient]:  # noqa: F811
    _use_plugins(demo=_router_plugin({"demo": _demo_router()}))
    app = build_app(FakeAsyncLLM(), ServerSettings(api_key=API_KEY))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_plugin_route_is_served_and_reaches_the_engine(client: TestClient) -> None:
    response = client.get("/demo/engine", headers=AUTH)
    assert response.status_code == 200
    assert response.json() == {"model": "fake-model", "same_state": True}
    echoed = client.post("/demo/echo/hi", headers=AUTH, content=b"body!")
    assert echoed.json() == {"word": "hi", "body": "body!"}
    # the built-in routes are still there
    assert client.get("/v1/models", headers=AUTH).status_code == 200


def test_plugin_route_needs_the_api_key(client: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = client.get("/demo/engine", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert client.get("/health").status_code == 200  # still open, as before


def test_plugin_route_errors_have_openai_shape(client: TestClient) -> None:
    teapot = client.get("/demo/fail", headers=AUTH)
    assert teapot.status_code == 418
    assert teapot.json()["error"]["message"] == "the plugin is a teapot"
    crash = client.get("/demo/crash", headers=AUTH)
    assert crash.status_code == 500
    assert set(crash.json()["error"]) >= {"message", "type", "code"}


def test_unknown_path_is_404(client: TestClient) -> None:
    response = client.get("/demo/nope", headers=AUTH)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
    # without the key, an unknown path is refused before routing: nothing leaks
    assert client.get("/demo/nope").status_code == 401


def test_route_on_a_builtin_path_is_a_startup_error(isolated_plugins: None) -> None:  # noqa: F811
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict[str, str]:
        return {}

    _use_plugins(hijack=_router_plugin({"hijack": router}))
    with pytest.raises(ValueError, match=r"plugin 'hijack'.*'/v1/models'.*built-in"):
        build_app(FakeAsyncLLM())


def test_path_parameters_collide_whatever_their_names(isolated_plugins: None) -> None:  # noqa: F811
    router = APIRouter()

    @router.delete("/v1/responses/{rid}")
    async def delete(rid: str) -> None:
        return None

    _use_plugins(shadow=_router_plugin({"shadow": router}))
    with pytest.raises(ValueError, match=r"plugin 'shadow'.*'/v1/responses/\{rid\}'"):
        build_app(FakeAsyncLLM())


def test_two_plugins_on_one_path_is_a_startup_error(isolated_plugins: None) -> None:  # noqa: F811
    def router() -> APIRouter:
        r = APIRouter()

        @r.get("/shared/status")
        async def status() -> dict[str, str]:
            return {}

        return r

    _use_plugins(
        first=_router_plugin({"first": router()}), second=_router_plugin({"second": router()})
    )
    with pytest.raises(ValueError, match=r"plugin 'second'.*which plugin 'first'.*already serves"):
        build_app(FakeAsyncLLM())


def test_a_router_name_taken_twice_names_both_plugins(isolated_plugins: None) -> None:  # noqa: F811
    _use_plugins(
        one=_router_plugin({"status": APIRouter()}), two=_router_plugin({"status": APIRouter()})
    )
    with pytest.raises(PluginLoadError, match="registered twice: by 'one' and by 'two'"):
        get_registries()


def test_what_is_not_a_router_is_refused(isolated_plugins: None) -> None:  # noqa: F811
    _use_plugins(odd=_router_plugin({"odd": object()}))
    with pytest.raises(ValueError, match=r"plugin 'odd'.*not a fastapi.APIRouter"):
        build_app(FakeAsyncLLM())


def test_lazy_router_string_is_imported(isolated_plugins: None) -> None:  # noqa: F811
    _use_plugins(lazy=_router_plugin({"lazy": f"{__name__}:LAZY_ROUTER"}))
    app = build_app(FakeAsyncLLM())
    with TestClient(app) as c:
        assert c.get("/lazy/ping").json() == {"pong": True}


LAZY_ROUTER = APIRouter(prefix="/lazy")


@LAZY_ROUTER.get("/ping")
async def _ping() -> dict[str, bool]:
    return {"pong": True}
