"""Logprobs of the sampled tokens and the top alternatives (also usable for prompt logprobs)."""

from __future__ import annotations

import torch

from chassis.core.sampler_interface import SampledLogprobs


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> SampledLogprobs:
    """Pick each row's logprob of ``token_ids[row]`` and its ``num_top`` best alternatives.

    :param logprobs: ``[num_rows, vocab]`` log-probabilities (``log_softmax`` of logits)
    :param token_ids: ``[num_rows]`` int64, the chosen token of each row
    :param num_top: how many top tokens to return per row (>= 0)
    :return: ``token_ids``/``logprobs`` of shape ``[num_rows, 1 + num_top]`` (the chosen
        token first, then the top tokens in descending order) and the chosen token's 1-based
        rank: the number of tokens at least as likely as it (ties count against it, as in
        vLLM).
    """
    chosen = token_ids.to(torch.int64).unsqueeze(1)
    chosen_logprobs = logprobs.gather(-1, chosen)
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return SampledLogprobs(
        token_ids=torch.cat([chosen, top_ids], dim=1),
        logprobs=torch.cat([chosen_logprobs, top_logprobs], dim=1),
        ranks=ranks,
    )
