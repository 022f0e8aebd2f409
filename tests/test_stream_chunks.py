"""The streamed chunks' fast encoder (serve/stream_chunks.py) against the pydantic schema.

Every shape of chunk the routes stream must be byte-identical to what the protocol model's
``model_dump_json()`` gives for the same values: the models are the reference.
"""

from __future__ import annotations

import json

import pytest

from chassis.serve.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatLogprobToken,
    ChatLogprobTop,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from chassis.serve.state import UsageCounter
from chassis.serve.stream_chunks import ChunkEncoder, chat_choice, completion_choice


def _as_dict(usage: UsageInfo | None) -> dict | None:
    return None if usage is None else usage.model_dump(mode="json")


USAGE = UsageInfo(
    prompt_tokens=7,
    completion_tokens=3,
    total_tokens=10,
    prompt_tokens_details={"cached_tokens": 4},
)
COMPLETION_LOGPROBS = CompletionLogprobs(
    tokens=[" Paris", "\u00e9"],
    token_logprobs=[-0.125, None],
    top_logprobs=[{" Paris": -0.125, " Lyon": -2.5e-07}, None],
    text_offset=[0, 6],
)
CHAT_LOGPROBS = ChatChoiceLogprobs(
    content=[
        ChatLogprobToken(
            token="\u4e16",
            logprob=-1.0000001,
            bytes=[228, 184, 150],
            top_logprobs=[ChatLogprobTop(token="\u4e16", logprob=-1.0000001, bytes=None)],
        )
    ]
)

COMPLETION_CASES = [
    ({"index": 0, "text": " hello"}, None),
    ({"index": 3, "text": "", "finish_reason": "abort"}, None),
    ({"index": 1, "text": ' "quoted"\n\t', "finish_reason": "stop", "stop_reason": 42}, USAGE),
    ({"index": 0, "text": "x", "finish_reason": "stop", "stop_reason": "</s>"}, None),
    ({"index": 0, "text": " Paris\u00e9", "logprobs": COMPLETION_LOGPROBS}, USAGE),
    # return_token_ids: the prompt's ids in a choice's first chunk, the new ids in each
    ({"index": 0, "text": "ab", "prompt_token_ids": [1, 2], "token_ids": [5, 6]}, None),
    ({"index": 1, "text": "", "finish_reason": "stop", "token_ids": []}, USAGE),
]


@pytest.mark.parametrize(("fields", "usage"), COMPLETION_CASES)
def test_completion_chunk_matches_the_pydantic_model(fields: dict, usage: UsageInfo | None) -> None:
    reference = CompletionResponse(
        id="cmpl-1",
        created=1_700_000_000,
        model="m",
        choices=[CompletionChoice(**fields)],
        usage=usage,
    ).model_dump_json()
    encoder = ChunkEncoder("text_completion", "cmpl-1", 1_700_000_000, "m")
    event = encoder.event([completion_choice(**fields)], _as_dict(usage))
    assert event == f"data: {reference}\n\n".encode()


def test_an_empty_usage_chunk_matches_the_pydantic_model() -> None:
    reference = CompletionResponse(
        id="cmpl-1", created=5, model="m", choices=[], usage=USAGE
    ).model_dump_json()
    event = ChunkEncoder("text_completion", "cmpl-1", 5, "m").event([], _as_dict(USAGE))
    assert event == f"data: {reference}\n\n".encode()


CHAT_CASES = [
    ({"index": 0, "role": "assistant", "content": ""}, None),
    ({"index": 2, "content": "Hel"}, None),
    ({"index": 0, "content": "", "finish_reason": "length"}, USAGE),
    ({"index": 1, "finish_reason": "abort"}, None),
    ({"index": 0, "content": "\u4e16", "logprobs": CHAT_LOGPROBS, "stop_reason": 2}, None),
    ({"index": 0, "reasoning": "Let me think.\n"}, None),
    ({"index": 0, "content": "ok", "reasoning": "r"}, USAGE),
    (
        {
            "index": 1,
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"city": "Z\u00fcrich"}'},
                }
            ],
            "finish_reason": "tool_calls",
        },
        None,
    ),
    # a streamed call: its start, then a piece of its arguments
    (
        {
            "index": 0,
            "tool_calls": [
                {
                    "index": 1,
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "g", "arguments": ""},
                }
            ],
        },
        None,
    ),
    ({"index": 0, "tool_calls": [{"index": 1, "function": {"arguments": '{"a": "\n'}}]}, None),
    ({"index": 0, "content": "hi", "token_ids": [7, 8]}, None),  # return_token_ids
]
DELTA_FIELDS = ("role", "content", "reasoning", "tool_calls")


@pytest.mark.parametrize(("fields", "usage"), CHAT_CASES)
def test_chat_chunk_matches_the_pydantic_model(fields: dict, usage: UsageInfo | None) -> None:
    delta = DeltaMessage(**{k: v for k, v in fields.items() if k in DELTA_FIELDS})
    model_fields = {k: v for k, v in fields.items() if k not in DELTA_FIELDS}
    reference = ChatCompletionChunk(
        id="chatcmpl-1",
        created=9,
        model="served",
        choices=[ChatStreamChoice(delta=delta, **model_fields)],
        usage=usage,
    ).model_dump_json()
    event = ChunkEncoder("chat.completion.chunk", "chatcmpl-1", 9, "served").event(
        [chat_choice(**fields)], _as_dict(usage)
    )
    assert event == f"data: {reference}\n\n".encode()


def test_a_chat_chunk_with_the_prompts_token_ids_matches_the_pydantic_model() -> None:
    reference = ChatCompletionChunk(
        id="c",
        created=3,
        model="m",
        choices=[ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))],
        prompt_token_ids=[1, 2, 3],
    ).model_dump_json()
    event = ChunkEncoder("chat.completion.chunk", "c", 3, "m").event(
        [chat_choice(0, role="assistant", content="")], None, prompt_token_ids=[1, 2, 3]
    )
    assert event == f"data: {reference}\n\n".encode()
    plain = ChatCompletionChunk(id="c", created=3, model="m", choices=[]).model_dump()
    assert "prompt_token_ids" not in plain


def test_reasoning_is_sent_as_reasoning_content_too() -> None:
    [choice] = json.loads(
        ChunkEncoder("chat.completion.chunk", "c", 1, "m").event(
            [chat_choice(0, reasoning="hmm")], None
        )[len(b"data: ") :]
    )["choices"]
    assert choice["delta"] == {"reasoning": "hmm", "reasoning_content": "hmm"}
    message = ChatResponseMessage(content="x", reasoning="why").model_dump()
    assert (message["reasoning"], message["reasoning_content"]) == ("why", "why")
    assert "reasoning_content" not in ChatResponseMessage(content="x").model_dump()


def test_several_choices_in_one_event() -> None:
    encoder = ChunkEncoder("text_completion", "id", 1, "m")
    event = encoder.event(
        [completion_choice(0, "a"), completion_choice(1, "b", None, "stop")], None
    )
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    body = json.loads(event[len(b"data: ") :])
    assert [c["text"] for c in body["choices"]] == ["a", "b"]
    assert body["choices"][1]["finish_reason"] == "stop"
    assert body["usage"] is None


def test_the_usage_counter_dict_is_the_usage_model() -> None:
    counter = UsageCounter()
    counter.prompt_tokens.update({0: 7, 1: 5})
    counter.cached_tokens.update({0: 4})
    counter.completion_tokens = 3
    assert counter.as_dict() == counter.info().model_dump(mode="json")
    assert counter.info().total_tokens == 15
