"""What the speculative-decoding test modules share: their prompts, an engine with a draft
head, a recorder of the proposals a drafter makes, and greedy generation's token ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chassis import LLM, SamplingParams

#: prompts of different lengths (a few tokens to a few dozen), some repeating themselves
PROMPTS = [
    "Hello there",
    "one two three four one two three four one two three",
    "The capital of France is",
    "Write a long story about a dragon who learns to bake bread in a small village by the "
    "sea, and the friends she makes along the way.",
]

#: the small engine every speculative test runs: float32, short context, small blocks
ENGINE = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 128, "block_size": 4}


def head_llm(model_dir: Path, method: str, head: Path | None, k: int, **engine: Any) -> LLM:
    """An offline engine over ``model_dir`` drafting ``k`` tokens with the ``method`` head
    at ``head`` (none: plain decoding); ``engine`` overrides :data:`ENGINE`."""
    settings: dict[str, Any] = dict(ENGINE)
    if head is not None:
        settings["speculative_config"] = {
            "method": method,
            "model": str(head),
            "num_speculative_tokens": k,
        }
    return LLM(str(model_dir), **{**settings, **engine})


def record_proposals(drafter: Any) -> list[tuple[list[int], list[int]]]:
    """Wrap ``drafter.propose`` to record each proposal: the request's tokens up to its
    newest one, and the drafts proposed after them."""
    propose = drafter.propose
    seen: list[tuple[list[int], list[int]]] = []

    def recording(batch, rows, *args):
        proposals = propose(batch, rows, *args)
        for request_id, drafts in proposals.items():
            r = batch.row_of[request_id]
            newest = int(batch.num_computed_tokens[r])
            seen.append((batch.token_ids[r, : newest + 1].tolist(), drafts))
        return proposals

    drafter.propose = recording
    return seen


def greedy(max_tokens: int = 24) -> SamplingParams:
    """Greedy sampling of ``max_tokens`` tokens, EOS ignored."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(llm: LLM, params: SamplingParams) -> list[list[int]]:
    """The token ids ``llm`` generates for :data:`PROMPTS` under ``params``."""
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
