"""Structured outputs with a reasoning format (``reasoning_parser``): the reasoning is free,
the constraint applies to the answer after it, when the format's tags are single tokens.

The tiny model is random, so it is steered with ``logit_bias``: a token the constraint would
forbid shows whether a stretch of output was constrained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures_models import write_tiny_checkpoint

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.parsers.think_tags import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)
from chassis.core.reasoning_gate import Phase, ReasoningGate, ReasoningTags
from chassis.core.structured_output import StructuredOutputsParams
from chassis.core.tokenizer import load_tokenizer

#: one bounded JSON value: a random model reaches its end
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 whose tokenizer has ``<think>`` and ``</think>`` as single tokens."""
    directory = write_tiny_checkpoint(
        "qwen3", tmp_path_factory.mktemp("thinking"), vocab_size=49160
    )
    tokenizer = load_tokenizer(directory)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def ids(thinking_dir: Path) -> dict[str, int]:
    tokenizer = load_tokenizer(thinking_dir)
    [start] = tokenizer.encode("<think>", add_special_tokens=False)
    [end] = tokenizer.encode("</think>", add_special_tokens=False)
    [word] = tokenizer.encode(" hello", add_special_tokens=False)
    return {"start": start, "end": end, "word": word}


def engine(directory: Path, reasoning_parser: str | None) -> LLM:
    return LLM(
        str(directory),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=128,
        reasoning_parser=reasoning_parser,
    )


def generate(
    llm: LLM,
    prompt: str,
    bias: dict[int, float],
    max_tokens: int = 40,
    after_reasoning: bool = True,
):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        logit_bias=bias,
        structured_outputs={"json": SCHEMA, "after_reasoning": after_reasoning},
    )
    return llm.generate([prompt], params)[0].outputs[0]


# -- the gate's rules ------------------------------------------------------------------------


def test_the_gate_follows_the_parser_s_rules() -> None:
    qwen3 = ReasoningTags(start_token_id=7, end_token_id=8)
    r1 = ReasoningTags(start_token_id=7, end_token_id=8, starts_in_reasoning=True)
    assert ReasoningGate(None, [7]).phase is Phase.ANSWER  # no format: all answer
    assert ReasoningGate(qwen3, [1, 2]).phase is Phase.UNDECIDED
    assert ReasoningGate(qwen3, [1, 7, 3]).phase is Phase.REASONING  # left open by the prompt
    assert ReasoningGate(qwen3, [7, 3, 8, 4]).phase is Phase.UNDECIDED  # closed in the prompt
    assert ReasoningGate(r1, [1, 2]).phase is Phase.REASONING

    gate = ReasoningGate(qwen3, [1])
    assert gate.start_token_id == 7
    assert gate.follow(7) is False and gate.phase is Phase.REASONING
    assert gate.start_token_id is None
    assert gate.follow(5) is False and gate.follow(8) is False
    assert gate.phase is Phase.ANSWER and gate.follow(5) is True
    direct = ReasoningGate(qwen3, [1])
    assert direct.follow(5) is True and direct.phase is Phase.ANSWER


def test_tags_are_used_only_when_each_is_one_token(thinking_dir: Path, smollm2_dir: Path) -> None:
    thinking = load_tokenizer(thinking_dir)
    tags = Qwen3ReasoningParser.reasoning_tags(thinking)
    assert tags is not None and not tags.starts_in_reasoning
    r1 = DeepSeekR1ReasoningParser.reasoning_tags(thinking)
    assert r1 is not None and r1.starts_in_reasoning
    # SmolLM2's vocabulary spells "<think>" with several tokens
    assert Qwen3ReasoningParser.reasoning_tags(load_tokenizer(smollm2_dir)) is None


# -- the engine ---------------------------------------------------------------------------------


def test_reasoning_is_free_and_the_answer_after_it_is_constrained(thinking_dir, ids) -> None:
    llm = engine(thinking_dir, "qwen3")
    # The prompt leaves <think> open: the output starts in reasoning, where " hello" (which
    # the JSON schema forbids) may be written; nothing ends the reasoning here.
    free = generate(llm, "Question?<think>", {ids["word"]: 100.0}, max_tokens=6)
    assert free.token_ids == [ids["word"]] * 6 and free.finish_reason == "length"
    # The end tag is favoured: the reasoning ends at once, and the answer is the schema's
    # (the bias on </think> no longer counts: the constraint forbids it after the reasoning).
    out = generate(llm, "Question?<think>", {ids["end"]: 100.0})
    assert out.token_ids[0] == ids["end"] and out.finish_reason == "stop"
    assert out.text.startswith("</think>")
    answer = json.loads(out.text.removeprefix("</think>"))
    assert answer in ({"ok": True}, {"ok": False})


def test_an_undecided_start_allows_the_start_tag_or_the_answer(thinking_dir, ids) -> None:
    llm = engine(thinking_dir, "qwen3")
    # Nothing in the prompt: the first token may open the reasoning ...
    opened = generate(llm, "Question?", {ids["start"]: 100.0, ids["word"]: 50.0}, max_tokens=4)
    assert opened.token_ids == [ids["start"]] + [ids["start"]] * 3  # free once inside
    # ... or begin the answer, which is then constrained from its first token.
    direct = generate(llm, "Question?", {ids["start"]: -100.0, ids["word"]: 100.0})
    assert ids["word"] not in direct.token_ids and direct.finish_reason == "stop"
    assert json.loads(direct.text) in ({"ok": True}, {"ok": False})


def test_deepseek_r1_starts_in_reasoning(thinking_dir, ids) -> None:
    llm = engine(thinking_dir, "deepseek_r1")
    out = generate(llm, "Question?", {ids["word"]: 100.0}, max_tokens=5)
    assert out.token_ids == [ids["word"]] * 5


@pytest.mark.parametrize("reasoning_parser", [None, "qwen3"])
def test_without_both_the_format_and_the_request_flag_all_is_constrained(
    thinking_dir, ids, reasoning_parser
) -> None:
    """The reasoning is left free only when the engine knows the format and the request
    asks (``after_reasoning``, which the chat route sets; /v1/completions and plain offline
    requests keep their whole output constrained)."""
    llm = engine(thinking_dir, reasoning_parser)
    bias = {ids["start"]: 100.0, ids["end"]: 100.0}
    out = generate(llm, "Question?<think>", bias, after_reasoning=reasoning_parser is None)
    assert ids["start"] not in out.token_ids and ids["end"] not in out.token_ids
    assert json.loads(out.text) in ({"ok": True}, {"ok": False})


def test_eos_cannot_end_a_constrained_request_inside_its_reasoning(thinking_dir, ids) -> None:
    """A constrained request must reach its answer: only max_tokens may cut it short."""
    llm = engine(thinking_dir, "qwen3")
    [eos] = llm.input_processor.eos_token_ids
    out = generate(llm, "Question?<think>", {eos: 100.0}, max_tokens=5)
    assert eos not in out.token_ids and out.finish_reason == "length"


def test_the_server_keeps_the_reasoning_parser_for_gated_output(thinking_dir, smollm2_dir):
    from chassis.serve.chat_parsing import ChatParsers
    from chassis.serve.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"}
    )
    constraint = body.to_sampling_params().structured_outputs
    parsers = ChatParsers(reasoning_cls=Qwen3ReasoningParser)
    thinking = load_tokenizer(thinking_dir)
    gated = parsers.for_request(body, thinking, "prompt", constraint)
    assert gated is not None and gated.reasoning_cls is Qwen3ReasoningParser
    assert gated.constrained_after_reasoning
    # without single-token tags the whole output is constrained: no reasoning to split off
    assert parsers.for_request(body, load_tokenizer(smollm2_dir), "prompt", constraint) is None
    # nor for a regex or a choice: the reasoning parser strips the answer's leading spaces
    choice = StructuredOutputsParams(choice=[" yes", " no"])
    assert parsers.for_request(body, thinking, "prompt", choice) is None


def test_the_chat_route_constrains_the_answer_after_the_reasoning(thinking_dir, ids, tmp_path):
    """``chassis serve --reasoning-parser qwen3``: the chat route asks the engine to leave the
    reasoning free (``after_reasoning``), so the favoured ``</think>`` may come first and the
    answer after it is the schema's; ``message.reasoning`` and ``content`` are split."""
    pytest.importorskip("openai")
    from server_process import running_server

    flags = ["--reasoning-parser", "qwen3"]
    with running_server(thinking_dir, tmp_path, extra_args=flags) as server:
        client = server.client()
        kwargs = {
            "model": "tiny",
            # the prompt leaves <think> open: the output starts in the reasoning
            "messages": [
                {"role": "user", "content": "Is it?"},
                {"role": "assistant", "content": "<think>"},
            ],
            "extra_body": {"continue_final_message": True, "add_generation_prompt": False},
            "logit_bias": {str(ids["end"]): 100},
            "max_tokens": 30,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA},
            },
        }
        response = client.chat.completions.create(**kwargs)
        message = response.choices[0].message
        assert json.loads(message.content) in ({"ok": True}, {"ok": False})
        assert not getattr(message, "reasoning", None)  # the reasoning ended at once
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == message.content
