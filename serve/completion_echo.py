"""``echo`` in ``/v1/completions``: each choice starts with its prompt.

With ``logprobs``, the choice's logprobs start with the prompt's tokens too: the first has no
logprob (nothing comes before it: ``null``), each later one its logprob under the model and
its top alternatives. This is how evaluation harnesses score a text (lm-evaluation-harness's
``loglikelihood`` sends ``echo: true, logprobs: 1`` and reads the prompt's
``token_logprobs``). With ``max_tokens: 0`` the answer is the prompt alone: the engine still
makes one token (a request makes at least one), which :func:`without_generation` drops.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from chassis.serve.protocol import CompletionLogprobs, json_logprob

if TYPE_CHECKING:
    from chassis.core.outputs import PositionLogprobs, RequestOutput
    from chassis.serve.state import ServerState


def echo_text(state: ServerState, prompt: str | list[int]) -> str:
    """What ``echo`` puts before the completion: a text prompt as sent, a token-id prompt
    decoded (special tokens kept, as they are part of the prompt; empty without a
    tokenizer, like every text of such a server)."""
    if isinstance(prompt, str):
        return prompt
    tokenizer = state.engine.tokenizer
    return "" if tokenizer is None else tokenizer.decode(prompt, skip_special_tokens=False)


def echo_logprobs(
    state: ServerState,
    prompt_token_ids: list[int],
    prompt_logprobs: list[PositionLogprobs | None] | None,
    num_logprobs: int,
    *,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """The legacy logprobs of the prompt's tokens, text offsets from 0 (``as_ids``: tokens
    named ``"token_id:ID"``, ``--return-tokens-as-token-ids``).

    ``top_logprobs`` of a position holds its ``num_logprobs`` most likely tokens and the
    prompt's own token (so ``num_logprobs + 1`` entries when the prompt's token is not among
    them, as vLLM sends); the first position's is ``null``.
    """
    out = CompletionLogprobs()
    offset = 0
    for position, token_id in enumerate(prompt_token_ids):
        entries = None
        if prompt_logprobs is not None and position < len(prompt_logprobs):
            entries = prompt_logprobs[position]
        own = entries.get(token_id) if entries else None
        text = state.token_text(token_id, own.decoded_token if own else None, as_id=as_ids)
        out.tokens.append(text)
        out.token_logprobs.append(json_logprob(own.logprob) if own else None)
        if entries is None:
            out.top_logprobs.append(None)
        else:
            out.top_logprobs.append(
                {
                    state.token_text(tid, lp.decoded_token, as_id=as_ids): json_logprob(lp.logprob)
                    for tid, lp in _top(entries, token_id, num_logprobs).items()
                }
            )
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _top(entries: PositionLogprobs, token_id: int, k: int) -> PositionLogprobs:
    """A position's ``k`` most likely tokens and the prompt's own ``token_id``."""
    ranked = sorted(entries.items(), key=lambda kv: kv[1].rank)
    return {tid: lp for i, (tid, lp) in enumerate(ranked) if i < k or tid == token_id}


def with_prompt_logprobs_cut(output: RequestOutput, k: int) -> RequestOutput:
    """``output`` with each prompt position's logprobs cut to its ``k`` most likely tokens
    and the prompt's own. ``echo`` with ``logprobs`` has the engine compute as many
    alternatives as the larger of ``logprobs`` and ``prompt_logprobs``; vLLM's
    ``prompt_logprobs`` field still holds only what it asked for."""
    if output.prompt_logprobs is None:
        return output
    cut = [
        None if entries is None else _top(entries, token_id, k)
        for entries, token_id in zip(output.prompt_logprobs, output.prompt_token_ids, strict=False)
    ]
    return dataclasses.replace(output, prompt_logprobs=cut)


def without_generation(output: RequestOutput) -> RequestOutput:
    """``output`` with its completions emptied (``max_tokens: 0``): no text, tokens or
    logprobs, and ``length`` as the finish reason of a finished one (the output was cut at
    its limit, zero tokens)."""
    completions = [
        dataclasses.replace(
            c,
            text="",
            token_ids=[],
            logprobs=[] if c.logprobs is not None else None,
            cumulative_logprob=None,
            finish_reason="length" if c.finished else None,
            stop_reason=None,
        )
        for c in output.outputs
    ]
    return dataclasses.replace(output, outputs=completions)
