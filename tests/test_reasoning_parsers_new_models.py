"""The reasoning parsers added with vLLM's names for the new model families: ``granite``
(Granite 3.2+'s "Here is my thought process:" / "Here is my response:"), ``seed_oss``
(``<seed:think>``), ``deepseek_v3``, ``glm45`` and ``olmo3`` (``<think>`` read as ``qwen3`` or
``deepseek_r1`` read it), ``ernie45`` (``</think>`` then a ``<response>``-wrapped answer) and
``hunyuan_a13b`` (``<think>`` then ``<answer>``). Each split is checked whole, one character
at a time and cut at random places (:func:`parser_splits.split_ways`), and the formats run end
to end through ``/v1/chat/completions`` with the fake engine."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from parser_splits import random_pieces, run_reasoning_parser, split_ways
from test_server_chat_parsing import calls_content_finish
from test_server_routes import sse_events

from chassis.builtin_plugins.parsers.answer_tags import (
    AnswerUnwrapper,
    Ernie45ReasoningParser,
    HunyuanA13BReasoningParser,
)
from chassis.builtin_plugins.parsers.granite_reasoning import GraniteReasoningParser
from chassis.builtin_plugins.parsers.think_tags import (
    DeepSeekV3ReasoningParser,
    Glm45ReasoningParser,
    Olmo3ReasoningParser,
    SeedOssReasoningParser,
)
from chassis.plugins.registries import get_registries
from chassis.serve.app import build_app
from chassis.serve.reasoning_parser import ReasoningDelta, ReasoningParser, ReasoningTags
from chassis.serve.settings import ServerSettings

THOUGHT = "Here is my thought process:"
THOUGHT2 = "Here's my thought process:"
RESPONSE = "Here is my response:"
RESPONSE2 = "Here's my response:"
V31_THINKING = "<｜User｜>Hi<｜Assistant｜><think>"
V31_NOT_THINKING = "<｜User｜>Hi<｜Assistant｜></think>"
GLM_NOT_THINKING = "<|user|>\nHi<|assistant|>\n<think></think>\n"

CASES: list[tuple[type[ReasoningParser], str, str, str, str]] = [
    # (parser, prompt, output, reasoning, content)
    # -- granite
    (
        GraniteReasoningParser,
        "",
        f"{THOUGHT}\nThe user wants a city.\n\n{RESPONSE}\nParis.",
        "The user wants a city.",
        "Paris.",
    ),
    (GraniteReasoningParser, "", f"{THOUGHT2} a {RESPONSE2} b", "a", "b"),
    (GraniteReasoningParser, "", f"  {THOUGHT} a\n{RESPONSE2}\n\nb\n", "a", "b\n"),
    # no thought marker first: the whole message is content
    (GraniteReasoningParser, "", "Paris is the capital.", "", "Paris is the capital."),
    (
        GraniteReasoningParser,
        "",
        f"Well. {THOUGHT} a {RESPONSE} b",
        "",
        f"Well. {THOUGHT} a {RESPONSE} b",
    ),
    (GraniteReasoningParser, "", f"{RESPONSE} b", "", f"{RESPONSE} b"),
    (GraniteReasoningParser, "", "  Here is my", "", "Here is my"),
    (GraniteReasoningParser, "", "Here", "", "Here"),
    (GraniteReasoningParser, "", "", "", ""),
    # no response marker: the rest is reasoning (as vLLM streams it)
    (GraniteReasoningParser, "", f"{THOUGHT} still thinking", "still thinking", ""),
    (GraniteReasoningParser, "", f"{THOUGHT} a \n Here is my", "a \n Here is my", ""),
    (GraniteReasoningParser, "", f"{THOUGHT}\n\n", "", ""),
    # look-alikes in the reasoning stay reasoning; a second response marker is content
    (
        GraniteReasoningParser,
        "",
        f"{THOUGHT} Here is my plan: go. Here's my respons {RESPONSE} x {RESPONSE} y",
        "Here is my plan: go. Here's my respons",
        f"x {RESPONSE} y",
    ),
    (GraniteReasoningParser, "", f"{THOUGHT} ü 世界 {RESPONSE} ünï 😀", "ü 世界", "ünï 😀"),
    # the prompt (Granite's system message names both markers) does not matter
    (GraniteReasoningParser, f"Write after '{THOUGHT}' and '{RESPONSE}'.", "Hi.", "", "Hi."),
    # -- seed_oss: deepseek_r1's reading of <seed:think>
    (SeedOssReasoningParser, "", "<seed:think>\nhmm\n</seed:think>\n\nAnswer.", "hmm", "Answer."),
    (SeedOssReasoningParser, "", "hmm</seed:think>Answer.", "hmm", "Answer."),
    (SeedOssReasoningParser, "", "no end tag", "no end tag", ""),
    (
        SeedOssReasoningParser,
        "",
        "<seed:think>a <seed:cot_budget_reflect>used 10</seed:cot_budget_reflect> b</seed:think>c",
        "a <seed:cot_budget_reflect>used 10</seed:cot_budget_reflect> b",
        "c",
    ),
    (SeedOssReasoningParser, "", "<think>x</think>y", "<think>x</think>y", ""),
    # -- deepseek_v3: qwen3's reading; V3.1's prompt says whether thinking is on
    (DeepSeekV3ReasoningParser, V31_THINKING, "hmm\n</think>\n\nAnswer.", "hmm", "Answer."),
    (DeepSeekV3ReasoningParser, V31_NOT_THINKING, "Answer.", "", "Answer."),
    (DeepSeekV3ReasoningParser, V31_NOT_THINKING, "a</think>b", "", "a</think>b"),
    (DeepSeekV3ReasoningParser, "", "<think>x</think>y", "x", "y"),
    # -- glm45: qwen3's reading
    (Glm45ReasoningParser, "<|assistant|>", "<think>x\n</think>\ny", "x", "y"),
    (Glm45ReasoningParser, GLM_NOT_THINKING, "Answer.", "", "Answer."),
    (Glm45ReasoningParser, "", "no think", "", "no think"),
    # -- olmo3: deepseek_r1's reading (the opening tag optional)
    (Olmo3ReasoningParser, "", "<think>x</think>y", "x", "y"),
    (Olmo3ReasoningParser, "<|im_start|>assistant\n<think>", "x\n</think>\n\ny", "x", "y"),
    (Olmo3ReasoningParser, "", "x</think>y", "x", "y"),
    (Olmo3ReasoningParser, "", "no end", "no end", ""),
    # -- ernie45: reasoning up to </think>, then the answer unwrapped of <response>
    (
        Ernie45ReasoningParser,
        "",
        "abc\n</think>\n\n<response>\ndef\n</response>\n",
        "abc",
        "def",
    ),
    (Ernie45ReasoningParser, "", "abc\n</think>\ndef", "abc", "def"),
    (Ernie45ReasoningParser, "", "<think>abc</think><response>def</response>", "abc", "def"),
    (Ernie45ReasoningParser, "", "abc</think><response>\n\n</response>", "abc", ""),
    (Ernie45ReasoningParser, "", "abc</think><response>de", "abc", "de"),
    (Ernie45ReasoningParser, "", "abc</think><response>de</resp", "abc", "de</resp"),
    (Ernie45ReasoningParser, "", "abc</think><resp", "abc", "<resp"),
    (Ernie45ReasoningParser, "", "still thinking", "still thinking", ""),
    # a closing tag followed by more text, and an answer not opened by the tag: as written
    (
        Ernie45ReasoningParser,
        "",
        "a</think><response>x</response> y</response>",
        "a",
        "x</response> y",
    ),
    (
        Ernie45ReasoningParser,
        "",
        "a</think>So: <response>x</response>",
        "a",
        "So: <response>x</response>",
    ),
    # -- hunyuan_a13b: qwen3's reading, then the answer unwrapped of <answer>
    (
        HunyuanA13BReasoningParser,
        "",
        "<think>\nThe user asks.\n</think>\n<answer>\nParis.\n</answer>",
        "The user asks.",
        "Paris.",
    ),
    (HunyuanA13BReasoningParser, "", "<answer>\nParis.\n</answer>", "", "Paris."),
    (HunyuanA13BReasoningParser, "", "Paris.", "", "Paris."),
    (HunyuanA13BReasoningParser, "<think>\n", "r\n</think>\n<answer>\nc", "r", "c"),
    (HunyuanA13BReasoningParser, "", "<think>r</think><answer>a</answer>\nb", "r", "a</answer>\nb"),
]


@pytest.mark.parametrize(("cls", "prompt", "output", "reasoning", "content"), CASES)
def test_reasoning_split(
    cls: type[ReasoningParser], prompt: str, output: str, reasoning: str, content: str
) -> None:
    expected = ReasoningDelta(reasoning, content)
    assert cls(None, prompt).parse(output) == expected
    for parts in split_ways(output):
        assert run_reasoning_parser(cls, prompt, parts) == expected, parts


def test_granite_reasoning_streams_before_the_response_marker() -> None:
    parser = GraniteReasoningParser(None, "")
    assert parser.feed("Here is my") == ReasoningDelta()  # may be the marker: held
    assert parser.feed(" thought process:\nStep one") == ReasoningDelta(reasoning="Step one")
    assert parser.feed(", two.\n\nHere's my") == ReasoningDelta(reasoning=", two.")
    assert parser.feed(" response:\nPar") == ReasoningDelta(content="Par")
    assert parser.feed("is.") == ReasoningDelta(content="is.")
    assert parser.finish() == ReasoningDelta()


def test_ernie45_streams_the_answer_and_holds_only_a_closing_tag() -> None:
    parser = Ernie45ReasoningParser(None, "")
    assert parser.feed("abc\n</think>\n\n<resp") == ReasoningDelta(reasoning="abc")
    assert parser.feed("onse>\nPar") == ReasoningDelta(content="Par")
    assert parser.feed("is.\n</response") == ReasoningDelta(content="is.")
    assert parser.feed(">\n") == ReasoningDelta()
    assert parser.finish() == ReasoningDelta()


_UNWRAP_PIECES = ["<answer>", "</answer>", "<ans", "</ans", " ", "\n", "a", "b"]


def test_answer_unwrapper_does_not_depend_on_the_pieces() -> None:
    rng = random.Random("unwrap")
    for _ in range(300):
        text = "".join(rng.choice(_UNWRAP_PIECES) for _ in range(rng.randrange(8)))
        results = set()
        for pieces in [[text], list(text), *(random_pieces(text, rng) for _ in range(10))]:
            unwrap = AnswerUnwrapper("<answer>", "</answer>")
            results.add("".join(unwrap.feed(p) for p in pieces) + unwrap.finish())
        assert len(results) == 1, (text, results)
        [result] = results
        stripped = text.lstrip()
        if not stripped.startswith("<answer>"):
            assert result == text  # not wrapped: as written


class _Vocab:
    """A tokenizer whose added tokens are single ids and whose other text is one id per
    character."""

    def __init__(self, *tokens: str) -> None:
        self._ids = {token: 1000 + i for i, token in enumerate(tokens)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self._ids[text]] if text in self._ids else [ord(c) for c in text]


def test_registered_by_vllm_names_tags_and_special_tokens() -> None:
    registry = get_registries().reasoning_parsers
    assert registry.get("granite") is GraniteReasoningParser
    assert registry.get("seed_oss") is SeedOssReasoningParser
    assert registry.get("deepseek_v3") is DeepSeekV3ReasoningParser
    assert registry.get("glm45") is Glm45ReasoningParser
    assert registry.get("olmo3") is Olmo3ReasoningParser
    assert registry.get("ernie45") is Ernie45ReasoningParser
    assert registry.get("hunyuan_a13b") is HunyuanA13BReasoningParser
    seed = _Vocab("<seed:think>", "</seed:think>")
    assert SeedOssReasoningParser.reasoning_tags(seed) == ReasoningTags(1000, 1001, True)
    assert SeedOssReasoningParser.reasoning_tags(_Vocab("<think>", "</think>")) is None
    think = _Vocab("<think>", "</think>")
    assert DeepSeekV3ReasoningParser.reasoning_tags(think) == ReasoningTags(1000, 1001, False)
    assert Olmo3ReasoningParser.reasoning_tags(think) == ReasoningTags(1000, 1001, True)
    assert GraniteReasoningParser.reasoning_tags(think) is None  # text markers
    assert SeedOssReasoningParser.needs_special_tokens is True
    assert Glm45ReasoningParser.needs_special_tokens is True
    assert GraniteReasoningParser.needs_special_tokens is False
    assert Olmo3ReasoningParser.needs_special_tokens is False


# -- end to end ----------------------------------------------------------------------------------


def _client(script: str, settings: ServerSettings) -> Iterator[TestClient]:
    with TestClient(build_app(FakeAsyncLLM(script=script, max_model_len=1024), settings)) as client:
        yield client


def _reasoning_content(response: Any, stream: bool) -> tuple[str, str]:
    if stream:
        deltas = [e["choices"][0]["delta"] for e in sse_events(response.text) if e["choices"]]
        return (
            "".join(d.get("reasoning") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas),
        )
    message = response.json()["choices"][0]["message"]
    return message.get("reasoning") or "", message["content"] or ""


@pytest.mark.parametrize("stream", [False, True])
def test_granite_through_the_chat_route(stream: bool) -> None:
    script = f"{THOUGHT}\nThe user greets me.\n\n{RESPONSE}\nHello!"
    for client in _client(script, ServerSettings(reasoning_parser="granite")):
        body = {"messages": [{"role": "user", "content": "Hi"}], "stream": stream}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert _reasoning_content(response, stream) == ("The user greets me.", "Hello!")


@pytest.mark.parametrize("stream", [False, True])
def test_seed_oss_reasoning_and_tool_calls_through_the_chat_route(stream: bool) -> None:
    call = (
        "<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</seed:tool_call>"
    )
    # a call written in the reasoning is no call
    script = f"<seed:think>Maybe {call}? Yes.</seed:think>Checking.\n{call}"
    settings = ServerSettings(
        enable_auto_tool_choice=True, tool_call_parser="seed_oss", reasoning_parser="seed_oss"
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    for client in _client(script, settings):
        body = {
            "messages": [{"role": "user", "content": "Weather?"}],
            "tools": tools,
            "stream": stream,
        }
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        calls, content, finish = calls_content_finish(response, stream)
        assert content == "Checking." and finish == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        assert _reasoning_content(response, stream)[0] == f"Maybe {call}? Yes."
