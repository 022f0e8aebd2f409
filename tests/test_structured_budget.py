"""A structured-output constraint cannot stall the engine core: each request's matcher has a
work budget (DFA states it makes the automaton build, in NFA states touched), and a request
whose constraint exceeds it, or whose matcher raises, fails alone, with its message, while
the other requests of the same steps finish as they would have alone."""

from __future__ import annotations

import logging
import re
import threading

import numpy as np
import pytest

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.structured_output.backend import (
    DEFAULT_WORK_BUDGET,
    WORK_BUDGET_ENV,
    ChassisGrammarMatcher,
    ChassisStructuredOutputBackend,
    work_budget_from_env,
)
from chassis.core.structured_output import ConstraintBudgetExceeded, StructuredOutputsParams
from chassis.core.token_vocabulary import vocabulary_from_tokenizer

#: nested, nullable bounded repetitions: the empty string reaches every copy, so each DFA
#: state stands for most of the ~97,000-state NFA and the first mask alone needs tens of
#: millions of units (about a minute of the engine core's time without a budget)
TANGLED = """
root ::= (block ","?){0,40}
block ::= (group ";"?){0,12}
group ::= (x | y){0,8}
x ::= [a-z]{0,4} | "ab" | "abc"
y ::= "a" | "b" x?
"""
#: the same shape, small enough to build in full for a reference mask
SMALL_TANGLED = TANGLED.replace("{0,40}", "{0,3}").replace("{0,12}", "{0,3}")
#: a literal first (cheap masks), then the tangled part: fails after a few tokens
LATE_TANGLED = TANGLED.replace("root ::=", 'root ::= "The answer follows in order" part\npart ::=')
#: a budget far above what the 4-rule grammars' cheap states need, far below their cost
SMALL_BUDGET = 20_000


@pytest.fixture(scope="module")
def vocabulary(smol_tokenizer):
    return vocabulary_from_tokenizer(smol_tokenizer, 49152, [smol_tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def encode(smol_tokenizer):
    return lambda text: smol_tokenizer.encode(text, add_special_tokens=False)


def grammar(text: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(grammar=text)


# -- the budget in the backend -------------------------------------------------------------


def test_a_tangled_grammar_exceeds_its_budget_after_bounded_work(vocabulary) -> None:
    backend = ChassisStructuredOutputBackend(vocabulary, work_budget=SMALL_BUDGET)
    compiled = backend.compile(grammar(TANGLED))
    matcher = compiled.matcher()
    with pytest.raises(ConstraintBudgetExceeded, match=f"work budget of {SMALL_BUDGET} "):
        matcher.allowed_tokens()
    # at most one charge past the budget, and one charge is at most the NFA's size
    assert SMALL_BUDGET < matcher.meter.used <= SMALL_BUDGET + compiled.automaton.nfa_size
    with pytest.raises(ConstraintBudgetExceeded):  # the next call is refused as well
        matcher.allowed_tokens()
    assert compiled.automaton.meter is None  # the meter is set only during a call


def test_states_built_before_the_budget_ran_out_stay_correct(vocabulary, encode) -> None:
    """A matcher stopped half-way leaves the automaton consistent: a matcher without a
    budget on the same grammar then gives the mask a fresh, unbounded backend gives."""
    backend = ChassisStructuredOutputBackend(vocabulary, work_budget=2_000)
    compiled = backend.compile(grammar(SMALL_TANGLED))
    with pytest.raises(ConstraintBudgetExceeded):
        compiled.matcher().allowed_tokens()
    resumed = ChassisGrammarMatcher(compiled, None)
    reference = ChassisStructuredOutputBackend(vocabulary, work_budget=None)
    fresh = reference.compile(grammar(SMALL_TANGLED)).matcher()
    np.testing.assert_array_equal(resumed.allowed_tokens(), fresh.allowed_tokens())
    text = "ab;abc,b"
    for token_id in encode(text):
        assert resumed.accept_token(token_id) and fresh.accept_token(token_id)
        np.testing.assert_array_equal(resumed.allowed_tokens(), fresh.allowed_tokens())
    assert resumed.meter.used > 0 and resumed.meter.budget is None


def test_ordinary_constraints_use_a_small_part_of_the_default_budget(vocabulary, encode) -> None:
    backend = ChassisStructuredOutputBackend(vocabulary)
    assert backend.work_budget == DEFAULT_WORK_BUDGET
    matcher = backend.compile(StructuredOutputsParams(json_object=True)).matcher()
    text = '{"a": [1, {"b": null}], "c": "d"}'
    for token_id in encode(text):
        matcher.allowed_tokens()
        assert matcher.accept_token(token_id)
    assert 0 < matcher.meter.used < DEFAULT_WORK_BUDGET // 100


def test_the_budget_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(WORK_BUDGET_ENV, raising=False)
    assert work_budget_from_env() == DEFAULT_WORK_BUDGET
    monkeypatch.setenv(WORK_BUDGET_ENV, "1234")
    assert work_budget_from_env() == 1234
    monkeypatch.setenv(WORK_BUDGET_ENV, "0")
    assert work_budget_from_env() is None
    for bad in ("-1", "1e6", "lots"):
        monkeypatch.setenv(WORK_BUDGET_ENV, bad)
        with pytest.raises(ValueError, match=WORK_BUDGET_ENV):
            work_budget_from_env()


# -- in the engine: the request fails alone ------------------------------------------------


@pytest.fixture(scope="module")
def budget_llm(tiny_llama_dir):
    """An engine whose backend (built on the first constrained request) has a small budget."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(WORK_BUDGET_ENV, str(SMALL_BUDGET))
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=256)
        llm.engine.structured_outputs.backend  # noqa: B018 (built now, with the variable set)
    yield llm
    llm.shutdown()


FREE = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = ["Hello there", "The capital of France is"]


def test_a_request_over_budget_fails_alone_in_a_shared_batch(budget_llm: LLM) -> None:
    alone = [o.outputs[0].token_ids for o in budget_llm.generate(PROMPTS, FREE)]
    params = [
        FREE,
        SamplingParams(max_tokens=10, structured_outputs=grammar(TANGLED)),
        FREE,
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=grammar(LATE_TANGLED)),
    ]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    outputs = budget_llm.generate(prompts, params)
    for failed in (outputs[1].outputs[0], outputs[3].outputs[0]):
        assert failed.finish_reason == "abort"
        assert failed.error is not None and failed.error.client_error
        assert f"work budget of {SMALL_BUDGET}" in failed.error.message
    assert outputs[1].outputs[0].token_ids == []  # its first mask is over budget
    # the late one wrote (part of) its literal first
    assert "The answer follows in order".startswith(outputs[3].outputs[0].text)
    assert outputs[3].outputs[0].token_ids
    assert [outputs[0].outputs[0].token_ids, outputs[2].outputs[0].token_ids] == alone
    assert all(o.outputs[0].finish_reason == "length" for o in (outputs[0], outputs[2]))
    assert budget_llm.engine.structured_outputs.num_tracked == 0
    assert not budget_llm.engine.has_unfinished()


def test_a_backend_that_cannot_compile_is_the_engine_s_fault(
    budget_llm: LLM, tiny_llama_dir, monkeypatch, caplog
) -> None:
    """A constraint the backend refuses (``ValueError``) is the request's fault; a backend
    that cannot be built (a bad budget variable) or whose compile raises anything else is
    the engine's (HTTP 500), not the client's."""
    backend = budget_llm.engine.structured_outputs.backend

    def broken_compile(params: StructuredOutputsParams) -> None:
        raise RuntimeError("compiler bug")

    monkeypatch.setattr(backend, "compile", broken_compile)
    constrained = SamplingParams(max_tokens=5, structured_outputs=grammar("root ::= [a-z]{5}"))
    # the caller gets the type, the log the whole error (the engine core's log: the server's)
    unavailable = (
        "structured output: the engine cannot serve the constraint: {} in the engine core; "
        "its message and traceback are in the server log"
    )
    with caplog.at_level(logging.ERROR, logger="chassis.core"):
        [bug] = budget_llm.generate(["Hi"], constrained)[0].outputs
    assert bug.finish_reason == "abort" and bug.error is not None
    assert not bug.error.client_error
    assert bug.error.message == unavailable.format("RuntimeError")
    assert "RuntimeError: compiler bug" in caplog.text
    monkeypatch.undo()

    monkeypatch.setenv(WORK_BUDGET_ENV, "lots")
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=64)
    try:
        for _ in range(2):  # the failure is remembered
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="chassis.core"):
                [out] = llm.generate(["Hi"], constrained)[0].outputs
            assert out.finish_reason == "abort" and out.error is not None
            assert not out.error.client_error
            assert out.error.message == unavailable.format("ValueError")
            assert WORK_BUDGET_ENV in caplog.text
    finally:
        llm.shutdown()


def test_a_constraint_over_budget_is_remembered_and_refused_at_once(
    budget_llm: LLM, monkeypatch
) -> None:
    """A constraint whose first mask exceeded the budget is refused at once the next time,
    with the same error: nothing is compiled and no DFA state is built for it again. Another
    constraint, tangled or not, is unaffected."""
    manager = budget_llm.engine.structured_outputs
    backend = manager.backend
    # its own variants, so that no other test of the module has met them
    tangled = grammar(TANGLED.replace("{0,40}", "{0,39}"))
    other_tangled = grammar(TANGLED.replace("{0,40}", "{0,38}"))
    [first] = budget_llm.generate(["Hi"], SamplingParams(max_tokens=10, structured_outputs=tangled))
    assert first.outputs[0].finish_reason == "abort" and first.outputs[0].error is not None
    error = first.outputs[0].error
    assert error.client_error and f"work budget of {SMALL_BUDGET}" in error.message
    assert manager.is_over_budget(tangled.cache_key())
    automaton = backend.compile(tangled).automaton
    num_states = automaton.num_states

    compiled: list[tuple] = []
    real_compile = backend.compile

    def spy(params: StructuredOutputsParams):
        compiled.append(params.cache_key())
        return real_compile(params)

    monkeypatch.setattr(backend, "compile", spy)
    [again] = budget_llm.generate(
        ["Hello"], SamplingParams(max_tokens=10, structured_outputs=tangled)
    )
    assert again.outputs[0].finish_reason == "abort" and again.outputs[0].token_ids == []
    assert again.outputs[0].error == error  # the same message, the client's fault
    assert compiled == [] and automaton.num_states == num_states  # no work done again

    # another tangled constraint does its own work, and fails on its own budget
    [other] = budget_llm.generate(
        ["Hi"], SamplingParams(max_tokens=10, structured_outputs=other_tangled)
    )
    assert compiled == [other_tangled.cache_key()]
    assert other.outputs[0].error is not None and other.outputs[0].error.client_error
    # and a simple one is served as before
    simple = grammar("root ::= [a-z]{5}")
    [ok] = budget_llm.generate(["Hi"], SamplingParams(max_tokens=10, structured_outputs=simple))
    assert ok.outputs[0].error is None and re.fullmatch("[a-z]{5}", ok.outputs[0].text)
    assert compiled[-1] == simple.cache_key() and not manager.is_over_budget(simple.cache_key())


def test_a_budget_failure_after_the_first_token_is_not_remembered(budget_llm: LLM) -> None:
    """Where generation goes depends on what was sampled: a constraint that exceeded the
    budget only later in its output is tried again by the next request."""
    manager = budget_llm.engine.structured_outputs
    late = grammar(LATE_TANGLED.replace("{0,40}", "{0,37}"))
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=late)
    for _ in range(2):
        [out] = budget_llm.generate(["Hi"], params)[0].outputs
        assert out.finish_reason == "abort" and out.error is not None and out.token_ids
        assert not manager.is_over_budget(late.cache_key())


def test_the_memory_of_over_budget_constraints_is_bounded(vocabulary, monkeypatch) -> None:
    """The least recently used over-budget constraint is forgotten first (then compiled and
    charged again), as the backend's grammar cache forgets grammars."""
    from types import SimpleNamespace

    from chassis.core import structured_output_manager as som

    monkeypatch.setattr(som, "OVER_BUDGET_MEMORY_SIZE", 2)
    manager = som.StructuredOutputManager(None)  # type: ignore[arg-type]
    manager._backend = ChassisStructuredOutputBackend(vocabulary, work_budget=SMALL_BUDGET)
    variants = [grammar(TANGLED.replace("{0,40}", f"{{0,{n}}}")) for n in (30, 31, 32)]

    def run(params: StructuredOutputsParams, request_id: str) -> str:
        """Fail one request of ``params`` at its first mask, or at once; its error."""
        request = SimpleNamespace(
            request_id=request_id, sampling_params=SimpleNamespace(structured_outputs=params)
        )
        try:
            matcher = manager.matcher_for(request)  # type: ignore[arg-type]
        except ConstraintBudgetExceeded as exc:
            return f"at once: {exc}"
        assert matcher is not None
        manager.track(request_id, [], matcher, constraint_key=params.cache_key())
        plan = SimpleNamespace(num_scheduled_tokens={request_id: 1})
        assert manager.masks_for(plan) == {}  # type: ignore[arg-type]
        return f"after work: {manager.take_failures()[request_id].message}"

    errors = [run(params, f"r{i}") for i, params in enumerate(variants)]
    assert all(e.startswith("after work: structured output: ") for e in errors)
    remembered = [manager.is_over_budget(p.cache_key()) for p in variants]
    assert remembered == [False, True, True]  # the first was pushed out
    assert run(variants[1], "again") == errors[1].replace("after work: ", "at once: ")
    assert run(variants[0], "first again").startswith("after work: ")
    # variants[2] was the least recently used: the first one took its place
    assert [manager.is_over_budget(p.cache_key()) for p in variants] == [True, True, False]


class Failing(ChassisGrammarMatcher):
    """A real matcher that raises on its ``after``-th call of ``method``."""

    def __init__(self, inner: ChassisGrammarMatcher, method: str, after: int) -> None:
        self.__dict__.update(inner.__dict__)
        self.method, self.calls_left = method, after

    def _count(self, method: str) -> None:
        if method == self.method:
            self.calls_left -= 1
            if self.calls_left == 0:
                raise RuntimeError(f"boom in {method}")

    def allowed_tokens(self) -> np.ndarray:
        self._count("allowed_tokens")
        return super().allowed_tokens()

    def accept_token(self, token_id: int) -> bool:
        self._count("accept_token")
        return super().accept_token(token_id)


@pytest.mark.parametrize(
    ("method", "doing"),
    [("allowed_tokens", "computing its allowed tokens"), ("accept_token", "following its tokens")],
)
def test_a_matcher_that_raises_mid_generation_fails_only_its_request(
    budget_llm: LLM, method: str, doing: str
) -> None:
    core = budget_llm.engine
    alone = budget_llm.generate(PROMPTS[:1], FREE)[0].outputs[0].token_ids
    constrained = SamplingParams(
        temperature=1.0, seed=0, max_tokens=30, structured_outputs=grammar("root ::= [a-z]{30}")
    )
    [victim] = budget_llm.input_processor.process(PROMPTS[1], constrained, f"victim-{method}")
    [other] = budget_llm.input_processor.process(PROMPTS[0], FREE, f"other-{method}")
    core.add_request(victim)
    core.add_request(other)
    tracked = core.structured_outputs._requests[victim.request_id]
    tracked.matcher = Failing(tracked.matcher, method, after=3)
    outputs = []
    while core.has_unfinished():
        outputs += core.step().outputs
    victim_outputs = [o for o in outputs if o.request_id == victim.request_id]
    [last] = [o for o in victim_outputs if o.finished]
    assert last is victim_outputs[-1] and last.finish_reason == "abort"
    assert last.error is not None and not last.error.client_error
    # the type only (its message may hold internals: it is in the log, with the traceback)
    assert last.error.message == (
        f"structured output: {doing} failed: RuntimeError in the engine core; its message "
        "and traceback are in the server log"
    )
    assert 1 <= sum(len(o.new_token_ids) for o in victim_outputs) <= 3
    other_tokens = [t for o in outputs if o.request_id == other.request_id for t in o.new_token_ids]
    assert other_tokens == alone
    assert core.structured_outputs.num_tracked == 0
    # the engine keeps serving constrained requests (a failure that is not the budget's,
    # maybe transient, is not remembered)
    assert not core.structured_outputs.is_over_budget(grammar("root ::= [a-z]{30}").cache_key())
    [ok] = budget_llm.generate(["Hi"], constrained)
    assert ok.outputs[0].error is None and ok.outputs[0].finish_reason in ("stop", "length")
    assert re.fullmatch("[a-z]{1,30}", ok.outputs[0].text)


# -- through the server, to an OpenAI client -----------------------------------------------


@pytest.mark.timeout(300)
def test_the_error_reaches_an_openai_client(tiny_llama_dir, tmp_path, monkeypatch) -> None:
    import openai
    from server_process import running_server

    monkeypatch.setenv(WORK_BUDGET_ENV, str(SMALL_BUDGET))
    with running_server(tiny_llama_dir, tmp_path) as server:
        client = server.client()
        free: dict = {}

        def unconstrained() -> None:
            free["response"] = client.completions.create(
                model="tiny",
                prompt="Hello there",
                max_tokens=40,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )

        thread = threading.Thread(target=unconstrained)
        thread.start()
        # over budget at the first token: a 400 before any byte of a response
        with pytest.raises(openai.BadRequestError, match=f"work budget of {SMALL_BUDGET}") as err:
            client.completions.create(
                model="tiny",
                prompt="Hi",
                max_tokens=10,
                extra_body={"structured_outputs": {"grammar": TANGLED}},
            )
        assert err.value.code == "request_failed"
        # over budget after some tokens, streaming: an error event ends the stream
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=40,
            temperature=0.0,
            stream=True,
            extra_body={"structured_outputs": {"grammar": LATE_TANGLED}},
        )
        text = ""
        with pytest.raises(openai.APIError, match=f"work budget of {SMALL_BUDGET}"):
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
        assert text and "The answer follows in order".startswith(text)
        thread.join(timeout=120)
        response = free["response"]
        assert response.choices[0].finish_reason == "length"
        assert response.usage.completion_tokens == 40
        assert client.models.list().data  # still serving


def test_a_failed_request_is_a_400_or_a_500_with_the_engine_s_message() -> None:
    from chassis.core.errors import RequestFailedError
    from chassis.core.request import RequestError
    from chassis.serve.errors import stream_error_json, to_api_error

    for client_error, status in ((True, 400), (False, 500)):
        failure = RequestFailedError(RequestError(message="why", client_error=client_error))
        api_error = to_api_error(failure)
        assert (api_error.status, api_error.message, api_error.code) == (
            status,
            "why",
            "request_failed",
        )
        assert '"message": "why"' in stream_error_json(failure)
