"""Helpers shared by the speculative-decoding tests (n-gram and draft-model drafts)."""

from __future__ import annotations

from chassis import LLM, SamplingParams
from chassis.core.request import EngineCoreRequest


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
