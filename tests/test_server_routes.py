"""The API routes against a test double of the AsyncLLM contract (tests/fake_engine.py).

The fake's completion ``i`` generates "abcdef..." starting at letter ``i``, one token per
letter; its tokenizer is a real byte-level fast tokenizer (one token per byte).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from fixtures_server import *  # noqa: F403

from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings

CHAT = [{"role": "user", "content": "hi"}]


def sse_events(text: str) -> list[Any]:
    """The JSON payloads of an SSE body; asserts the framing and the final [DONE]."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def assert_error(response: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


# -- models, version, tokenize ----------------------------------------------------------------


def test_models_lists_the_served_name(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["fake-model"]
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == 256


def test_models_retrieve_one_card_or_a_404() -> None:
    engine = FakeAsyncLLM(model_name="org/fake-model")  # a hub-style name: a '/' in the path
    with TestClient(build_app(engine, ServerSettings())) as client:
        card = client.get("/v1/models/org/fake-model")
        assert card.status_code == 200, card.text
        assert card.json() == client.get("/v1/models").json()["data"][0]
        missing = client.get("/v1/models/gpt-4")
        assert missing.status_code == 404
        error = missing.json()["error"]
        assert error["code"] == "model_not_found" and "'org/fake-model'" in error["message"]


def test_version(client: TestClient) -> None:
    import chassis

    assert client.get("/version").json() == {"version": chassis.__version__}


def test_tokenize_prompt_and_messages_and_detokenize(
    client: TestClient, engine: FakeAsyncLLM
) -> None:
    tok = engine.tokenizer
    body = client.post("/tokenize", json={"prompt": "héllo"}).json()
    assert body["tokens"] == tok("héllo").input_ids  # with BOS by default
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    body = client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()
    assert body["tokens"] == tok("hi", add_special_tokens=False).input_ids
    body = client.post("/tokenize", json={"messages": CHAT, "return_token_strs": True}).json()
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == tok(rendered, add_special_tokens=False).input_ids
    assert body["tokens"][0] == tok.bos_token_id  # exactly one BOS, from the template
    assert len(body["token_strs"]) == body["count"]
    text = client.post("/detokenize", json={"tokens": tok("héllo").input_ids[1:]}).json()
    assert text == {"prompt": "héllo"}


def test_tokenize_and_detokenize_errors(client: TestClient) -> None:
    assert_error(client.post("/tokenize", json={}), 400, "prompt")
    assert_error(client.post("/tokenize", json={"prompt": "a", "messages": CHAT}), 400)
    assert_error(client.post("/tokenize", json={"prompt": "a", "model": "other"}), 404, "model")
    assert_error(client.post("/detokenize", json={"tokens": [1, 99999]}), 400, "tokens")
    assert_error(client.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


# -- completions ------------------------------------------------------------------------------


def test_completion_non_streaming(client: TestClient, engine: FakeAsyncLLM) -> None:
    response = client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": "hello", "max_tokens": 5}
    )
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["text"] == "abcde" and choice["finish_reason"] == "length"
    assert choice["index"] == 0 and choice["logprobs"] is None
    prompt_len = len(engine.tokenizer("hello").input_ids)
    assert body["usage"]["prompt_tokens"] == prompt_len
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == prompt_len + 5
    # the server tokenized the prompt (with BOS) and sent token ids to the engine
    _, prompt_ids, params, _ = engine.requests[-1]
    assert prompt_ids == engine.tokenizer("hello").input_ids and params.max_tokens == 5


def test_completion_model_may_be_omitted_and_unknown_model_is_404(client: TestClient) -> None:
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    error = assert_error(
        client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "model"
    )
    assert error["code"] == "model_not_found" and "gpt-4" in error["message"]


def test_completion_batch_n_and_indices(client: TestClient, engine: FakeAsyncLLM) -> None:
    body = client.post(
        "/v1/completions", json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 3}
    ).json()
    texts = {c["index"]: c["text"] for c in body["choices"]}
    # index = prompt_index * n + completion_index
    assert texts == {0: "abc", 1: "bcd", 2: "abc", 3: "bcd"}
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens"] == 2 * 3  # BOS + 2 bytes, per prompt
    assert {r[3] for r in engine.requests} == {0}
    assert len({r[0] for r in engine.requests}) == 2  # one engine request per prompt


def test_completion_token_id_prompts(client: TestClient, engine: FakeAsyncLLM) -> None:
    body = client.post("/v1/completions", json={"prompt": [70, 71, 72], "max_tokens": 2}).json()
    assert body["choices"][0]["text"] == "ab"
    assert engine.requests[-1][1] == [70, 71, 72]
    body = client.post("/v1/completions", json={"prompt": [[70], [71, 72]], "max_tokens": 1}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 3


def test_completion_stop_strings(client: TestClient) -> None:
    body = client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 10, "stop": ["d", "zz"]}
    ).json()
    assert body["choices"][0]["text"] == "abc"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == "d"
    body = client.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 10, "stop": "c", "include_stop_str_in_output": True},
    ).json()
    assert body["choices"][0]["text"] == "abc"


def test_completion_logprobs(client: TestClient) -> None:
    body = client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 3, "logprobs": 2}
    ).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert logprobs["text_offset"] == [0, 1, 2]
    # sampled token plus 2 alternatives, which the server decoded itself
    assert logprobs["top_logprobs"][0] == {"a": -0.5, "A": -2.0, "B": -3.0}


def test_prompt_logprobs(client: TestClient) -> None:
    body = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "prompt_logprobs": 0}
    ).json()
    prompt_logprobs = body["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None  # BOS: nothing before it
    assert [list(p.values()) for p in prompt_logprobs[1:]] == [
        [{"logprob": -1.0, "rank": 1, "decoded_token": c}] for c in "hi"
    ]
    chat = client.post(
        "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0}
    ).json()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    plain = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_completion_streaming(client: TestClient) -> None:
    response = client.post(
        "/v1/completions",
        json={
            "prompt": "x",
            "max_tokens": 3,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    ids = {e["id"] for e in events}
    assert len(ids) == 1 and next(iter(ids)).startswith("cmpl-")
    text: dict[int, str] = {0: "", 1: ""}
    finish = {}
    for event in events[:-1]:
        assert event["object"] == "text_completion" and event["usage"] is None
        for choice in event["choices"]:
            text[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    assert text == {0: "abc", 1: "bcd"} and finish == {0: "length", 1: "length"}
    usage_event = events[-1]
    assert usage_event["choices"] == []
    assert usage_event["usage"]["completion_tokens"] == 6


def test_completion_streaming_without_usage_has_no_usage_chunk(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
    events = sse_events(response.text)
    assert all(e["choices"] for e in events)
    assert all(e["usage"] is None for e in events)


def test_completion_batch_streaming(client: TestClient) -> None:
    response = client.post(
        "/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2, "stream": True}
    )
    events = sse_events(response.text)
    text: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
    assert text == {0: "ab", 1: "ab", 2: "ab"}


@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats(client: TestClient, include_usage: bool) -> None:
    response = client.post(
        "/v1/completions",
        json={
            "prompt": "x",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": include_usage, "continuous_usage_stats": True},
        },
    )
    events = sse_events(response.text)
    if include_usage:
        assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 3, 3]
    else:  # as in vLLM, per-chunk usage only comes with include_usage
        assert all(e["usage"] is None for e in events)


def test_chat_continuous_usage_counts_the_prompt_from_the_first_chunk(client: TestClient) -> None:
    response = client.post(
        "/v1/chat/completions",
        json={
            "messages": CHAT,
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    events = sse_events(response.text)
    prompt_tokens = {e["usage"]["prompt_tokens"] for e in events}
    assert len(prompt_tokens) == 1 and prompt_tokens.pop() > 0
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["usage"]["completion_tokens"] == 0


def test_too_many_choices_in_one_request_are_400(client: TestClient, engine: FakeAsyncLLM) -> None:
    error = assert_error(
        client.post("/v1/completions", json={"prompt": [[5]] * 3000, "n": 2, "max_tokens": 1}),
        400,
        "prompt",
    )
    assert "6000 choices" in error["message"]
    assert_error(
        client.post("/v1/chat/completions", json={"messages": CHAT, "n": 10**12}), 400, "n"
    )
    assert_error(
        client.post("/v1/completions", json={"prompt": "x", "priority": 10**23}), 400, "priority"
    )


# -- chat -------------------------------------------------------------------------------------


def test_chat_non_streaming(client: TestClient, engine: FakeAsyncLLM) -> None:
    response = client.post(
        "/v1/chat/completions",
        json={"model": "fake-model", "messages": CHAT, "max_completion_tokens": 4, "seed": 1},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "abcd", "tool_calls": []}
    assert choice["finish_reason"] == "length"
    rendered = engine.tokenizer.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )
    prompt_ids = engine.tokenizer(rendered, add_special_tokens=False).input_ids
    assert engine.requests[-1][1] == prompt_ids
    assert engine.requests[-1][2].seed == 1
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 4,
        "total_tokens": len(prompt_ids) + 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_chat_default_max_tokens_is_the_rest_of_the_context() -> None:
    engine = FakeAsyncLLM(max_model_len=40)
    with TestClient(build_app(engine)) as client:
        body = client.post("/v1/chat/completions", json={"messages": CHAT}).json()
    prompt_len = body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 40 - prompt_len
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_content_parts_and_n(client: TestClient, engine: FakeAsyncLLM) -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    body = client.post(
        "/v1/chat/completions", json={"messages": messages, "n": 2, "max_tokens": 2}
    ).json()
    assert [c["message"]["content"] for c in body["choices"]] == ["ab", "bc"]
    prompt = engine.tokenizer.decode(engine.requests[-1][1])
    assert "be brief" in prompt and "a\nb" in prompt


def test_chat_rejects_non_text_parts_and_template_errors(client: TestClient) -> None:
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(client.post("/v1/chat/completions", json={"messages": image}), 400)
    bad_role = [{"role": "forbidden", "content": "x"}]
    error = assert_error(client.post("/v1/chat/completions", json={"messages": bad_role}), 400)
    assert "forbidden" in error["message"]
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")


def test_chat_without_template_is_400() -> None:
    engine = FakeAsyncLLM(chat_template=None)
    with TestClient(build_app(engine)) as client:
        error = assert_error(client.post("/v1/chat/completions", json={"messages": CHAT}), 400)
    assert "chat template" in error["message"]


def test_chat_template_flag_overrides_the_tokenizer_template(tmp_path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    engine = FakeAsyncLLM(config_chat_template=str(template))
    with TestClient(build_app(engine)) as client:
        body = client.post("/tokenize", json={"messages": CHAT}).json()
    assert engine.tokenizer.decode(body["tokens"]) == "[hi]"


def test_bad_chat_template_path_fails_at_build() -> None:
    with pytest.raises(ValueError, match="chat-template"):
        build_app(FakeAsyncLLM(config_chat_template="/no/such/template.jinja"))


def test_chat_streaming(client: TestClient) -> None:
    response = client.post(
        "/v1/chat/completions",
        json={
            "messages": CHAT,
            "max_tokens": 3,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.status_code == 200
    events = sse_events(response.text)
    # one role chunk per choice, each chunk one choice (OpenAI's and vLLM's shape)
    roles = events[:2]
    assert all(e["object"] == "chat.completion.chunk" for e in roles)
    assert [[c["index"] for c in e["choices"]] for e in roles] == [[0], [1]]
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in roles)
    content: dict[int, str] = {0: "", 1: ""}
    finish = {}
    for event in events[2:-1]:
        assert len(event["choices"]) == 1
        for choice in event["choices"]:
            assert "role" not in choice["delta"]
            content[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    assert content == {0: "abc", 1: "bcd"} and finish == {0: "length", 1: "length"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    assert events[-1]["usage"]["total_tokens"] == events[-1]["usage"]["prompt_tokens"] + 6


def test_chat_logprobs(client: TestClient) -> None:
    body = client.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 2},
    ).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == ["a", "b"]
    assert content[0]["logprob"] == -0.5 and content[0]["bytes"] == [97]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["a", "A"]
    body = client.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 2, "logprobs": True, "stream": True},
    )
    events = sse_events(body.text)
    tokens = [
        t["token"]
        for e in events
        for c in e["choices"]
        if c["logprobs"]
        for t in c["logprobs"]["content"]
    ]
    assert tokens == ["a", "b"]


# -- errors -----------------------------------------------------------------------------------


def test_validation_errors_are_400_not_422(client: TestClient) -> None:
    error = assert_error(
        client.post("/v1/completions", json={"prompt": "x", "temperature": "hot"}),
        400,
        "temperature",
    )
    assert error["type"] == "invalid_request_error"
    assert_error(client.post("/v1/completions", json={}), 400, "prompt")
    assert_error(client.post("/v1/chat/completions", json={"messages": "hi"}), 400, "messages")
    assert_error(client.post("/v1/completions", json=[1, 2]), 400)


def test_json_body_without_content_type_is_read(client: TestClient) -> None:
    # what requests.post(url, data=json.dumps(body)) sends: no Content-Type
    response = client.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}')
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    # a form content type (curl -d) is not JSON: the error says what to send
    error = assert_error(
        client.post(
            "/v1/completions",
            content=b'{"prompt": "x"}',
            headers={"content-type": "application/x-www-form-urlencoded"},
        ),
        400,
    )
    assert "Content-Type: application/json" in error["message"]


def test_malformed_json_is_400(client: TestClient) -> None:
    error = assert_error(
        client.post(
            "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}
        ),
        400,
    )
    assert "JSON" in error["message"]


def test_engine_value_errors_are_400(client: TestClient) -> None:
    # context length: the engine rejects before generating anything
    error = assert_error(client.post("/v1/completions", json={"prompt": "x" * 300}), 400)
    assert "context length" in error["message"]
    assert_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 300}), 400)
    assert_error(
        client.post("/v1/completions", json={"prompt": "x", "logprobs": 21}), 400, "logprobs"
    )
    # and for streams, before any event is sent
    response = client.post("/v1/completions", json={"prompt": "x" * 300, "stream": True})
    assert_error(response, 400)
    response = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x" * 300}], "stream": True},
    )
    assert_error(response, 400)


def test_batch_with_one_bad_prompt_fails_whole_and_aborts_the_others(
    client: TestClient, engine: FakeAsyncLLM
) -> None:
    assert_error(
        client.post("/v1/completions", json={"prompt": ["ok", "x" * 300], "max_tokens": 50}),
        400,
    )
    assert not engine.running


def test_unknown_route_and_method(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_health(client: TestClient, engine: FakeAsyncLLM) -> None:
    assert client.get("/health").status_code == 200
    engine.kill()
    error = assert_error(client.get("/health"), 503)
    assert error["code"] == "engine_dead"


def test_metrics(client: TestClient) -> None:
    client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3})
    client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 10, "stop": "b"})
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    label = 'engine="0",model_name="fake-model"'
    expected = [
        f"chassis:num_requests_running{{{label}}} 0.0",
        f"chassis:num_requests_waiting{{{label}}} 0.0",
        f"chassis:kv_cache_usage_perc{{{label}}} 0.25",
        f"chassis:prefix_cache_queries_total{{{label}}} 10.0",
        f"chassis:prefix_cache_hits_total{{{label}}} 4.0",
        f"chassis:num_preemptions_total{{{label}}} 1.0",
        f"chassis:prompt_tokens_total{{{label}}} 6.0",
        f"chassis:generation_tokens_total{{{label}}} 5.0",
        f'chassis:request_success_total{{engine="0",finished_reason="length",{label[11:]}}} 1.0',
        f'chassis:request_success_total{{engine="0",finished_reason="stop",{label[11:]}}} 1.0',
        f"chassis:time_to_first_token_seconds_count{{{label}}} 2.0",
        f"chassis:e2e_request_latency_seconds_count{{{label}}} 2.0",
        f"chassis:inter_token_latency_seconds_count{{{label}}} 3.0",
        f"chassis:request_queue_time_seconds_count{{{label}}} 2.0",
    ]
    for line in expected:
        assert line in text, line
    assert "_created" not in text
    # a request refused with a 400 never ran: it is not an aborted completion
    refused = client.post("/v1/completions", json={"prompt": "ab" * 500, "n": 4})
    assert refused.status_code == 400
    assert 'finished_reason="abort"' not in client.get("/metrics").text


def test_aborted_completions_count_as_abort_successes() -> None:
    from chassis.core.outputs import CompletionOutput, RequestOutput
    from chassis.serve.metrics import ServerMetrics

    metrics = ServerMetrics("m", stats=lambda: None)
    tracker = metrics.tracker(n=3)
    done = CompletionOutput(index=1, text="", token_ids=[4], finish_reason="stop")
    tracker.observe(
        RequestOutput(
            request_id="r", prompt=None, prompt_token_ids=[1], outputs=[done], finished=False
        )
    )
    tracker.close()  # the client went away: completions 0 and 2 never finished
    tracker.close()  # counted once
    text = metrics.render()[0].decode()
    success = 'chassis:request_success_total{engine="0",finished_reason='
    assert success + '"abort",model_name="m"} 2.0' in text
    assert success + '"stop",model_name="m"} 1.0' in text


def test_metrics_survive_a_dead_engine(client: TestClient, engine: FakeAsyncLLM) -> None:
    engine.kill()
    response = client.get("/metrics")
    assert response.status_code == 200
    assert "chassis:num_requests_running" not in response.text
    assert "chassis:prompt_tokens_total" in response.text


# -- echo ---------------------------------------------------------------------------------------


def test_completion_echo_puts_the_prompt_first(client: TestClient) -> None:
    """Text as sent; with logprobs, one entry per prompt token (the fake's tokenizer: BOS,
    then a byte each) before the completion's, offsets running on from 0."""
    body = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 0}
    ).json()
    choice = body["choices"][0]
    assert choice["text"] == "hiab"
    logprobs = choice["logprobs"]
    bos = logprobs["tokens"][0]
    assert logprobs["tokens"] == [bos, "h", "i", "a", "b"]
    assert logprobs["token_logprobs"] == [None, -1.0, -1.0, -0.5, -0.5]
    assert logprobs["top_logprobs"][:3] == [None, {"h": -1.0}, {"i": -1.0}]
    assert logprobs["text_offset"] == [0, len(bos), len(bos) + 1, len(bos) + 2, len(bos) + 3]
    assert choice["prompt_logprobs"] is None  # vLLM's field only when asked for
    assert body["usage"]["completion_tokens"] == 2
    plain = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": True})
    assert plain.json()["choices"][0]["text"] == "hiab"
    assert plain.json()["choices"][0]["logprobs"] is None


def test_completion_echo_with_max_tokens_0_is_the_prompt_alone(
    client: TestClient, engine: FakeAsyncLLM
) -> None:
    ids = engine.tokenizer("hi", add_special_tokens=False).input_ids
    for prompt in ("hi", ids):  # text, and token ids (decoded)
        body = client.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1},
        ).json()
        choice = body["choices"][0]
        assert choice["text"] == "hi"
        assert choice["finish_reason"] == "length"
        assert choice["logprobs"]["tokens"][-2:] == ["h", "i"]
        assert body["usage"]["completion_tokens"] == 0
    without_echo = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert_error(without_echo, 400, "max_tokens")


def test_completion_echo_streams_the_prompt_in_each_choices_first_chunk(
    client: TestClient,
) -> None:
    response = client.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 3, "n": 2, "echo": True, "logprobs": 0, "stream": True},
    )
    texts: dict[int, str] = {}
    offsets: dict[int, list[int]] = {}
    for event in sse_events(response.text):
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["logprobs"]:
                offsets.setdefault(choice["index"], []).extend(choice["logprobs"]["text_offset"])
    whole = client.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 3, "n": 2, "echo": True, "logprobs": 0},
    ).json()
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert texts[0].startswith("hi") and texts[1].startswith("hi")
    assert offsets == {c["index"]: c["logprobs"]["text_offset"] for c in whole["choices"]}


class _StaggeredChoices(FakeAsyncLLM):
    """Sends each prompt's first output as two, the real engine's way when the choices'
    first tokens come in different steps: choice 0 with the prompt logprobs, then the other
    choices without them."""

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        import dataclasses

        first = True
        async for output in super().generate(*args, **kwargs):
            if first and len(output.outputs) > 1:
                yield dataclasses.replace(output, outputs=output.outputs[:1], finished=False)
                output = dataclasses.replace(
                    output, outputs=output.outputs[1:], prompt_logprobs=None
                )
            first = False
            yield output


@pytest.mark.parametrize("stream", [True, False])
def test_completion_echo_logprobs_of_a_choice_that_starts_later(stream: bool) -> None:
    """Found serving SmolLM2: streamed ``echo`` with ``n: 2`` and ``logprobs`` gave the
    second choice ``null`` prompt logprobs (it showed up after the output that carries
    them); the ``prompt_logprobs`` field of a choice that started later was missing too."""
    with TestClient(build_app(_StaggeredChoices(), ServerSettings())) as client:
        response = client.post(
            "/v1/completions",
            json={
                "prompt": "hi",
                "max_tokens": 2,
                "n": 2,
                "echo": True,
                "logprobs": 0,
                "prompt_logprobs": 0,
                "stream": stream,
            },
        )
    if stream:
        first_chunks: dict[int, dict[str, Any]] = {}
        for event in sse_events(response.text):
            for choice in event["choices"]:
                first_chunks.setdefault(choice["index"], choice)
        choices = [first_chunks[0], first_chunks[1]]
    else:
        choices = response.json()["choices"]
        assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"] is not None
    for choice in choices:
        assert choice["text"].startswith("hi")
        assert choice["logprobs"]["token_logprobs"][1:3] == [-1.0, -1.0]  # "h", "i"


def test_echo_prompt_logprobs_field_holds_what_it_asked_for() -> None:
    """Found serving SmolLM2: ``echo`` with ``logprobs: 3`` and ``prompt_logprobs: 1`` gave
    the ``prompt_logprobs`` field 3 alternatives (echo has the engine compute 3); a negative
    ``prompt_logprobs`` was hidden by echo's and accepted."""
    from chassis.core.outputs import Logprob, RequestOutput
    from chassis.serve.completion_echo import with_prompt_logprobs_cut

    def lp(rank: int) -> Logprob:
        return Logprob(logprob=-float(rank), rank=rank, decoded_token=None)

    output = RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[5, 6],
        outputs=[],
        finished=True,
        prompt_logprobs=[None, {7: lp(1), 8: lp(2), 9: lp(3), 6: lp(40)}],
    )
    cut = with_prompt_logprobs_cut(output, 1)
    assert cut.prompt_logprobs == [None, {7: lp(1), 6: lp(40)}]  # the top one and its own
    assert with_prompt_logprobs_cut(output, 0).prompt_logprobs == [None, {6: lp(40)}]

    with TestClient(build_app(FakeAsyncLLM(), ServerSettings())) as client:
        body = {"prompt": "hi", "max_tokens": 1, "echo": True, "logprobs": 1}
        response = client.post("/v1/completions", json={**body, "prompt_logprobs": -1})
        assert_error(response, 400, "prompt_logprobs")
        # max_tokens 0 is answered by one engine token: the error names what was sent
        response = client.post("/v1/completions", json={**body, "max_tokens": 0, "min_tokens": 2})
        assert "max_tokens (0)" in assert_error(response, 400, "min_tokens")["message"]


# -- return_token_ids ---------------------------------------------------------------------------


def test_return_token_ids_in_completions(client: TestClient, engine: FakeAsyncLLM) -> None:
    tok = engine.tokenizer
    body = {"prompt": "hi", "max_tokens": 3, "n": 2, "return_token_ids": True}
    whole = client.post("/v1/completions", json=body).json()
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == tok("hi").input_ids
        assert tok.decode(choice["token_ids"]) == choice["text"]
    events = sse_events(client.post("/v1/completions", json={**body, "stream": True}).text)
    streamed: dict[int, list[int]] = {}
    for event in events:
        for choice in event["choices"]:
            if choice["index"] not in streamed:  # a choice's first chunk
                assert choice["prompt_token_ids"] == tok("hi").input_ids
            else:
                assert "prompt_token_ids" not in choice
            streamed.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert streamed == {c["index"]: c["token_ids"] for c in whole["choices"]}
    plain = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()
    assert "token_ids" not in plain["choices"][0]
    assert "prompt_token_ids" not in plain["choices"][0]


def test_return_token_ids_in_chat(client: TestClient, engine: FakeAsyncLLM) -> None:
    body = {"messages": CHAT, "max_tokens": 3, "return_token_ids": True}
    whole = client.post("/v1/chat/completions", json=body).json()
    prompt_ids = whole["prompt_token_ids"]
    assert len(prompt_ids) == whole["usage"]["prompt_tokens"]
    choice = whole["choices"][0]
    assert engine.tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert events[0]["prompt_token_ids"] == prompt_ids  # the role chunk
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in e for e in events[1:])
    streamed = [t for e in events[1:] for c in e["choices"] for t in c["token_ids"]]
    assert streamed == choice["token_ids"]
    plain = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
