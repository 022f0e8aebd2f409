"""Structured outputs through the engine: every output matches its constraint, whatever the
sampling, the batch, async scheduling, preemption or tensor parallelism; unconstrained
requests in the same batch are untouched."""

from __future__ import annotations

import json
import os
import re

import pytest

from chassis import LLM, SamplingParams
from chassis.core.structured_output import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPTS = ["Hello", "The capital of France is", "Write JSON:", "1 2 3 4"]


def check_person(text: str) -> None:
    value = json.loads(text)
    assert set(value) <= set(PERSON["properties"]) and {"name", "age"} <= set(value)
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert value.get("pet", "cat") in ("cat", "dog", None)
    assert all(t in ("a", "b") for t in value.get("tags", []))


def constrained(constraint: dict, **params) -> SamplingParams:
    params.setdefault("max_tokens", 120)
    return SamplingParams(structured_outputs=StructuredOutputsParams(**constraint), **params)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=256)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_of_constraint_holds_on_a_random_model(
    tiny_llm: LLM, temperature: float
) -> None:
    """A random-weight model follows nothing by itself: what it writes is the constraint's."""
    cases = [
        (
            {"regex": r"[ab]{3,6}-(x|yz)\d?"},
            lambda t: re.fullmatch(r"[ab]{3,6}-(x|yz)\d?", t) is not None,
        ),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"json": PERSON}, check_person),
    ]
    for constraint, check in cases:
        # every output of these constraints is bounded: the model must reach the end
        params = constrained(constraint, temperature=temperature, seed=3, max_tokens=200)
        for output in tiny_llm.generate(PROMPTS, params):
            completion = output.outputs[0]
            assert completion.finish_reason == "stop", (constraint, completion.text)
            assert check(completion.text) is not False, (constraint, completion.text)
    # Any JSON object: a random model rarely closes a string it opened (keys are free text),
    # so a cut-off object is checked only for its start; test_smollm2_* checks whole ones.
    params = constrained({"json_object": True}, temperature=temperature, seed=3, max_tokens=20)
    for output in tiny_llm.generate(PROMPTS, params):
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:
            assert completion.text.startswith("{")


def test_constrained_and_free_requests_share_a_batch(tiny_llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, free)]
    mixed = tiny_llm.generate(
        PROMPTS * 2, [free] * len(PROMPTS) + [constrained({"json": PERSON})] * len(PROMPTS)
    )
    assert [o.outputs[0].token_ids for o in mixed[: len(PROMPTS)]] == alone
    for output in mixed[len(PROMPTS) :]:
        check_person(output.outputs[0].text)


def test_async_scheduling_gives_the_same_constrained_outputs(tiny_llama_dir, tiny_llm) -> None:
    params = [
        constrained({"json": PERSON}, temperature=1.0, seed=s) for s in range(len(PROMPTS))
    ] + [SamplingParams(temperature=1.0, seed=9, max_tokens=20, ignore_eos=True)]
    prompts = [*PROMPTS, "free"]
    expected = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params)]
    async_llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=256,
        async_scheduling=True,
    )
    got = [o.outputs[0].token_ids for o in async_llm.generate(prompts, params)]
    assert got == expected


def test_preempted_requests_keep_their_place_in_the_grammar(tiny_llama_dir) -> None:
    """With too few KV blocks for the batch, requests are preempted and recomputed; their
    matchers keep the tokens they had accepted."""
    small = LLM(
        str(tiny_llama_dir), dtype="float32", max_model_len=96, num_kv_blocks=24, block_size=4
    )
    params = constrained({"json": PERSON}, temperature=1.0, seed=5, max_tokens=60)
    outputs = small.generate([p * 3 for p in PROMPTS] * 2, params)
    assert small.engine.scheduler.stats().num_preemptions > 0
    for output in outputs:
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            check_person(completion.text)
        else:  # cut by max_tokens: a prefix of a valid object
            assert completion.finish_reason == "length" and completion.text.startswith("{")


def test_n_choices_each_follow_the_constraint(tiny_llm: LLM) -> None:
    params = constrained({"choice": ["yes", "no", "maybe"]}, temperature=1.0, n=6, seed=1)
    [output] = tiny_llm.generate(["Answer:"], params)
    assert len(output.outputs) == 6
    assert all(c.text in ("yes", "no", "maybe") for c in output.outputs)


def test_unsupported_constraints_are_refused_before_the_engine(tiny_llm: LLM) -> None:
    with pytest.raises(ValueError, match="uniqueItems"):
        tiny_llm.generate(["x"], constrained({"json": {"type": "array", "uniqueItems": True}}))
    with pytest.raises(ValueError, match=r"(?i)lookahead|look-ahead|\(\?="):
        tiny_llm.generate(["x"], constrained({"regex": "a(?=b)"}))
    # the engine still serves
    assert tiny_llm.generate(["x"], constrained({"choice": ["ok"]}))[0].outputs[0].text == "ok"


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_tensor_parallel_ranks_follow_the_constraint(tiny_llama_dir) -> None:
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=128,
        tensor_parallel_size=2,
    )
    try:
        params = constrained({"json": PERSON}, temperature=1.0, seed=2)
        for output in llm.generate(PROMPTS, params):
            check_person(output.outputs[0].text)
    finally:
        llm.shutdown()


def test_smollm2_writes_the_json_it_is_asked_for(smollm2_dir) -> None:
    llm = LLM(str(smollm2_dir), dtype="float32", max_model_len=512, num_kv_blocks=64)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    [output] = llm.chat(
        [{"role": "user", "content": "Name the capital of France and its country, as JSON."}],
        constrained({"json": schema}, temperature=0.0, max_tokens=40),
    )
    value = json.loads(output.outputs[0].text)
    assert value["city"] == "Paris" and value["country"].lower() == "france"
    [output] = llm.chat(
        [{"role": "user", "content": "Describe a cat in JSON with its name and colour."}],
        constrained({"json_object": True}, temperature=0.0, max_tokens=60),
    )
    assert output.outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(output.outputs[0].text), dict)


# -- engine-core bookkeeping ----------------------------------------------------------------------


def test_a_refused_duplicate_id_keeps_the_running_request_s_matcher(tiny_llm: LLM) -> None:
    """The matcher is tracked only once the scheduler accepted the request: a second request
    with a running request's id is refused without touching the first one's place."""
    core = tiny_llm.engine
    params = constrained({"regex": "abcdefgh"}, temperature=1.0, seed=0)
    [first] = tiny_llm.input_processor.process("hi", params, "dup")
    core.add_request(first)
    core.step()  # prefill and the first constrained token
    core.step()
    matcher = core.structured_outputs.matcher_of("dup")
    with pytest.raises(ValueError):
        core.add_request(first)
    assert core.structured_outputs.matcher_of("dup") is matcher
    texts = []
    while core.has_unfinished():
        texts += [o for o in core.step().outputs if o.request_id == "dup"]
    assert core.structured_outputs.num_tracked == 0
    tokens = [t for o in texts for t in o.new_token_ids]
    assert texts[-1].finish_reason == "stop" and tokens


def test_a_grammar_that_allows_nothing_ends_the_request_with_eos(tiny_llm: LLM) -> None:
    """A state no token of the vocabulary can leave (here: a stand-in matcher) must not
    leave every logit at -inf: the request gets EOS only, and ends."""
    import numpy as np

    class Stuck:
        def allowed_tokens(self):
            return np.zeros(tiny_llm.engine.structured_outputs.backend.vocabulary.vocab_size, bool)

        def accept_token(self, token_id):
            return False

    core = tiny_llm.engine
    params = constrained({"choice": ["x"]}, temperature=1.0, seed=0)
    [request] = tiny_llm.input_processor.process("hi", params, "stuck")
    core.add_request(request)
    core.structured_outputs.track("stuck", request.prompt_token_ids, Stuck())
    outputs = []
    while core.has_unfinished():
        outputs += core.step().outputs
    [last] = [o for o in outputs if o.finished]
    assert last.finish_reason == "stop" and last.new_token_ids[-1] in request.eos_token_ids


def test_a_tokenizer_that_cannot_be_mapped_is_a_clear_error(tiny_llm: LLM) -> None:
    from chassis.core.input_processor import InputProcessor

    class SlowTokenizer:  # no backend_tokenizer: not tokenizers-backed
        def __len__(self) -> int:
            return 49152

    processor = InputProcessor(SlowTokenizer(), tiny_llm.config, [2])
    for _ in range(2):  # the refusal is remembered
        with pytest.raises(ValueError, match=r"fast .*tokenizer"):
            processor.process([1, 2, 3], constrained({"choice": ["a"]}), "r")


@pytest.mark.timeout(120)  # a hang guard, not a timed assertion
def test_large_and_deep_constraints_are_checked_quickly() -> None:
    """Sizes a client can send in one request: long choices compile in linear memory (sharing
    their suffixes was quadratic), many choices dedupe in linear time, and what cannot be
    compiled is a ValueError, never a RecursionError or OverflowError."""
    from chassis.builtin_plugins.structured_output.backend import (
        ChassisStructuredOutputBackend as Backend,
    )

    Backend.check(StructuredOutputsParams(choice=["x" * 12000, "y" * 12000]))
    Backend.check(StructuredOutputsParams(choice=[f"item{i}" for i in range(20000)]))
    with pytest.raises(ValueError, match="too large"):
        Backend.check(StructuredOutputsParams(choice=["x" * 100000, "y" * 100000]))

    deep = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    refused = [
        {"json": deep},
        {"json": {"type": "integer", "maximum": 10**400}},
        {"json": {"const": float("inf")}},
        {"regex": "(" * 2000 + "a" + ")" * 2000},
    ]
    for constraint in refused:
        with pytest.raises(ValueError):
            Backend.check(StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match="nested too deeply"):
        StructuredOutputsParams(json="[" * 5000 + "]" * 5000)
