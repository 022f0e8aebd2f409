"""The built-in ``default`` sampler: vLLM v1 semantics, vectorized, no host synchronization."""

from __future__ import annotations

import torch

from chassis.builtin_plugins.samplers.filters import (
    apply_min_p,
    apply_temperature,
    apply_top_k_top_p,
)
from chassis.builtin_plugins.samplers.logit_edits import (
    apply_allowed_token_ids,
    apply_logit_bias,
    apply_min_tokens,
)
from chassis.builtin_plugins.samplers.logprobs import gather_logprobs
from chassis.builtin_plugins.samplers.penalties import (
    apply_penalties,
    apply_penalties_at_seen_tokens,
    token_counts,
)
from chassis.core.config import EngineConfig
from chassis.core.sampler_interface import Sampler, SamplerOutput
from chassis.core.sampling_metadata import SAMPLING_EPS, SamplingMetadata
from chassis.core.token_draw import exponential_race
from chassis.platforms import get_current_platform


class DefaultSampler(Sampler):
    """Greedy and random sampling with every vLLM sampling parameter.

    Order (as vLLM v1): logprobs of the raw logits (if asked) -> ``allowed_token_ids`` ->
    ``logit_bias`` -> ``min_tokens`` and bad-word blocking -> custom logits processors that
    are not argmax-invariant -> repetition/frequency/presence penalties -> greedy rows take
    the argmax; random rows: temperature -> min-p -> argmax-invariant custom logits
    processors -> top-k -> top-p -> softmax -> exponential race. See docs/sampling.md.
    ``logits`` is modified in place.
    """

    #: top-p without top-k ranks this many candidates first where host reads are free (on
    #: the CPU a full sort of a 49,152-token vocabulary for 32 rows takes ~56 ms, the top
    #: 1,024 ~8 ms); the nucleus of a language model's distribution is rarely larger
    NUCLEUS_CANDIDATES = 1024
    #: runs custom logits processors (``metadata.logits_processors``) where vLLM V1 does
    supports_logits_processors = True
    #: gives draft-model speculative decoding the distributions it rejection-samples with
    provides_probabilities = True

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # A subclass that changes how tokens are drawn (``sample``, ``__call__``) but not
        # ``probabilities`` would have probabilistic drafts verified against a distribution
        # it does not draw from: it gets one-hot drafts unless it says otherwise.
        own = cls.__dict__
        if (
            "provides_probabilities" not in own
            and "probabilities" not in own
            and ("sample" in own or "__call__" in own)
        ):
            cls.provides_probabilities = False

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._host_reads_are_free = get_current_platform().host_reads_are_free()
        self._nucleus_candidates = self.NUCLEUS_CANDIDATES if self._host_reads_are_free else None

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row; see :meth:`Sampler.__call__` for the contract."""
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)

        logits = self.process_logits(logits, metadata)
        sampled = self.sample(logits, metadata)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def process_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Apply the edits that also change greedy choices: allowed ids, bias, blocked
        tokens (min_tokens, bad words), custom logits processors, penalties."""
        if metadata.allowed_token_ids is not None:
            apply_allowed_token_ids(logits, metadata.allowed_token_ids)
        if metadata.logit_bias is not None:
            apply_logit_bias(logits, metadata.logit_bias)
        if metadata.min_tokens_blocked is not None:
            apply_min_tokens(logits, metadata.min_tokens_blocked)
        if metadata.bad_word_tokens is not None:
            apply_min_tokens(logits, metadata.bad_word_tokens)
        if metadata.logits_processors is not None:  # custom ones that may change the argmax
            logits = metadata.logits_processors.apply_non_argmax_invariant(logits)
        if not metadata.no_penalties:
            vocab_size = logits.shape[-1]
            if metadata.output_token_ids is None:
                raise ValueError("SamplingMetadata has penalties but no output_token_ids")
            if self._host_reads_are_free:
                # only the seen tokens (same values; the dense form costs ~20 ms per step on
                # the CPU for 32 rows of 49,152 logits)
                return apply_penalties_at_seen_tokens(
                    logits,
                    metadata.prompt_token_ids if metadata.repetition_penalty is not None else None,
                    metadata.output_token_ids,
                    metadata.repetition_penalty,
                    metadata.presence_penalty,
                    metadata.frequency_penalty,
                )
            output_counts = token_counts(metadata.output_token_ids, vocab_size, logits.device)
            prompt_counts = None
            if metadata.repetition_penalty is not None and metadata.prompt_token_ids is not None:
                prompt_counts = token_counts(metadata.prompt_token_ids, vocab_size, logits.device)
            apply_penalties(
                logits,
                prompt_counts,
                output_counts,
                metadata.repetition_penalty,
                metadata.presence_penalty,
                metadata.frequency_penalty,
            )
        return logits

    def probabilities(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution each random row draws from (see :meth:`Sampler.probabilities`):
        the same edits, temperature and filters as :meth:`__call__`, then the softmax."""
        return self.random_probabilities(self.process_logits(logits.float(), metadata), metadata)

    def random_probabilities(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> torch.Tensor:
        """Temperature -> min-p -> argmax-invariant custom logits processors -> top-k ->
        top-p -> softmax of processed ``logits`` (modified in place)."""
        apply_temperature(logits, metadata.temperature)
        if metadata.min_p is not None:
            apply_min_p(logits, metadata.min_p)
        if metadata.logits_processors is not None:  # greedy rows already chose above
            logits = metadata.logits_processors.apply_argmax_invariant(logits)
        apply_top_k_top_p(
            logits,
            metadata.top_k,
            metadata.top_p,
            metadata.max_top_k,
            self._nucleus_candidates,
        )
        return logits.softmax(dim=-1)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """``[num_rows]`` int64: argmax for greedy rows, a random draw for the others."""
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy
        random = exponential_race(
            self.random_probabilities(logits, metadata), metadata.generators, consume=True
        )
        if greedy is None:
            return random
        return torch.where(metadata.temperature < SAMPLING_EPS, greedy, random)
