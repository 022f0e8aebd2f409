"""A request's own chat template (``chat_template``, or ``chat_template`` inside
``chat_template_kwargs``): refused with a 400 naming the field unless the server runs with
``--trust-request-chat-template``, and then rendered instead of the server's template.

Chat, ``/tokenize`` and Responses run over the test double of the engine (a real tokenizer
and renderer; the double records the prompt ids it was sent); ``/v1/embeddings`` and
``/pooling`` over a real ``chassis serve --runner pooling --trust-request-chat-template`` on
the tiny random Llama, whose vectors are compared with those of the rendered text sent as
``input``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from server_process import ServerProcess, running_server

from chassis.serve.app import build_app
from chassis.serve.renderer import request_chat_template
from chassis.serve.settings import ServerSettings

MESSAGES = [
    {"role": "system", "content": "You embed text."},
    {"role": "user", "content": "The cat sat on the mat."},
]
#: a template unlike the model's: only the last message's content, shouted
OWN_TEMPLATE = "{{ messages[-1]['content'] | upper }} END"
OWN_TEXT = "THE CAT SAT ON THE MAT. END"


def _app_client(trust: bool) -> tuple[FakeAsyncLLM, TestClient]:
    engine = FakeAsyncLLM()
    settings = ServerSettings(trust_request_chat_template=trust)
    return engine, TestClient(build_app(engine, settings))


def _refusal(response: httpx.Response, field: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field
    assert "--trust-request-chat-template" in error["message"]


def test_the_policy_alone() -> None:
    assert request_chat_template(None, None, trusted=False) is None
    assert request_chat_template(None, {"enable_thinking": True}, trusted=False) is None
    assert request_chat_template("A", {"chat_template": "B"}, trusted=True) == "A"
    assert request_chat_template(None, {"chat_template": "B"}, trusted=True) == "B"
    with pytest.raises(Exception, match="must be the template's text"):
        request_chat_template(None, {"chat_template": 3}, trusted=True)
    for empty in ("", "  \n"):  # it would render an empty prompt
        with pytest.raises(Exception, match="chat_template is empty"):
            request_chat_template(empty, None, trusted=True)


def test_chat_refuses_a_request_template_without_the_flag() -> None:
    engine, client = _app_client(trust=False)
    with client:
        body = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 2}
        _refusal(
            client.post("/v1/chat/completions", json={**body, "chat_template": OWN_TEMPLATE}),
            "chat_template",
        )
        hidden = {**body, "chat_template_kwargs": {"chat_template": OWN_TEMPLATE}}
        _refusal(
            client.post("/v1/chat/completions", json=hidden),
            "chat_template_kwargs.chat_template",
        )
        tokenize = {"messages": MESSAGES, "chat_template": OWN_TEMPLATE}
        _refusal(client.post("/tokenize", json=tokenize), "chat_template")
        responses = {
            "model": "fake-model",
            "input": "hi",
            "max_output_tokens": 2,
            "chat_template_kwargs": {"chat_template": OWN_TEMPLATE},
        }
        _refusal(client.post("/v1/responses", json=responses), "chat_template_kwargs.chat_template")
        # other template kwargs are still fine
        fine = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"x": 1}})
        assert fine.status_code == 200, fine.text
    assert len(engine.requests) == 1  # none of the refused ones reached the engine


def test_chat_renders_a_request_template_with_the_flag() -> None:
    engine, client = _app_client(trust=True)
    tokenizer = engine.tokenizer
    own_ids = list(tokenizer(OWN_TEXT, add_special_tokens=False).input_ids)
    server_text = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    server_ids = list(tokenizer(server_text, add_special_tokens=False).input_ids)
    assert own_ids != server_ids
    with client:
        body = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 2}
        plain = client.post("/v1/chat/completions", json=body).json()
        assert engine.requests[-1][1] == server_ids
        assert plain["usage"]["prompt_tokens"] == len(server_ids)
        for extra in (
            {"chat_template": OWN_TEMPLATE},
            {"chat_template_kwargs": {"chat_template": OWN_TEMPLATE}},
            # the request field wins over the one in chat_template_kwargs
            {"chat_template": OWN_TEMPLATE, "chat_template_kwargs": {"chat_template": "x"}},
        ):
            response = client.post("/v1/chat/completions", json={**body, **extra})
            assert response.status_code == 200, response.text
            assert engine.requests[-1][1] == own_ids, extra
            assert response.json()["usage"]["prompt_tokens"] == len(own_ids)
        tokens = client.post(
            "/tokenize", json={"messages": MESSAGES, "chat_template": OWN_TEMPLATE}
        )
        assert tokens.json()["tokens"] == own_ids
        # a template the request sends is the template's text, never a file it names
        path = client.post(
            "/tokenize", json={"messages": MESSAGES, "chat_template": "/etc/hostname"}
        )
        assert path.json()["tokens"] == list(
            tokenizer("/etc/hostname", add_special_tokens=False).input_ids
        )
        # a template that does not parse, or an empty one, is the field's fault
        for field, extra in (
            ("chat_template", {"chat_template": "{% for %}"}),
            (
                "chat_template_kwargs.chat_template",
                {"chat_template_kwargs": {"chat_template": "{% for %}"}},
            ),
            ("chat_template", {"chat_template": ""}),
            (
                "chat_template_kwargs.chat_template",
                {"chat_template_kwargs": {"chat_template": " "}},
            ),
        ):
            for route, request in (
                ("/v1/chat/completions", body),
                ("/v1/responses", {"model": "fake-model", "input": "Hi"}),
                ("/tokenize", {"messages": MESSAGES}),
            ):
                if route == "/v1/responses" and "chat_template" in extra:
                    continue  # (not a field of /v1/responses: see the next test)
                broken = client.post(route, json={**request, **extra})
                assert broken.status_code == 400, (route, extra, broken.text)
                assert broken.json()["error"]["param"] == field, (route, extra)
        # a template that parses but refuses the messages is still the messages' fault
        refusing = "{{ raise_exception('no') }}"
        refused = client.post("/v1/chat/completions", json={**body, "chat_template": refusing})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("trust", [False, True])
def test_responses_refuse_a_top_level_chat_template(trust: bool) -> None:
    # vLLM's Responses request has no chat_template field (only chat_template_kwargs): a 400
    # naming it, never a template silently ignored
    engine, client = _app_client(trust=trust)
    with client:
        body = {"model": "fake-model", "input": "Hi", "chat_template": OWN_TEMPLATE}
        response = client.post("/v1/responses", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "chat_template"
        assert "chat_template_kwargs.chat_template" in error["message"]
        assert engine.requests == []
        if trust:  # the supported way renders it
            body = {"model": "fake-model", "input": "Hi"}
            own = {"chat_template_kwargs": {"chat_template": OWN_TEMPLATE}}
            ok = client.post("/v1/responses", json={**body, **own})
            assert ok.status_code == 200, ok.text
            expected = engine.tokenizer("HI END", add_special_tokens=False).input_ids
            assert engine.requests[-1][1] == list(expected)


@pytest.fixture(scope="module")
def trusting_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    extra = ["--runner", "pooling", "--trust-request-chat-template"]
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("serve"), extra_args=extra) as s:
        yield s


@pytest.mark.parametrize(
    ("template", "raised"),
    [
        ("{{ raise_exception('only user messages') }}", "TemplateError: only user messages"),
        ("{{ 1 / (messages | length - 1) }}", "ZeroDivisionError: division by zero"),
        ("{{ range(10 ** 9) | list }}", "OverflowError: Range too big"),
        ("{{ messages[0]['content'].missing() }}", "UndefinedError"),
    ],
)
def test_a_template_that_fails_on_the_messages_is_a_400_saying_whose(
    template: str, raised: str
) -> None:
    # valid Jinja (the server's is checked at start-up) that raises while rendering these
    # messages: a 400 naming messages, whose message says which template raised what
    one = [{"role": "user", "content": "Hi"}]
    engine = FakeAsyncLLM(config_chat_template=template)
    with TestClient(build_app(engine, ServerSettings(trust_request_chat_template=True))) as http:
        for path, body in (
            ("/v1/chat/completions", {"messages": one}),
            ("/v1/responses", {"input": "Hi"}),
        ):
            response = http.post(path, json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "messages", error
            assert error["message"].startswith("the server's chat template (--chat-template): ")
            assert raised in error["message"], error
        # the same template sent by the request names the request's field
        own = {"messages": one, "chat_template": template}
        error = http.post("/v1/chat/completions", json=own).json()["error"]
        assert error["param"] == "messages", error
        assert error["message"].startswith("the request's template (chat_template): "), error
    assert engine.requests == []


def _post(server: ServerProcess, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.base + route, json=body, headers=server.headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_embeddings_use_a_request_template_with_the_flag(
    trusting_server: ServerProcess, tiny_llama_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    own_ids = tokenizer(OWN_TEXT, add_special_tokens=False).input_ids
    server_text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    server_ids = tokenizer(server_text, add_special_tokens=False).input_ids
    assert len(own_ids) != len(server_ids)

    as_input = _post(
        trusting_server,
        "/v1/embeddings",
        {"input": OWN_TEXT, "add_special_tokens": False},
    )
    plain = _post(trusting_server, "/v1/embeddings", {"messages": MESSAGES})
    assert plain["usage"]["prompt_tokens"] == len(server_ids)
    for extra in (
        {"chat_template": OWN_TEMPLATE},
        {"chat_template_kwargs": {"chat_template": OWN_TEMPLATE}},
    ):
        own = _post(trusting_server, "/v1/embeddings", {"messages": MESSAGES, **extra})
        assert own["usage"]["prompt_tokens"] == len(own_ids)
        assert own["data"][0]["embedding"] == as_input["data"][0]["embedding"]
        assert own["data"][0]["embedding"] != plain["data"][0]["embedding"]
    pooled = _post(
        trusting_server, "/pooling", {"messages": MESSAGES, "chat_template": OWN_TEMPLATE}
    )
    assert pooled["data"][0]["data"] == as_input["data"][0]["embedding"]
    trusting_server.wait_idle()
