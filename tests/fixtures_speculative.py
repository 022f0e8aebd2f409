"""Helpers shared by the speculative-decoding tests (n-gram and draft-model drafts)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from chassis import LLM, SamplingParams
from chassis.core.rejection_sampling import rejection_sample_reference
from chassis.core.request import EngineCoreRequest, SchedulerStats
from chassis.core.speculative import accepted_tokens


@contextmanager
def counting_steps(llm: LLM) -> Iterator[list[int]]:
    """A one-element list counting ``llm``'s engine steps inside the block (its ``step``
    is restored after)."""
    count = [0]
    step = llm.engine.step

    def counted():
        count[0] += 1
        return step()

    llm.engine.step = counted
    try:
        yield count
    finally:
        llm.engine.step = step


def sample_first_three(
    llm: LLM, prompt: str, params: SamplingParams
) -> tuple[Counter[tuple[int, ...]], SchedulerStats]:
    """How often each first three tokens come up in ``llm``'s samples of ``prompt`` (``n``
    of ``params``), and the scheduler's statistics after them; shuts ``llm`` down."""
    try:
        outputs = llm.generate([prompt], params)[0].outputs
        stats = llm.engine.scheduler.stats()
    finally:
        llm.shutdown()
    return Counter(tuple(c.token_ids[:3]) for c in outputs), stats


def abort_during_a_drafted_step(llm: LLM, params: SamplingParams) -> int:
    """Drive ``llm``'s engine core by hand with two requests ``"a"`` and ``"b"`` of one
    repetitive prompt, aborting ``"a"`` between the first plan that drafts for it and that
    plan's results; run until everything finishes. Asserts that ``"a"`` was aborted that
    way and that no output of it comes after; returns the tokens ``"b"`` received."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    for request_id in ("a", "b"):
        engine.add_request(
            EngineCoreRequest(
                request_id=request_id,
                prompt_token_ids=[11, 12, 13, 14] * 6,
                sampling_params=params,
            )
        )
    aborted = False
    num_b_tokens = 0
    while engine.has_unfinished() or scheduler.has_finished_requests():
        plan = scheduler.schedule()
        pending = engine.executor.execute_model_async(plan)
        if not aborted and "a" in plan.spec_token_ids:
            engine.abort_requests(["a"])
            aborted = True
        if not plan.is_empty:
            for output in scheduler.update_from_output(plan, pending.result()):
                assert output.request_id == "b" or not aborted
                num_b_tokens += len(output.new_token_ids) * (output.request_id == "b")
    assert aborted, "no plan drafted for request 'a'"
    return num_b_tokens


def assert_requests_equal_the_reference(
    tokens: list[int],
    target: torch.Tensor,
    draft: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    spans: list[tuple[int, int, list[int]]],
) -> None:
    """Each request's rows of a vectorized rejection step's ``tokens``, through the
    exact-match rule, give what the one-draft-at-a-time reference accepts on the same rows
    of ``target``/``draft`` probabilities, ``uniforms`` and ``noise``. ``spans`` holds each
    request's (first row, number of drafts, drafts)."""
    for start, d, drafts in spans:
        rows = slice(start, start + d + 1)
        want = rejection_sample_reference(
            target[rows], draft[start : start + d], drafts, uniforms[rows], noise[rows]
        )
        assert accepted_tokens(tokens[rows], drafts) == want
