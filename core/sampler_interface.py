"""The sampler interface: logits of the rows that sample this step -> token ids (+ logprobs)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.sampling_metadata import SamplingMetadata


@dataclass
class SampledLogprobs:
    """Logprobs of the sampled tokens and the top-k alternatives, per row."""

    #: [num_rows, 1 + max_num_logprobs] int64: the sampled id, then the top-k ids
    token_ids: torch.Tensor
    #: [num_rows, 1 + max_num_logprobs] float32, matching ``token_ids``
    logprobs: torch.Tensor
    #: [num_rows] int64, 1-based rank of the sampled token
    ranks: torch.Tensor


@dataclass
class SamplerOutput:
    #: [num_rows] int64
    sampled_token_ids: torch.Tensor
    #: present when any row asked for logprobs
    logprobs: SampledLogprobs | None = None


class Sampler(ABC):
    """Chooses the next token of every row. Register with ``chassis_register_samplers``.

    Must not synchronize the device with the host beyond what producing the ids requires;
    the caller copies the ids to the host. ``metadata.output_token_ids`` (present when a row
    has a penalty) is complete also under async scheduling: the runner waits for tokens still
    in flight before it builds the metadata of such rows.
    """

    #: whether the sampler runs ``metadata.logits_processors`` (custom logits processors,
    #: ``--logits-processors``) at the points docs/sampling.md names; an engine with
    #: processors refuses a sampler without it
    supports_logits_processors: ClassVar[bool] = False
    #: whether :meth:`probabilities` is implemented; draft-model speculative decoding then
    #: samples probabilistic drafts for random rows and verifies them by rejection
    #: sampling, else (the default, so older plugins keep working) it proposes greedy
    #: drafts and verifies them by exact match (docs/scheduling.md, "Draft-model drafts")
    provides_probabilities: ClassVar[bool] = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        :param logits: ``[num_rows, vocab_size]`` float32 (may be modified in place)
        :param metadata: per-row sampling settings and token histories
        :return: sampled ids, plus logprobs of the *unmodified* distribution
            (``log_softmax(logits)`` before penalties and temperature, as vLLM returns them)
            when ``metadata.max_num_logprobs`` is not None
        """

    def probabilities(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """``[num_rows, vocab_size]`` float32: for each random row (temperature > 0), the
        distribution :meth:`__call__` draws that row's token from, normalized; greedy
        rows' values are unspecified. Draws nothing and leaves the generators untouched.

        Only called when :attr:`provides_probabilities` is true, with metadata of rows that
        have no logprobs, penalties, bias, bad words, ``allowed_token_ids``, blocked
        ``min_tokens``, seed or custom logits processors (requests with those get no
        probabilistic drafts). ``logits`` may be modified in place.
        """
        raise NotImplementedError(
            f"sampler {type(self).__qualname__} does not provide probabilities "
            "(provides_probabilities is False)"
        )


def check_sampler_output(output: object, metadata: SamplingMetadata, sampler: object) -> None:
    """Raise ``TypeError`` naming ``sampler``'s class when ``output`` breaks the contract of
    :meth:`Sampler.__call__`: not a :class:`SamplerOutput`, ids not an int64 vector of one id
    per row, or no logprobs (or too few) when a row asked for them.

    Host-side metadata only, so no device sync: whether every id is inside the vocabulary is
    the sampler's own promise (an id outside it fails in the embedding, on a GPU as a device
    assert).
    """
    name = type(sampler).__qualname__
    if not isinstance(output, SamplerOutput):
        raise TypeError(f"sampler {name} returned {type(output).__name__}, not a SamplerOutput")
    ids = output.sampled_token_ids
    rows = metadata.num_rows
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or tuple(ids.shape) != (rows,):
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        dtype = ids.dtype if isinstance(ids, torch.Tensor) else None
        raise TypeError(
            f"sampler {name} returned sampled_token_ids of shape {shape} and dtype {dtype}; "
            f"expected an int64 tensor of shape ({rows},), one id per row"
        )
    wanted = metadata.max_num_logprobs
    if wanted is not None:
        got = output.logprobs
        if got is None:
            raise TypeError(
                f"sampler {name} returned no logprobs, but a request asked for logprobs "
                f"(up to {wanted}); see Sampler.__call__"
            )
        if tuple(got.token_ids.shape) != (rows, 1 + wanted):
            raise TypeError(
                f"sampler {name} returned logprobs of shape {tuple(got.token_ids.shape)}; "
                f"expected ({rows}, {1 + wanted}): the sampled id, then the top {wanted}"
            )
