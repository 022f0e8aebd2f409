"""Prompts given as input embeddings (``--enable-prompt-embeds``, core/prompt_embeds.py).

On a tiny random Llama (float32): the model's own token embeddings of a prompt give exactly
the tokens and logprobs of the token prompt, through chunked prefill, preemption and the
prefix cache (keyed by the rows); other rows give another answer; offline and served
(/v1/completions ``prompt_embeds``, base64 of a ``torch.save``'d tensor) alike; bad input
and input without the flag are refused with messages naming what is wrong.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from chassis import LLM, SamplingParams
from chassis.core.config import EngineConfig

TEXTS = [
    "The quick brown fox jumps over the lazy dog because",
    "Once upon a time, in a land far away, there lived",
    "def fibonacci(n):",
    "Paris is the capital of",
]
ENGINE = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 64}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_llama_dir: Path) -> dict[str, Any]:
    """The tiny Llama's folder, its HF embedding table, the prompts' ids and rows, and an
    engine with the flag on."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    table = hf.get_input_embeddings().weight.detach().clone()
    llm = LLM(str(tiny_llama_dir), enable_prompt_embeds=True, **ENGINE)
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer(text).input_ids for text in TEXTS]
    return {
        "dir": tiny_llama_dir,
        "llm": llm,
        "ids": ids,
        "rows": [table[torch.tensor(i)] for i in ids],
    }


class Close(float):
    """A logprob equal to another within float32 noise (batch shapes change sums' order)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, float) and abs(float(self) - other) < 1e-4

    __hash__ = float.__hash__


def summary(outputs: list[Any]) -> list[tuple[list[int], list[Any]]]:
    """Each output's tokens and its chosen tokens' logprobs (compared within 1e-4)."""
    result = []
    for out in outputs:
        completion = out.outputs[0]
        logprobs = [
            Close(step[token].logprob)
            for step, token in zip(completion.logprobs or [], completion.token_ids, strict=True)
        ]
        result.append((list(completion.token_ids), logprobs))
    return result


def token_prompts(setup: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"prompt_token_ids": ids} for ids in setup["ids"]]


def embeds_prompts(setup: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"prompt_embeds": rows} for rows in setup["rows"]]


def saved_b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_own_embeddings_give_the_token_prompts_answer(setup: dict[str, Any]) -> None:
    """The rows of ``embed_tokens(ids)`` answer as the ids, token for token and logprob for
    logprob, also batched with text prompts; the output reports placeholder ids (vLLM's
    zeros) and no prompt text; changed rows change the answer (not vacuous)."""
    llm = setup["llm"]
    expected = summary(llm.generate(token_prompts(setup), GREEDY))
    outputs = llm.generate(embeds_prompts(setup), GREEDY)
    assert summary(outputs) == expected
    assert outputs[0].prompt_token_ids == [0] * len(setup["ids"][0])
    assert outputs[0].prompt is None
    mixed = llm.generate([embeds_prompts(setup)[0], TEXTS[1], embeds_prompts(setup)[2]], GREEDY)
    assert summary(mixed) == [expected[0], expected[1], expected[2]]
    perturbed = setup["rows"][0].clone()
    perturbed[-1] += torch.randn(perturbed.shape[1], generator=torch.Generator().manual_seed(0))
    changed = summary(llm.generate({"prompt_embeds": perturbed}, GREEDY))[0]
    assert changed != expected[0]
    half = summary(llm.generate({"prompt_embeds": setup["rows"][0].half()}, GREEDY))[0]
    assert half[0] == expected[0][0]  # (float16 rows, cast to the model's dtype)
    # truncate_prompt_tokens keeps the last rows, as it keeps the last tokens
    cut = SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=5)
    kept = llm.generate({"prompt_embeds": setup["rows"][0]}, cut)[0]
    assert kept.prompt_token_ids == [0] * 5
    tail = llm.generate({"prompt_token_ids": setup["ids"][0][-5:]}, cut)[0]
    assert kept.outputs[0].token_ids == tail.outputs[0].token_ids


def test_chunked_prefill_and_preemption_keep_the_answer(setup: dict[str, Any]) -> None:
    """Small step budgets cut the prompts' rows across steps; a KV cache too small for every
    request preempts some, which then recompute their prompts from the rows."""
    expected = summary(setup["llm"].generate(token_prompts(setup), GREEDY))
    chunked = LLM(
        str(setup["dir"]), enable_prompt_embeds=True, **{**ENGINE, "max_num_batched_tokens": 5}
    )
    assert summary(chunked.generate(embeds_prompts(setup), GREEDY)) == expected
    long = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2, ignore_eos=True)
    expected_long = summary(setup["llm"].generate(token_prompts(setup), long))
    tight = LLM(
        str(setup["dir"]),
        enable_prompt_embeds=True,
        **{**ENGINE, "num_kv_blocks": 8, "max_num_batched_tokens": 16},
    )
    got = summary(tight.generate(embeds_prompts(setup), long))
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected_long


def test_penalties_see_no_prompt_tokens(setup: dict[str, Any]) -> None:
    """The placeholder ids are not the prompt's tokens: a repetition penalty that would
    crush token 0 were it in the prompt leaves it the first choice of a request given as
    embeddings (the same penalty does crush it for a token prompt holding a 0)."""
    llm, ids, rows = setup["llm"], setup["ids"][0], setup["rows"][0]
    params = SamplingParams(
        temperature=0.0, max_tokens=1, logit_bias={0: 50.0}, repetition_penalty=1e6
    )
    assert llm.generate({"prompt_embeds": rows}, params)[0].outputs[0].token_ids == [0]
    with_zero = llm.generate({"prompt_token_ids": [*ids, 0]}, params)[0]
    assert with_zero.outputs[0].token_ids != [0]


def test_prefix_cache_is_keyed_by_the_rows(setup: dict[str, Any]) -> None:
    """Equal leading rows hit the prefix cache (same answer); other rows and a token prompt
    of the placeholder ids do not reuse those blocks."""
    llm = LLM(str(setup["dir"]), enable_prompt_embeds=True, block_size=4, **ENGINE)
    rows = setup["rows"][0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = llm.generate({"prompt_embeds": rows}, params)[0]
    again = llm.generate({"prompt_embeds": rows}, params)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens >= 8
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    other = rows.clone()
    other[0] += 1.0  # the first block differs, so every block's key does
    assert llm.generate({"prompt_embeds": other}, params)[0].num_cached_tokens == 0
    zeros = {"prompt_token_ids": [0] * len(rows)}
    assert llm.generate(zeros, params)[0].num_cached_tokens == 0


def test_refusals(setup: dict[str, Any]) -> None:
    """Without the flag, and for rows of the wrong type, dtype, shape or values, too long a
    prompt, multimodal data, prompt logprobs or beam search: a ValueError naming it."""
    llm, rows = setup["llm"], setup["rows"][0]
    plain = LLM(str(setup["dir"]), **ENGINE)
    with pytest.raises(ValueError, match="--enable-prompt-embeds"):
        plain.generate({"prompt_embeds": rows}, GREEDY)
    nan = rows.clone()
    nan[0, 0] = float("nan")
    for value, match in (
        (rows.tolist(), "torch.Tensor"),
        (rows.to(torch.float64), "float64"),
        (rows[0], r"expected \[seq_len, 64\]"),
        (rows[:, :10], "hidden size 64"),
        (rows[:0], "no rows"),
        (nan, "non-finite"),
        (rows.repeat(20, 1), "maximum context length"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.generate({"prompt_embeds": value}, GREEDY)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt_embeds": rows, "multi_modal_data": {"image": []}}, GREEDY)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate({"prompt_embeds": rows}, SamplingParams(prompt_logprobs=1))
    from chassis.core.beam_search import BeamSearchParams

    with pytest.raises(ValueError, match="generate"):
        llm.beam_search([{"prompt_embeds": rows}], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(
            model="m",
            enable_prompt_embeds=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    # a batched [1, seq, hidden] tensor is taken as vLLM takes it
    assert summary(llm.generate({"prompt_embeds": rows[None]}, GREEDY)) == summary(
        llm.generate({"prompt_embeds": rows}, GREEDY)
    )


def test_models_that_cannot_take_rows_refuse_the_flag() -> None:
    """A model without ``embed_input_ids``, one whose forward takes no ``inputs_embeds``, and
    one whose class declares ``prompt_embeds_refusal`` (OPT's and GPT-2's decoders embed
    the tokens themselves) refuse ``--enable-prompt-embeds`` by name (the runner is built at
    start, so the engine does not start); one that scales its embeddings takes rows."""
    from chassis.builtin_plugins.models.gpt2 import GPT2LMHeadModel
    from chassis.builtin_plugins.models.opt import OPTForCausalLM
    from chassis.core.model_interface import CausalLM
    from chassis.core.prompt_embeds_runner import PromptEmbedsRunner, prompt_embeds_refusal

    class TextOnly(CausalLM):
        def forward(self, input_ids: Any, positions: Any, ctx: Any) -> Any:  # type: ignore[override]
            return input_ids

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return hidden_states

        def load_weights(self, weights: Any) -> set[str]:
            return set()

    class NoEmbedsForward(TextOnly):
        def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
            return input_ids

    class Takes(NoEmbedsForward):
        def forward(self, input_ids: Any, positions: Any, ctx: Any, inputs_embeds: Any = None):  # type: ignore[override]
            return input_ids

    class Declares(Takes):
        prompt_embeds_refusal = "its decoder embeds the tokens itself"

    assert prompt_embeds_refusal(Takes(None, None)) is None  # type: ignore[arg-type]
    for model, match in (
        (TextOnly(None, None), "does not implement embed_input_ids"),  # type: ignore[arg-type]
        (NoEmbedsForward(None, None), "forward takes no inputs_embeds"),  # type: ignore[arg-type]
        (Declares(None, None), "Declares: its decoder embeds the tokens itself"),  # type: ignore[arg-type]
    ):
        assert match in (prompt_embeds_refusal(model) or "")
        with pytest.raises(ValueError, match=r"--enable-prompt-embeds: .*start without the flag"):
            PromptEmbedsRunner(model, torch.device("cpu"))
    for cls in (OPTForCausalLM, GPT2LMHeadModel):
        assert cls.prompt_embeds_refusal


def test_the_runner_fills_the_hidden_columns_and_forgets_rows_once_computed() -> None:
    """Rows go in the first ``hidden`` columns of a model whose input rows are wider
    (Qwen3-VL's zero deepstack columns after them stay zero), at each request's flat offset,
    sliced by chunk; a request's rows are kept only until the step computing the last of
    them, so the runner is empty (and decode steps skip it) afterwards."""
    import numpy as np

    from chassis.core.model_interface import CausalLM
    from chassis.core.multimodal import MultiModalTensor
    from chassis.core.prompt_embeds_runner import PromptEmbedsRunner

    hidden, extra = 4, 8

    class Decoder(torch.nn.Module):
        embedding_multiplier = None

        def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
            return torch.zeros(len(input_ids), hidden)

        def forward(self, input_ids: Any, positions: Any, ctx: Any, inputs_embeds: Any = None):
            return inputs_embeds

    class Wide(CausalLM):
        def __init__(self) -> None:
            super().__init__(None, None)  # type: ignore[arg-type]
            self.model = Decoder()

        def forward(self, input_ids: Any, positions: Any, ctx: Any, inputs_embeds: Any = None):  # type: ignore[override]
            return inputs_embeds

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return hidden_states

        def load_weights(self, weights: Any) -> set[str]:
            return set()

        def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
            own = torch.full((len(input_ids), hidden), -1.0)
            return torch.cat([own, torch.zeros(len(input_ids), extra)], dim=-1)

    runner = PromptEmbedsRunner(Wide(), torch.device("cpu"))
    rows = torch.arange(5 * hidden, dtype=torch.float32).reshape(5, hidden)
    runner.add("a", MultiModalTensor.from_tensor(rows))
    runner.add("b", None)
    ids = torch.zeros(4, dtype=torch.long)
    # step 1: "a" computes positions 0..2 (flat 0..2), "b" decodes one token (flat 3)
    step = runner.apply(
        ["a", "b"], np.array([0, 7]), np.array([3, 1]), np.array([0, 3, 4]), ids, None
    )
    assert step is not None and step.shape == (4, hidden + extra)
    assert torch.equal(step[:3, :hidden], rows[:3])
    assert torch.equal(step[:3, hidden:], torch.zeros(3, extra))
    assert torch.equal(step[3, :hidden], torch.full((hidden,), -1.0))
    assert runner  # two rows still to compute
    # step 2: "b" first (flat 0), then "a"'s last two rows (flat 1..2)
    step = runner.apply(
        ["b", "a"], np.array([8, 3]), np.array([1, 2]), np.array([0, 1, 3]), ids[:3], None
    )
    assert step is not None and torch.equal(step[1:3, :hidden], rows[3:])
    assert not runner  # every row computed: forgotten
    decode = runner.apply(["a"], np.array([5]), np.array([1]), np.array([0, 1]), ids[:1], None)
    assert decode is None


def test_qwen3_vl_rows_give_the_token_prompts_answer(tmp_path: Path) -> None:
    """Qwen3-VL (M-RoPE, deepstack columns after the hidden ones): its own embedding rows
    of a text prompt give the token prompt's greedy tokens."""
    from fixtures_qwen3_vl import save_tiny_qwen3_vl
    from safetensors.torch import load_file

    model_dir = save_tiny_qwen3_vl(tmp_path / "qwen3_vl")
    weights = load_file(next(model_dir.glob("*.safetensors")))
    table = weights["model.language_model.embed_tokens.weight"]
    llm = LLM(str(model_dir), enable_prompt_embeds=True, **ENGINE)
    try:
        ids = llm.get_tokenizer()(TEXTS[3]).input_ids
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        expected = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
        got = llm.generate({"prompt_embeds": table[torch.tensor(ids)]}, params)[0]
        assert got.outputs[0].token_ids == expected
    finally:
        llm.shutdown()


def test_served_rows_are_checked_off_the_event_loop() -> None:
    """AsyncLLM runs the input processor on a prompt given as embeddings (every value
    checked, the rows copied to bytes: ~0.4 s for 8192 x 4096 float32 rows on a slow CPU)
    in a worker thread, not on the server's event loop."""
    import asyncio
    import threading

    from chassis.core.async_llm import AsyncLLM
    from chassis.core.prompt_embeds import EmbedsPrompt

    prompt = EmbedsPrompt(torch.zeros(2, 4))
    ran_on = asyncio.run(
        AsyncLLM._off_loop_when_slow(threading.get_ident, prompt, SamplingParams(), None)
    )
    assert ran_on != threading.get_ident()


def test_completions_route(setup: dict[str, Any]) -> None:
    """/v1/completions: ``prompt_embeds`` (one base64 payload or a list) answer as the token
    prompt, first in the batch and then ``prompt``'s; 400s naming the field for a bad
    payload, echo, a missing prompt, and everything on an engine without the flag."""
    from fastapi.testclient import TestClient

    from chassis.core.async_llm import AsyncLLM
    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    ids, rows = setup["ids"], setup["rows"]
    base = {"max_tokens": 6, "temperature": 0, "return_token_ids": True}
    expected = [
        summary(setup["llm"].generate({"prompt_token_ids": i}, GREEDY))[0][0][:6] for i in ids[:2]
    ]
    settings = ServerSettings(shutdown_engine_on_exit=False)
    for flag in (True, False):
        engine = AsyncLLM.from_engine_config(
            EngineConfig(model=str(setup["dir"]), enable_prompt_embeds=flag, **ENGINE)
        )
        try:
            with TestClient(build_app(engine, settings)) as client:

                def post(**fields: Any) -> Any:
                    return client.post("/v1/completions", json={**base, **fields})

                if not flag:
                    r = post(prompt_embeds=saved_b64(rows[0]))
                    assert r.status_code == 400
                    assert "--enable-prompt-embeds" in r.json()["error"]["message"]
                    continue
                r = post(prompt_embeds=saved_b64(rows[0]))
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert choice["token_ids"] == expected[0]
                assert r.json()["usage"]["prompt_tokens"] == len(ids[0])
                r = post(prompt_embeds=[saved_b64(rows[0])], prompt=TEXTS[1])
                assert r.status_code == 200, r.text
                got = sorted(r.json()["choices"], key=lambda c: c["index"])
                assert [c["token_ids"] for c in got] == expected
                for fields, match in (
                    ({"prompt_embeds": "@@"}, "base64"),
                    ({"prompt_embeds": saved_b64(rows[0][:, :3])}, "hidden size"),
                    ({"prompt_embeds": saved_b64(rows[0]), "echo": True}, "echo"),
                    ({"prompt_embeds": []}, "must not be empty"),
                    ({}, "prompt or prompt_embeds"),
                ):
                    r = post(**fields)
                    assert r.status_code == 400, (fields, r.text)
                    assert match in r.json()["error"]["message"], r.text
                    assert r.json()["error"]["param"] in ("prompt", "prompt_embeds"), r.text
        finally:
            engine.shutdown_sync()
