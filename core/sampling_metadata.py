"""``SamplingMetadata``: the per-row sampling settings of one step, built by the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    """Settings for the rows that sample this step (row ``i`` = ``i``-th sampling request).

    Optional tensors are ``None`` when no row uses the feature, so the sampler skips it.
    """

    #: [num_rows] float32; 0 means greedy for that row
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    #: [num_rows] int64, 0 = off
    top_k: torch.Tensor | None = None
    #: [num_rows] float32, 1.0 = off
    top_p: torch.Tensor | None = None
    #: [num_rows] float32, 0.0 = off
    min_p: torch.Tensor | None = None
    #: row -> generator of a request with a seed (rows absent use the global RNG)
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    #: [num_rows] float32 each; None when every row has the neutral value
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    #: token histories, needed only when a penalty is set
    prompt_token_ids: list[list[int]] | None = None
    output_token_ids: list[list[int]] | None = None
    #: per row, token id -> additive bias (None for rows without)
    logit_bias: list[dict[int, float] | None] | None = None
    #: per row, token ids forbidden because the row has fewer than min_tokens outputs
    #: (its EOS and stop_token_ids); None when no row is under its minimum
    min_tokens_blocked: list[set[int] | None] | None = None
    #: largest ``logprobs`` asked by any row, None when no row asked
    max_num_logprobs: int | None = None

    @property
    def no_penalties(self) -> bool:
        return (
            self.repetition_penalty is None
            and self.presence_penalty is None
            and self.frequency_penalty is None
        )
