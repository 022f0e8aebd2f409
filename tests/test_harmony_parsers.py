"""gpt-oss's Harmony format: the ``openai_gptoss`` reasoning parser and the ``openai`` tool
parser, alone and together (as :class:`ChoiceParser` runs them), on whole messages and cut at
every point, then through the chat route with the fake engine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from parser_splits import random_pieces, run_reasoning_parser, run_tool_parser
from test_server_chat_parsing import calls_content_finish
from test_server_routes import sse_events

from chassis.builtin_plugins.parsers.harmony_reasoning import HarmonyReasoningParser
from chassis.builtin_plugins.parsers.harmony_scan import parse_header
from chassis.builtin_plugins.parsers.harmony_tools import HarmonyToolParser
from chassis.plugins.registries import get_registries
from chassis.serve.app import build_app
from chassis.serve.chat_parsing import ChatParsers, ChoiceDelta, ChoiceParser
from chassis.serve.settings import ServerSettings

Calls = list[tuple[str, str]]

PROMPT = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for name in ("get_weather", "get_time")
]


def msg(channel: str, body: str, to: str | None = None, end: str = "<|end|>") -> str:
    """A whole assistant message, the recipient after the channel and ``<|constrain|>json``
    for a call, as gpt-oss writes them."""
    header = f"<|channel|>{channel}"
    if to is not None:
        header += f" to={to} <|constrain|>json"
    return f"<|start|>assistant{header}<|message|>{body}{end}"


def first(text: str) -> str:
    """``text`` as the first message of the output: the template wrote ``<|start|>assistant``."""
    prefix = "<|start|>assistant"
    assert text.startswith(prefix)
    return text[len(prefix) :]


THINK = msg("analysis", "The user wants the weather. Use get_weather.")
CALL = msg("commentary", '{"city":"Paris"}', to="functions.get_weather", end="<|call|>")
CALL_ARGS = '{"city": "Paris"}'


# -- running the parsers every way ---------------------------------------------------------


def run_choice(pieces: list[str], reasoning: bool, tools: bool, prompt: str = PROMPT) -> Any:
    """(reasoning, content, [(name, arguments)]) of a fresh :class:`ChoiceParser` fed
    ``pieces``, after checking the fragments: each call starts once, before its arguments,
    and calls do not interleave."""
    parser = ChoiceParser(
        HarmonyReasoningParser(None, prompt) if reasoning else None,
        HarmonyToolParser(None, TOOLS) if tools else None,
    )
    total = ChoiceDelta()
    fragments = []
    for piece in pieces:
        delta = parser.feed(piece)
        fragments += delta.fragments
        total += delta
    delta = parser.finish()
    fragments += delta.fragments
    total += delta
    started: list[int] = []
    for fragment in fragments:
        if fragment.starts_call:
            assert fragment.index == len(started) and fragment.id
            started.append(fragment.index)
        else:
            assert started and fragment.index == started[-1]
    return total.reasoning, total.content, [(c.name, c.arguments) for c in total.calls]


def every_way(text: str, reasoning: bool = True, tools: bool = True, prompt: str = PROMPT) -> Any:
    """The result for ``text`` whole, after checking that it is the same cut at every point
    (two pieces), one character at a time, and cut many random ways."""
    whole = run_choice([text], reasoning, tools, prompt)
    for cut in range(1, len(text)):
        pieces = [text[:cut], text[cut:]]
        assert run_choice(pieces, reasoning, tools, prompt) == whole, pieces
    assert run_choice(list(text), reasoning, tools, prompt) == whole
    rng = random.Random(text)
    for _ in range(20):
        pieces = random_pieces(text, rng)
        assert run_choice(pieces, reasoning, tools, prompt) == whole, pieces
    return whole


# -- both parsers --------------------------------------------------------------------------------

CASES: dict[str, tuple[str, str, str, Calls]] = {
    # id: (output, reasoning, content, calls) with both parsers
    "reasoning and final": (
        first(THINK) + msg("final", "It is sunny.", end="<|return|>"),
        "The user wants the weather. Use get_weather.",
        "It is sunny.",
        [],
    ),
    "final with the stop token left out": (
        first(THINK) + msg("final", "It is sunny.", end=""),
        "The user wants the weather. Use get_weather.",
        "It is sunny.",
        [],
    ),
    "reasoning and a call": (
        first(THINK) + CALL,
        "The user wants the weather. Use get_weather.",
        "",
        [("get_weather", CALL_ARGS)],
    ),
    "a call first, the stop token left out": (
        first(msg("commentary", '{"city":"Paris"}', to="functions.get_weather", end="")),
        "",
        "",
        [("get_weather", CALL_ARGS)],
    ),
    "the recipient before the channel": (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
        "",
        "",
        [("get_weather", CALL_ARGS)],
    ),
    "the recipient before the channel, later": (
        first(THINK)
        + '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"city"'
        ':\n  "Rome"}<|call|>',
        "The user wants the weather. Use get_weather.",
        "",
        [("get_time", '{"city": "Rome"}')],
    ),
    "a preamble, two calls and a final message": (
        first(THINK)
        + msg("commentary", "Checking both cities.")
        + CALL
        + msg("commentary", '{"city":"Rome"}', to="functions.get_weather", end="<|call|>")
        + msg("final", "Sunny in both.", end="<|return|>"),
        "The user wants the weather. Use get_weather.",
        "Checking both cities.\nSunny in both.",
        [("get_weather", CALL_ARGS), ("get_weather", '{"city": "Rome"}')],
    ),
    "several analysis messages": (
        first(msg("analysis", "First thought."))
        + msg("analysis", "Second thought.")
        + msg("final", "Answer."),
        "First thought.\nSecond thought.",
        "Answer.",
        [],
    ),
    "bodies are kept as written": (
        first(msg("analysis", "  spaced\n")) + msg("final", "\nline one\nline two\n"),
        "  spaced\n",
        "\nline one\nline two\n",
        [],
    ),
    "cut short in the analysis": (
        first(msg("analysis", "The user wants", end="")),
        "The user wants",
        "",
        [],
    ),
    "cut short in a header": (
        first(THINK) + "<|start|>assistant<|channel|>comment",
        "The user wants the weather. Use get_weather.",
        "",
        [],
    ),
    "cut short in a call's arguments": (
        first(THINK) + msg("commentary", '{"city": "Par', to="functions.get_weather", end=""),
        "The user wants the weather. Use get_weather.",
        "",
        [("get_weather", '{"city": "Par')],
    ),
    "cut short right after a call's header": (
        first(THINK) + msg("commentary", "", to="functions.get_weather", end=""),
        "The user wants the weather. Use get_weather.",
        "",
        [("get_weather", "{}")],
    ),
    "invalid JSON arguments": (
        first(msg("commentary", '{"city": Paris}', to="functions.get_weather", end="<|call|>")),
        "",
        "",
        [("get_weather", '{"city": Paris}')],
    ),
    "arguments that are not an object": (
        first(msg("commentary", "Paris", to="functions.get_weather", end="<|call|>")),
        "",
        "",
        [("get_weather", "Paris")],
    ),
    "text after the arguments is dropped": (
        first(msg("commentary", '{"city": "Paris"} trailing', to="functions.get_weather")),
        "",
        "",
        [("get_weather", CALL_ARGS)],
    ),
    "an empty body is no arguments": (
        first(msg("commentary", " ", to="functions.get_time", end="<|call|>")),
        "",
        "",
        [("get_time", "{}")],
    ),
    "a text content type": (
        first(
            "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>text"
            "<|message|>Paris, now<|call|>"
        ),
        "",
        "",
        [("get_time", "Paris, now")],
    ),
    "a recipient named as a tool, without the namespace": (
        first(
            '<|start|>assistant<|channel|>commentary to=get_time json<|message|>{"city":"Oslo"}'
            "<|call|>"
        ),
        "",
        "",
        [("get_time", '{"city": "Oslo"}')],
    ),
    "a built-in tool call in the analysis is reasoning": (
        first(
            msg("analysis", "Let me search.") + msg("analysis", "search('x')", to="browser.search")
        )
        + msg("final", "Found it."),
        "Let me search.\nsearch('x')",
        "Found it.",
        [],
    ),
    "a function call in the analysis is still a call": (
        first(msg("analysis", '{"city":"Paris"}', to="functions.get_weather", end="<|call|>")),
        "",
        "",
        [("get_weather", CALL_ARGS)],
    ),
    "another recipient outside the analysis stays as text": (
        first(msg("commentary", '{"q": "x"}', to="browser.search", end="<|call|>")),
        "",
        '<|start|>assistant<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"q":'
        ' "x"}<|call|>',
        [],
    ),
    "a forgotten end before the next header": (
        "<|channel|>analysis<|message|>Thinking.<|channel|>final<|message|>Done.",
        "Thinking.",
        "Done.",
        [],
    ),
    "output that is not Harmony": (
        "Just text, with <|unknown|> and <|chan markers.",
        "",
        "Just text, with <|unknown|> and <|chan markers.",
        [],
    ),
    "special-looking text inside a body": (
        first(msg("final", "Use <|constrain|> and <|message|> and <b>.")),
        "",
        "Use <|constrain|> and <|message|> and <b>.",
        [],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_both_parsers(case: str) -> None:
    text, reasoning, content, calls = CASES[case]
    assert every_way(text) == (reasoning, content, calls)


def test_without_tool_parsing_a_call_stays_text() -> None:
    text = first(THINK) + CALL + msg("final", "Done.")
    reasoning, content, calls = every_way(text, tools=False)
    assert reasoning == "The user wants the weather. Use get_weather."
    assert content == CALL + "Done." and calls == []


def test_the_tool_parser_alone_drops_the_reasoning() -> None:
    for case in CASES.values():
        text, _, content, calls = case
        assert every_way(text, reasoning=False) == ("", content, calls)


def test_the_reasoning_parser_alone() -> None:
    text = first(THINK) + msg("commentary", "Checking.") + msg("final", "Sunny.", end="<|return|>")
    assert every_way(text, tools=False) == (
        "The user wants the weather. Use get_weather.",
        "Checking.\nSunny.",
        [],
    )
    assert run_reasoning_parser(HarmonyReasoningParser, PROMPT, list(text)).content == (
        "Checking.\nSunny."
    )
    assert run_tool_parser(HarmonyToolParser, list(text), TOOLS).content == "Checking.\nSunny."


def test_a_body_the_prompt_opened() -> None:
    final = PROMPT + "<|channel|>final<|message|>"
    assert every_way("It is sunny.<|return|>", prompt=final) == ("", "It is sunny.", [])
    assert every_way("It is sunny.", tools=False, prompt=final) == ("", "It is sunny.", [])
    analysis = PROMPT + "<|channel|>analysis<|message|>"
    assert every_way("Hmm.<|end|>" + msg("final", "Sunny."), prompt=analysis) == (
        "Hmm.",
        "Sunny.",
        [],
    )
    # a closed message in the prompt opens nothing
    closed = PROMPT + "<|channel|>final<|message|>Hi.<|end|><|start|>assistant"
    assert every_way(first(msg("final", "Sunny.")), prompt=closed) == ("", "Sunny.", [])


def test_headers() -> None:
    header = parse_header(
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>", False
    )
    assert (header.role, header.channel, header.recipient, header.content_type) == (
        None,
        "commentary",
        "functions.f",
        "json",
    )
    assert header.function == "f" and header.kind == "call"
    header = parse_header("assistant to=functions.g<|channel|>commentary json<|message|>", True)
    assert (header.role, header.channel, header.function, header.content_type) == (
        "assistant",
        "commentary",
        "g",
        "json",
    )
    assert (
        header.opening == "<|start|>assistant to=functions.g<|channel|>commentary json<|message|>"
    )
    assert parse_header("assistant<|channel|>final<|message|>", True).kind == "content"
    assert parse_header("assistant<|channel|>commentary<|message|>", True).kind == "content"
    assert parse_header("assistant<|channel|>analysis<|message|>", True).kind == "reasoning"
    assert parse_header("assistant<|channel|>commentary to=python<|message|>", True).kind == (
        "addressed"
    )
    assert parse_header("<|channel|>commentary to=functions.<|message|>", False).function is None


# -- streaming -------------------------------------------------------------------------------------


def test_calls_and_reasoning_stream_as_they_are_written() -> None:
    text = first(THINK) + msg("commentary", "Checking.") + CALL + msg("final", "Sunny.")
    parser = ChoiceParser(HarmonyReasoningParser(None, PROMPT), HarmonyToolParser(None, TOOLS))
    deltas = [parser.feed(char) for char in text] + [parser.finish()]
    assert sum(1 for d in deltas if d.reasoning) > 20
    argument_pieces = [f for d in deltas for f in d.fragments if not f.starts_call and f.arguments]
    assert len(argument_pieces) > 5
    # the call starts as soon as its header ends, before its arguments
    header_end = text.index("<|message|>", text.index("to=functions")) + len("<|message|>")
    starts = [i for i, d in enumerate(deltas) if any(f.starts_call for f in d.fragments)]
    assert starts == [header_end - 1]
    # nothing of the markup reaches the client
    for delta in deltas:
        assert "<|" not in delta.content and "<|" not in delta.reasoning


def test_registered_by_vllms_names_and_keep_special_tokens() -> None:
    registries = get_registries()
    assert registries.reasoning_parsers.get("openai_gptoss") is HarmonyReasoningParser
    assert registries.tool_parsers.get("openai") is HarmonyToolParser
    assert HarmonyReasoningParser.needs_special_tokens and HarmonyToolParser.needs_special_tokens
    assert HarmonyReasoningParser.reasoning_tags(None) is None  # multi-token markers
    from chassis.serve.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    parsing = ChatParsers(HarmonyReasoningParser, None).for_request(body, None, PROMPT)
    assert parsing is not None and parsing.needs_special_tokens


# -- through the chat route, with the fake engine --------------------------------------------

HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
SCRIPT = first(THINK) + msg("commentary", "Checking.") + CALL
ANSWER = first(THINK) + msg("final", "It is sunny in Paris.", end="")


def harmony_client(script: str, **settings: Any) -> Iterator[tuple[TestClient, FakeAsyncLLM]]:
    engine = FakeAsyncLLM(script=script, chat_template=HARMONY_TEMPLATE, max_model_len=1024)
    with TestClient(build_app(engine, ServerSettings(**settings))) as client:
        yield client, engine


BOTH = {
    "reasoning_parser": "openai_gptoss",
    "enable_auto_tool_choice": True,
    "tool_call_parser": "openai",
}


def reasoning_of(response: Any, stream: bool) -> str:
    if stream:
        deltas = [e["choices"][0]["delta"] for e in sse_events(response.text) if e["choices"]]
        return "".join(d.get("reasoning") or "" for d in deltas)
    return response.json()["choices"][0]["message"]["reasoning"] or ""


@pytest.mark.parametrize("stream", [False, True])
def test_chat_route_reasoning_and_a_call(stream: bool) -> None:
    for client, engine in harmony_client(SCRIPT, **BOTH):
        body = {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": TOOLS,
            "stream": stream,
        }
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        calls, content, finish = calls_content_finish(response, stream)
        assert (content, finish) == ("Checking.", "tool_calls")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("get_weather", CALL_ARGS)
        ]
        assert calls[0]["id"].startswith("call_")
        assert reasoning_of(response, stream) == "The user wants the weather. Use get_weather."
        assert engine.requests[0][2].skip_special_tokens is False


@pytest.mark.parametrize("stream", [False, True])
def test_chat_route_reasoning_parser_only(stream: bool) -> None:
    for client, engine in harmony_client(ANSWER, reasoning_parser="openai_gptoss"):
        body = {"messages": [{"role": "user", "content": "Weather?"}], "stream": stream}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        _, content, finish = calls_content_finish(response, stream)
        assert (content, finish) == ("It is sunny in Paris.", "stop")
        assert reasoning_of(response, stream) == "The user wants the weather. Use get_weather."
        assert engine.requests[0][2].skip_special_tokens is False


@pytest.mark.parametrize("stream", [False, True])
def test_chat_route_max_tokens_inside_the_analysis(stream: bool) -> None:
    cut = ANSWER.index("weather.")
    for client, _ in harmony_client(ANSWER, **BOTH):
        body = {
            "messages": [{"role": "user", "content": "Weather?"}],
            "tools": TOOLS,
            "stream": stream,
            "max_tokens": cut,
        }
        response = client.post("/v1/chat/completions", json=body)
        calls, content, finish = calls_content_finish(response, stream)
        assert (calls or [], content, finish) == ([], "", "length")
        assert reasoning_of(response, stream) == "The user wants the "
        if not stream:
            assert response.json()["choices"][0]["message"]["content"] is None


def test_chat_route_call_cut_by_max_tokens() -> None:
    cut = SCRIPT.index("Paris") + 3
    for client, _ in harmony_client(SCRIPT, **BOTH):
        for stream in (False, True):
            body = {
                "messages": [{"role": "user", "content": "Weather?"}],
                "tools": TOOLS,
                "stream": stream,
                "max_tokens": cut,
            }
            calls, content, finish = calls_content_finish(
                client.post("/v1/chat/completions", json=body), stream
            )
            assert (content, finish) == ("Checking.", "length")
            assert [c["function"]["arguments"] for c in calls] == ['{"city": "Par']
            assert json.loads(calls[0]["function"]["arguments"] + '"}') == {"city": "Par"}


# -- a real engine: a tiny gpt-oss whose greedy output is written into its weights -------------

#: Harmony's special tokens (the o200k_harmony vocabulary is not available offline: they are
#: added to SmolLM2's tokenizer)
HARMONY_TOKENS = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
]
#: gpt-oss's template, reduced: an assistant message is rendered in the analysis channel, so
#: ``continue_final_message`` leaves the prompt in an open analysis body
ENGINE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|start|>assistant<|channel|>analysis<|message|>"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{% endif %}{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
#: what the model writes after the generation prompt (``<|start|>assistant``) ...
ENGINE_CALL = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
    "<|call|>"
)
#: ... and after an open analysis body ending with "Thinking"
ENGINE_THOUGHT = " about the sky<|end|><|return|>"


def write_scripted_gpt_oss(directory: Any) -> Any:
    """A tiny gpt-oss whose attention and experts add nothing, so each next token depends
    on the current one alone: one-hot embeddings and an LM head that maps each token of
    the two scripts to the next (``istant``, the prompt's last token, to the call's first;
    ``Thinking`` to the thought's). ``<|return|>`` and ``<|call|>`` end generation."""
    import torch
    from test_gpt_oss import tiny_gpt_oss_config
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from chassis.core.gguf_checkpoint import embedded_model_dir

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(embedded_model_dir() / "tokenizer.json"),
        eos_token="<|return|>",
        chat_template=ENGINE_TEMPLATE,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    [start_call] = encode("istant")
    [start_thought] = encode("Thinking")
    chains = [[start_call, *encode(ENGINE_CALL)], [start_thought, *encode(ENGINE_THOUGHT)]]
    successors: dict[int, int] = {}
    for chain in chains:
        for current, following in pairwise(chain):
            assert successors.setdefault(current, following) == following, "a token repeats"
    tokens = sorted(set(successors) | set(successors.values()))
    config = tiny_gpt_oss_config(vocab_size=len(tokenizer))
    assert len(tokens) <= config.hidden_size
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "o_proj" in name or "experts.down_proj" in name:
                param.zero_()  # attention and experts add nothing to the residual
            elif "norm" in name:
                param.fill_(1.0)
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        head.zero_()
        for dim, token in enumerate(tokens):
            embed[token] = 0.0
            embed[token, dim] = 1.0
        for current, following in successors.items():
            head[following, tokens.index(current)] = 10.0
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return directory


@pytest.fixture(scope="module")
def engine_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from chassis.core.async_llm import AsyncLLM
    from chassis.core.config import EngineConfig

    directory = write_scripted_gpt_oss(tmp_path_factory.mktemp("scripted_gpt_oss"))
    engine = AsyncLLM.from_engine_config(
        EngineConfig(model=str(directory), dtype="float32", max_model_len=256, num_kv_blocks=64)
    )
    settings = ServerSettings(shutdown_engine_on_exit=False, **BOTH)
    try:
        with TestClient(build_app(engine, settings)) as client:
            yield client
    finally:
        engine.shutdown_sync()


@pytest.mark.parametrize("stream", [False, True])
def test_real_engine_call(engine_client: TestClient, stream: bool) -> None:
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": TOOLS,
        "stream": stream,
        "temperature": 0,
    }
    response = engine_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    calls, content, finish = calls_content_finish(response, stream)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", CALL_ARGS)
    ]
    # without tools the reasoning parser leaves the call in the content, special tokens kept
    body.pop("tools")
    response = engine_client.post("/v1/chat/completions", json=body)
    _, content, finish = calls_content_finish(response, stream)
    assert content == "<|start|>assistant" + ENGINE_CALL.removesuffix("<|call|>")


@pytest.mark.parametrize("stream", [False, True])
def test_real_engine_reasoning_in_a_body_the_prompt_opened(
    engine_client: TestClient, stream: bool
) -> None:
    body = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Thinking"},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "stream": stream,
        "temperature": 0,
    }
    response = engine_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    _, content, finish = calls_content_finish(response, stream)
    assert (content, finish) == ("", "stop")
    assert reasoning_of(response, stream) == " about the sky"
