"""``template_greedy``: always the most likely token, whatever the request asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chassis.core.sampler_interface import Sampler, SamplerOutput

if TYPE_CHECKING:
    import torch

    from chassis.core.sampling_metadata import SamplingMetadata


class TemplateGreedySampler(Sampler):
    """Pick ``argmax(logits)`` for every row, ignoring temperature, top-k/top-p, penalties.

    Selected with ``--sampler template_greedy``: a request sent with ``temperature=1.0``
    then decodes exactly as with ``temperature=0``. Logprobs are not supported.
    """

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Return the argmax of each row of ``logits`` (``[num_rows, vocab]``) as int64.

        :raises ValueError: a row asked for logprobs (``metadata.max_num_logprobs`` is set).
        """
        if metadata.max_num_logprobs is not None:
            raise ValueError(
                "the template_greedy sampler does not compute logprobs; drop 'logprobs' from "
                "the request or serve with --sampler default"
            )
        # argmax stays on the device; the caller copies the ids to the host.
        return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1))
