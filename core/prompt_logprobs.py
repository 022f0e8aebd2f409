"""Prompt logprobs: gathered chunk by chunk during prefill, emitted when the prompt is done."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from chassis.core.request import TokenLogprobs

if TYPE_CHECKING:
    from chassis.core.model_interface import CausalLM


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
            if end > start:
                first = int(query_start_loc[i])
                logits = model.compute_logits(hidden[first : first + end - start]).float()
                logprobs = torch.log_softmax(logits, dim=-1)
                targets = torch.tensor(prompt[start + 1 : end + 1], device=logprobs.device)
                target_lp = logprobs.gather(1, targets[:, None])
                ranks = (logprobs > target_lp).sum(-1) + 1
                k = pending.num_logprobs
                top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
                for j in range(end - start):
                    ids = [int(targets[j])] + (top_ids[j].tolist() if k else [])
                    lps = [float(target_lp[j, 0])] + (top_lp[j].tolist() if k else [])
                    pending.entries.append(TokenLogprobs(ids, lps, int(ranks[j])))
            if start + n >= len(prompt):
                done[request_id] = pending.entries
                del self.pending[request_id]
        return done
