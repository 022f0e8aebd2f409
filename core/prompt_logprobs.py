"""Prompt logprobs: gathered chunk by chunk during prefill, emitted when the prompt is done."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from chassis.core.request import TokenLogprobs

if TYPE_CHECKING:
    from chassis.core.model_interface import CausalLM


#: prompt positions whose full-vocabulary logprobs exist at once: a prefill chunk can be
#: thousands of tokens, and each position takes ~11 bytes per vocabulary entry here (logits,
#: their float32 copy, log-softmax, a comparison mask), which the KV sizing does not reserve
ROWS_PER_SLICE = 128


@dataclass
class _Pending:
    prompt_token_ids: list[int]
    num_logprobs: int
    entries: list[TokenLogprobs | None] = field(default_factory=lambda: [None])


class PromptLogprobsCollector:
    """Tracks requests that asked for ``prompt_logprobs`` until their prefill completes."""

    def __init__(self) -> None:
        self.pending: dict[str, _Pending] = {}

    def start(self, request_id: str, prompt_token_ids: list[int], num_logprobs: int) -> None:
        self.pending[request_id] = _Pending(list(prompt_token_ids), num_logprobs)

    def drop(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def collect(
        self,
        model: CausalLM,
        hidden: torch.Tensor,
        request_ids: list[str],
        starts: np.ndarray,
        num_scheduled: np.ndarray,
        query_start_loc: np.ndarray,
    ) -> dict[str, list[TokenLogprobs | None]]:
        """Add this step's prompt positions; return the requests whose prompt is complete.

        Position ``p`` of the prompt yields the logprob of prompt token ``p + 1``; the first
        prompt token has no logprob (``None``).
        """
        if not self.pending:
            return {}
        done: dict[str, list[TokenLogprobs | None]] = {}
        for i, request_id in enumerate(request_ids):
            pending = self.pending.get(request_id)
            if pending is None:
                continue
            prompt = pending.prompt_token_ids
            start, n = int(starts[i]), int(num_scheduled[i])
            end = min(start + n, len(prompt) - 1)
            first = int(query_start_loc[i])
            for lo in range(start, end, ROWS_PER_SLICE):
                hi = min(end, lo + ROWS_PER_SLICE)
                rows = hidden[first + lo - start : first + hi - start]
                pending.entries.extend(
                    _position_logprobs(model, rows, prompt[lo + 1 : hi + 1], pending.num_logprobs)
                )
            if start + n >= len(prompt):
                done[request_id] = pending.entries
                del self.pending[request_id]
        return done


def _position_logprobs(
    model: CausalLM, hidden: torch.Tensor, targets: list[int], num_logprobs: int
) -> list[TokenLogprobs]:
    """The logprob, rank and top ``num_logprobs`` of each target token, from the hidden
    states of the positions before them. Computed on the hidden states' device; the results
    come to the host in one copy per tensor (prefill only, so the wait is acceptable)."""
    logprobs = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)
    target_ids = torch.tensor(targets, dtype=torch.int64).to(logprobs.device, non_blocking=True)
    target_lp = logprobs.gather(1, target_ids[:, None])
    ranks = ((logprobs > target_lp).sum(-1) + 1).tolist()
    target_lp_host = target_lp[:, 0].tolist()
    if num_logprobs:
        top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)
        top_lp_host, top_ids_host = top_lp.tolist(), top_ids.tolist()
    out = []
    for j, token_id in enumerate(targets):
        ids, lps = [token_id], [target_lp_host[j]]
        if num_logprobs:
            ids += top_ids_host[j]
            lps += top_lp_host[j]
        out.append(TokenLogprobs(ids, lps, ranks[j]))
    return out
