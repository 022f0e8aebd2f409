"""The front-end: tokenizer helpers, InputProcessor and OutputProcessor, on SmolLM2's tokenizer."""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from chassis.core.config import EngineConfig
from chassis.core.input_processor import InputProcessor
from chassis.core.output_processor import OutputProcessor
from chassis.core.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    merge_delta_outputs,
)
from chassis.core.request import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    TokenLogprobs,
)
from chassis.core.sampling_params import SamplingParams
from chassis.core.tokenizer import (
    apply_chat_template,
    eos_token_ids,
    load_chat_template,
    load_tokenizer,
)

EOS = 2  # <|im_end|>

# -- tokenizer helpers -------------------------------------------------------------------------


def test_load_tokenizer(smol_tokenizer_dir):
    tok = load_tokenizer(smol_tokenizer_dir)
    assert tok.is_fast and len(tok) == 49152
    with pytest.raises(ValueError, match="could not load a tokenizer"):
        load_tokenizer(smol_tokenizer_dir / "missing")


def test_eos_token_ids(smol_tokenizer, tmp_path):
    assert eos_token_ids(smol_tokenizer) == [EOS]
    assert eos_token_ids(smol_tokenizer, tmp_path) == [EOS]  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert eos_token_ids(smol_tokenizer, tmp_path) == [2, 0]
    cfg = tmp_path / "other.json"
    cfg.write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(smol_tokenizer, cfg) == [2, 7]


def test_chat_template_smollm2(smol_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    assert apply_chat_template(smol_tokenizer, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>user\nAnd of Italy?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # without a system message SmolLM2's template adds its default one
    text = apply_chat_template(
        smol_tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_chat_template_override_and_missing(smol_tokenizer, tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    messages = [{"role": "user", "content": "Hi"}]
    assert apply_chat_template(smol_tokenizer, messages, chat_template=template) == "[user] Hi\n"
    original = smol_tokenizer.chat_template
    smol_tokenizer.chat_template = None
    try:
        with pytest.raises(ValueError, match="no chat template"):
            apply_chat_template(smol_tokenizer, messages)
        assert apply_chat_template(smol_tokenizer, messages, chat_template=template)
    finally:
        smol_tokenizer.chat_template = original


def test_load_chat_template(tmp_path):
    assert load_chat_template(None) is None
    inline = "{{ messages[0]['content'] }}"
    assert load_chat_template(inline) == inline
    path = tmp_path / "t.jinja"
    path.write_text(inline)
    assert load_chat_template(str(path)) == inline
    with pytest.raises(ValueError, match="neither an existing file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


# -- InputProcessor ----------------------------------------------------------------------------


@pytest.fixture
def processor(smol_tokenizer):
    return InputProcessor(
        smol_tokenizer, EngineConfig(max_model_len=64, max_logprobs=5, scheduler="priority"), [EOS]
    )


def test_process_text_prompt(processor, smol_tokenizer):
    (req,) = processor.process("Hello world", SamplingParams(max_tokens=8), "r1", priority=3)
    assert req.request_id == "r1"
    assert req.prompt_token_ids == smol_tokenizer("Hello world").input_ids
    assert req.eos_token_ids == [EOS]
    assert req.priority == 3 and req.arrival_time > 0
    assert req.sampling_params.max_tokens == 8
    # token-id prompts pass through; the request survives the wire format
    (req2,) = processor.process([1, 2, 3], SamplingParams(), "r2", arrival_time=5.0)
    assert req2.prompt_token_ids == [1, 2, 3] and req2.arrival_time == 5.0
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=type(req))
    assert wire == req


def test_fan_out_n(processor):
    reqs = processor.process("Hi", SamplingParams(n=3, seed=7, temperature=0.8), "abc")
    assert [r.request_id for r in reqs] == ["0_abc", "1_abc", "2_abc"]
    assert [r.sampling_params.seed for r in reqs] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 for r in reqs)
    assert all(r.sampling_params.temperature == 0.8 for r in reqs)
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 1
    assert len({r.arrival_time for r in reqs}) == 1
    unseeded = processor.process("Hi", SamplingParams(n=2), "x")
    assert [r.sampling_params.seed for r in unseeded] == [None, None]
    (single,) = processor.process("Hi", SamplingParams(n=1, seed=7), "same")
    assert single.request_id == "same" and single.sampling_params.seed == 7


def test_max_tokens_defaults_to_the_rest_of_the_context(processor):
    (req,) = processor.process(list(range(10, 20)), SamplingParams(max_tokens=None), "r")
    assert req.sampling_params.max_tokens == 64 - 10


def test_truncate_prompt_tokens_keeps_the_last_tokens(processor):
    prompt = list(range(100, 200))  # longer than the context (64)
    (req,) = processor.process(prompt, SamplingParams(max_tokens=4, truncate_prompt_tokens=10), "r")
    assert req.prompt_token_ids == prompt[-10:]
    (fit,) = processor.process(prompt, SamplingParams(max_tokens=4, truncate_prompt_tokens=60), "f")
    assert fit.prompt_token_ids == prompt[-60:]  # the most that leaves room for the 4 tokens
    (short,) = processor.process([5, 6], SamplingParams(truncate_prompt_tokens=10), "s")
    assert short.prompt_token_ids == [5, 6]
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_truncate_prompt_tokens_follows_vllm_rules(processor):
    """vLLM's rules: -1 keeps the last max_model_len tokens (not "what leaves room for
    max_tokens"), and a value above max_model_len is refused whatever the prompt's length."""
    prompt = list(range(100, 200))
    # -1 on a prompt that fits: nothing cut, max_tokens defaults to the rest of the context
    (whole,) = processor.process(
        prompt[:50], SamplingParams(max_tokens=None, truncate_prompt_tokens=-1), "w"
    )
    assert whole.prompt_token_ids == prompt[:50] and whole.sampling_params.max_tokens == 14
    # -1 on a longer prompt keeps 64 tokens: no room for a completion, and the 400 says
    # which value would leave room
    for max_tokens, limit in ((4, 60), (None, 63)):
        params = SamplingParams(max_tokens=max_tokens, truncate_prompt_tokens=-1)
        with pytest.raises(ValueError, match=rf"keeps 64 prompt tokens.*at most {limit} "):
            processor.process(prompt, params, "x")
    with pytest.raises(ValueError, match=r"keeps 64 prompt tokens.*reduce max_tokens\.$"):
        processor.process(prompt, SamplingParams(max_tokens=64, truncate_prompt_tokens=64), "x")
    # above max_model_len: vLLM's message, also for a prompt shorter than the value
    for tokens in ([5, 6], prompt):
        with pytest.raises(
            ValueError,
            match=r"^truncate_prompt_tokens value \(65\) is greater than max_model_len \(64\)\. "
            r"Please, select a smaller truncation size\.$",
        ):
            processor.process(tokens, SamplingParams(max_tokens=1, truncate_prompt_tokens=65), "x")
    (edge,) = processor.process(
        [5, 6], SamplingParams(max_tokens=1, truncate_prompt_tokens=64), "e"
    )
    assert edge.prompt_token_ids == [5, 6]  # max_model_len itself is allowed


def test_bad_words_are_tokenized_alone_and_after_a_space(processor, smol_tokenizer):
    (req,) = processor.process("Hi", SamplingParams(bad_words=[" Paris "]), "r")
    encode = smol_tokenizer.encode
    expected = [
        encode("Paris", add_special_tokens=False),
        encode(" Paris", add_special_tokens=False),
    ]
    assert req.sampling_params.bad_words_token_ids == expected
    assert expected[0] != expected[1]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        processor.process("Hi", SamplingParams(allowed_token_ids=[1, 10**6]), "r")


def test_context_length_errors(processor):
    with pytest.raises(ValueError) as e:
        processor.process(list(range(100, 160)), SamplingParams(max_tokens=10), "r")
    assert str(e.value).startswith(
        "This model's maximum context length is 64 tokens. However, you requested 70 tokens "
        "(60 in the messages, 10 in the completion)."
    )
    processor.process(list(range(100, 160)), SamplingParams(max_tokens=4), "ok")  # exactly 64
    with pytest.raises(ValueError, match=r"maximum context length is 64 tokens.*64 tokens"):
        processor.process(list(range(100, 164)), SamplingParams(max_tokens=None), "r")


def test_invalid_prompts_and_params(processor):
    with pytest.raises(ValueError, match="prompt is empty"):
        processor.process("", SamplingParams(), "r")
    with pytest.raises(ValueError, match="prompt is empty"):
        processor.process([], SamplingParams(), "r")
    with pytest.raises(ValueError, match=r"out of the vocabulary \[0, 49152\): \[49152, -1\]"):
        processor.process([5, 49152, -1], SamplingParams(), "r")
    with pytest.raises(ValueError, match="logprobs=6 exceeds the server's limit of 5"):
        processor.process("Hi", SamplingParams(logprobs=6), "r")
    with pytest.raises(ValueError, match="prompt_logprobs=9 exceeds"):
        processor.process("Hi", SamplingParams(prompt_logprobs=9), "r")
    with pytest.raises(ValueError, match="stop_token_ids has token ids out of the vocabulary"):
        processor.process("Hi", SamplingParams(stop_token_ids=[10**6]), "r")
    with pytest.raises(ValueError, match="max_model_len"):
        InputProcessor(processor.tokenizer, EngineConfig(), [EOS])
    with pytest.raises(ValueError, match="priority must be a 64-bit integer"):
        processor.process("Hi", SamplingParams(), "r", priority=2**63)
    # token ids are integers: 1.5 is not silently token 1
    with pytest.raises(ValueError, match=r"prompt token ids must be integers; got \[1.5, True\]"):
        processor.process([5, 1.5, True], SamplingParams(), "r")


def test_a_priority_needs_a_scheduler_that_uses_it(smol_tokenizer):
    fcfs = InputProcessor(smol_tokenizer, EngineConfig(max_model_len=64), [EOS])
    fcfs.process("Hi", SamplingParams(), "r", priority=0)  # the default: fine
    with pytest.raises(ValueError, match=r"'fcfs' scheduler ignores priorities"):
        fcfs.process("Hi", SamplingParams(), "r", priority=3)
    by_priority = InputProcessor(
        smol_tokenizer, EngineConfig(max_model_len=64, scheduler="priority"), [EOS]
    )
    assert by_priority.process("Hi", SamplingParams(), "r", priority=3)[0].priority == 3


def test_sampling_params_types_and_vllm_nones() -> None:
    import numpy as np

    assert SamplingParams(stop=None, stop_token_ids=None).stop == []  # vLLM's Optional fields
    params = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5))
    assert type(params.max_tokens) is int and type(params.temperature) is float
    assert SamplingParams(stop_token_ids=[np.int64(3)]).stop_token_ids == [3]
    for field, value in (
        ("temperature", "0.5"),
        ("n", 1.5),
        ("top_k", True),
        ("stop_token_ids", [1.5]),
        ("stop_token_ids", [True]),
        ("stop", [1]),
    ):
        with pytest.raises(ValueError, match=f"invalid sampling parameter {field}: must be"):
            SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 1025),  # each completion is an engine request created at once
        ("n", 10**12),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("repetition_penalty", float("nan")),
        ("top_k", 2**63),  # past msgpack's int64: the engine core could not receive it
        ("max_tokens", 2**64),
        ("min_tokens", 2**63),
        ("stop_token_ids", [2**64]),
        ("logit_bias", {5: float("nan")}),
    ],
)
def test_sampling_params_refuse_values_the_engine_cannot_take(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"invalid sampling parameter {field}"):
        SamplingParams(**{field: value})


def test_sampling_params_limits_are_inclusive() -> None:
    assert SamplingParams(n=1024).n == 1024
    assert SamplingParams(top_k=2**63 - 1, max_tokens=2**63 - 1).top_k == 2**63 - 1


# -- OutputProcessor ---------------------------------------------------------------------------


def step(*outputs: EngineCoreOutput) -> EngineCoreOutputs:
    """One engine step's outputs, sent through msgpack like the real ZMQ path."""
    msg = EngineCoreOutputs(outputs=list(outputs), timestamp=time.time())
    return msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=EngineCoreOutputs)


def out(rid: str, ids: list[int], finish: FinishReason | None = None, **kw) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=rid, new_token_ids=ids, finish_reason=finish, **kw)


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def test_delta_mode_single_completion(smol_tokenizer):
    tok = smol_tokenizer
    proc = OutputProcessor(tok)
    text = "Hello 世界 😀, it works."
    gen = ids_of(tok, text)
    t0 = time.time()
    proc.add_request("r", "prompt", [1, 2, 3], SamplingParams(), ["r"], t0, delta=True)
    assert proc.has_unfinished()
    texts, token_ids = [], []
    for i, token_id in enumerate(gen):
        last = i == len(gen) - 1
        result = proc.process_outputs(
            step(out("r", [token_id], FinishReason.LENGTH if last else None))
        )
        (ro,) = result.request_outputs
        assert result.request_ids_to_abort == []
        assert ro.request_id == "r" and ro.prompt == "prompt" and ro.prompt_token_ids == [1, 2, 3]
        assert ro.finished == last
        (co,) = ro.outputs
        assert co.token_ids == [token_id]
        texts.append(co.text)
        token_ids += co.token_ids
    assert "".join(texts) == text and token_ids == gen
    assert co.finish_reason == "length" and co.stop_reason is None
    m = ro.metrics
    assert m.arrival_time == t0 <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.num_generation_tokens == len(gen)
    assert not proc.has_unfinished()
    # late outputs for a finished request are ignored
    assert proc.process_outputs(step(out("r", [5]))).request_outputs == []


def test_delta_mode_n2_only_indexes_with_progress(smol_tokenizer):
    tok = smol_tokenizer
    proc = OutputProcessor(tok)
    proc.add_request("p", None, [1], SamplingParams(n=2), ["0_p", "1_p"], None, delta=True)
    a, b = ids_of(tok, " alpha beta"), ids_of(tok, " gamma")
    (ro,) = proc.process_outputs(step(out("0_p", a[:1]))).request_outputs
    assert [c.index for c in ro.outputs] == [0] and not ro.finished
    (ro,) = proc.process_outputs(step(out("1_p", b[:1]), out("0_p", a[1:]))).request_outputs
    assert [c.index for c in ro.outputs] == [0, 1]
    (ro,) = proc.process_outputs(step(out("0_p", [EOS], FinishReason.STOP))).request_outputs
    (c0,) = ro.outputs
    assert c0.index == 0 and c0.finish_reason == "stop" and c0.stop_reason is None
    assert c0.token_ids == [EOS] and c0.text == "" and not ro.finished
    (ro,) = proc.process_outputs(
        step(out("1_p", [*b[1:], 99], FinishReason.STOP, stop_reason=99))
    ).request_outputs
    (c1,) = ro.outputs
    assert c1.index == 1 and c1.stop_reason == 99 and ro.finished
    assert ro.metrics.num_generation_tokens == len(a) + 1 + len(b) + 1
    assert not proc.has_unfinished()


def test_cumulative_mode_reports_all_completions(smol_tokenizer):
    tok = smol_tokenizer
    proc = OutputProcessor(tok)
    proc.add_request("p", "x", [1], SamplingParams(n=2), ["0_p", "1_p"], None, delta=False)
    a, b = ids_of(tok, "The capital of France"), ids_of(tok, "Paris is nice")
    (ro,) = proc.process_outputs(step(out("0_p", a[:2]))).request_outputs
    assert [(c.index, c.text, c.token_ids) for c in ro.outputs] == [
        (0, tok.decode(a[:2]), a[:2]),
        (1, "", []),
    ]
    proc.process_outputs(step(out("0_p", a[2:], FinishReason.LENGTH), out("1_p", b[:1])))
    (ro,) = proc.process_outputs(step(out("1_p", b[1:], FinishReason.LENGTH))).request_outputs
    assert ro.finished
    assert [(c.text, c.token_ids, c.finish_reason) for c in ro.outputs] == [
        ("The capital of France", a, "length"),
        ("Paris is nice", b, "length"),
    ]


def test_final_only_mode_yields_once_when_every_completion_finished(smol_tokenizer):
    """What the offline LLM asks for: no per-step outputs, then the cumulative final state
    (stop strings still end a child and ask the engine to abort it)."""
    tok = smol_tokenizer
    proc = OutputProcessor(tok)
    params = SamplingParams(n=2, stop=["is Par"])
    proc.add_request("p", "x", [1], params, ["0_p", "1_p"], None, False, final_only=True)
    a = ids_of(tok, "The capital of France is Paris.")
    b = ids_of(tok, "Paris is nice. ") * len(a)  # never contains the stop string
    aborted = []
    for token_id, other in zip(a, b, strict=False):
        result = proc.process_outputs(step(out("0_p", [token_id]), out("1_p", [other])))
        assert result.request_outputs == []
        aborted += result.request_ids_to_abort
    assert aborted == ["0_p"] and proc.has_unfinished()
    (ro,) = proc.process_outputs(step(out("1_p", [EOS], FinishReason.STOP))).request_outputs
    assert ro.finished and not proc.has_unfinished()
    c0, c1 = ro.outputs
    assert (c0.text, c0.finish_reason, c0.stop_reason) == (
        "The capital of France ",
        "stop",
        "is Par",
    )
    assert c1.token_ids[-1] == EOS and c1.finish_reason == "stop" and c1.text.startswith("Paris")
    assert ro.metrics.num_generation_tokens == len(c0.token_ids) + len(c1.token_ids)
    with pytest.raises(ValueError, match="final_only"):
        proc.add_request("q", None, [1], SamplingParams(), ["q"], None, True, final_only=True)


@pytest.mark.parametrize("delta", [True, False])
def test_stop_string_finishes_child_and_asks_for_abort(smol_tokenizer, delta):
    tok = smol_tokenizer
    proc = OutputProcessor(tok)
    params = SamplingParams(n=2, stop=["is Par"])
    proc.add_request("p", None, [1], params, ["0_p", "1_p"], None, delta=delta)
    gen = ids_of(tok, "The capital of France is Paris. It is big.")
    streamed, aborted = "", []
    for token_id in gen:
        result = proc.process_outputs(step(out("0_p", [token_id])))
        aborted += result.request_ids_to_abort
        for ro in result.request_outputs:
            (co,) = [c for c in ro.outputs if c.index == 0]
            streamed = streamed + co.text if delta else co.text
            assert "The capital of France ".startswith(streamed)
    assert aborted == ["0_p"]
    assert streamed == "The capital of France "
    assert co.finish_reason == "stop" and co.stop_reason == "is Par"
    # the sibling still runs; the parent finishes with it
    assert proc.has_unfinished()
    (ro,) = proc.process_outputs(step(out("1_p", gen[:3], FinishReason.LENGTH))).request_outputs
    assert ro.finished and not proc.has_unfinished()
    if not delta:
        assert ro.outputs[0].text == "The capital of France "
        assert ro.outputs[0].token_ids == gen[: len(ro.outputs[0].token_ids)]


def test_stop_string_when_engine_also_finished_needs_no_abort(smol_tokenizer):
    tok = smol_tokenizer
    proc = OutputProcessor(tok)
    proc.add_request("r", None, [1], SamplingParams(stop=["France"]), ["r"], None, delta=False)
    gen = ids_of(tok, "The capital of France is Paris.")
    result = proc.process_outputs(step(out("r", gen, FinishReason.LENGTH)))
    assert result.request_ids_to_abort == []
    (co,) = result.request_outputs[0].outputs
    assert (co.text, co.finish_reason, co.stop_reason) == ("The capital of ", "stop", "France")
    assert co.token_ids == ids_of(tok, "The capital of France")


def test_logprobs_conversion(smol_tokenizer):
    tok = smol_tokenizer
    proc = OutputProcessor(tok)
    hello, world = ids_of(tok, "Hello world")
    params = SamplingParams(logprobs=2, prompt_logprobs=1)
    proc.add_request("r", None, [1, hello], params, ["r"], None, delta=True)
    first = out(
        "r",
        [hello],
        new_logprobs=[TokenLogprobs([hello, world, hello], [-0.5, -0.25, -0.5], 2)],
        prompt_logprobs=[None, TokenLogprobs([hello, world], [-3.0, -1.0], 4)],
        num_cached_tokens=16,
    )
    (ro,) = proc.process_outputs(step(first)).request_outputs
    (co,) = ro.outputs
    assert ro.num_cached_tokens == 16
    (pos,) = co.logprobs
    assert list(pos) == [hello, world]  # chosen first, no duplicate entry
    assert (pos[hello].logprob, pos[hello].rank, pos[hello].decoded_token) == (-0.5, 2, "Hello")
    assert (pos[world].logprob, pos[world].rank, pos[world].decoded_token) == (-0.25, 1, " world")
    assert co.cumulative_logprob == -0.5
    assert ro.prompt_logprobs[0] is None
    assert ro.prompt_logprobs[1][hello].rank == 4 and ro.prompt_logprobs[1][world].rank == 1
    second = out(
        "r",
        [world],
        FinishReason.LENGTH,
        new_logprobs=[TokenLogprobs([world, hello, EOS], [-0.75, -0.5, -2.0], 2)],
    )
    (ro,) = proc.process_outputs(step(second)).request_outputs
    (co,) = ro.outputs
    assert ro.prompt_logprobs is None  # delta mode sends them once
    assert co.cumulative_logprob == -1.25
    assert [list(p) for p in co.logprobs] == [[world, hello, EOS]]
    assert co.logprobs[0][EOS].decoded_token == "<|im_end|>"
    # without logprobs requested there are none
    proc.add_request("q", None, [1], SamplingParams(), ["q"], None, delta=True)
    (ro,) = proc.process_outputs(step(out("q", [hello]))).request_outputs
    assert ro.outputs[0].logprobs is None and ro.outputs[0].cumulative_logprob is None


def test_abort_and_fail_all(smol_tokenizer):
    proc = OutputProcessor(smol_tokenizer)
    proc.add_request("a", None, [1], SamplingParams(n=2), ["0_a", "1_a"], None, delta=True)
    proc.add_request("b", None, [1], SamplingParams(), ["b"], None, delta=True)
    with pytest.raises(ValueError, match="already running"):
        proc.add_request("b", None, [1], SamplingParams(), ["b"], None, delta=True)
    proc.process_outputs(step(out("0_a", [5], FinishReason.LENGTH)))
    assert proc.abort_request("a") == ["1_a"]
    assert proc.abort_request("a") == []
    assert proc.process_outputs(step(out("1_a", [5]))).request_outputs == []
    assert proc.num_unfinished == 1
    assert proc.fail_all(RuntimeError("engine died")) == ["b"]
    assert not proc.has_unfinished()


def test_first_scheduled_time_is_kept_from_the_first_output(smol_tokenizer):
    proc = OutputProcessor(smol_tokenizer)
    proc.add_request("r", None, [1, 2], SamplingParams(), ["r"], 100.0, delta=True)
    (first,) = proc.process_outputs(
        step(out("r", [5], first_scheduled_time=100.25))
    ).request_outputs
    assert first.metrics.first_scheduled_time == 100.25
    (last,) = proc.process_outputs(
        step(out("r", [6], FinishReason.LENGTH, first_scheduled_time=999.0))
    ).request_outputs
    assert last.metrics.first_scheduled_time == 100.25


def test_merge_delta_outputs_concatenates_per_completion():
    def lp(token_id):
        return {token_id: Logprob(-0.5, 1)}

    prompt_logprobs = [None, lp(7)]
    earlier = RequestOutput(
        "r",
        "p",
        [1, 7],
        [CompletionOutput(0, "Hel", [5], -0.5, [lp(5)])],
        False,
        prompt_logprobs=prompt_logprobs,
        metrics=RequestMetrics(arrival_time=1.0),
    )
    later = RequestOutput(
        "r",
        "p",
        [1, 7],
        [
            CompletionOutput(0, "lo", [6], -1.0, [lp(6)], "length"),
            CompletionOutput(1, "Hi", [8], -0.5, [lp(8)]),
        ],
        False,
        metrics=RequestMetrics(arrival_time=1.0, num_generation_tokens=3),
    )
    merged = merge_delta_outputs(earlier, later)
    c0, c1 = merged.outputs
    assert (c0.text, c0.token_ids, c0.cumulative_logprob, c0.finish_reason) == (
        "Hello",
        [5, 6],
        -1.0,
        "length",
    )
    assert c0.logprobs == [lp(5), lp(6)] and c1 == later.outputs[1]
    assert merged.prompt_logprobs is prompt_logprobs
    assert merged.metrics.num_generation_tokens == 3 and not merged.finished
    assert earlier.outputs[0].token_ids == [5]  # inputs are not modified
