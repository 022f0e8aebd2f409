"""``SamplingMetadata``: the per-row sampling settings of one step, built by the model runner.

:func:`build_sampling_metadata` turns the sampling requests of one step (one
:class:`SamplingRow` each) into a :class:`SamplingMetadata`; it runs every step, so it makes
tensors only for the features some row uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from chassis.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from chassis.core.logits_processor import StepLogitsProcessors

#: Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): dividing by them would
#: overflow, and the distribution is one-hot for every practical purpose.
SAMPLING_EPS = 1e-5


_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)


@dataclass
class SamplingMetadata:
    """Settings for the rows that sample this step (row ``i`` = ``i``-th sampling request).

    Optional tensors are ``None`` when no row uses the feature, so the sampler skips it.
    Greedy rows carry neutral ``top_k``/``top_p``/``min_p`` values. The tensors are
    read-only: they may be shared between steps (an all-greedy step's ``temperature``).
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
    #: a host-side hint for the top-k/top-p filter: every row with ``top_k > 0`` or
    #: ``top_p < 1`` has ``0 < top_k <= max_top_k``, so ranking that many candidates
    #: suffices; None (always correct) makes the sampler sort the whole vocabulary
    max_top_k: int | None = None
    #: row -> generator of a request with a seed (rows absent use the global RNG)
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    #: [num_rows] float32 each; None when every row has the neutral value
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    #: token histories, needed only when a penalty is set; a row whose penalties make no use
    #: of a history may carry an empty list there (the builder does this to stay cheap)
    prompt_token_ids: list[list[int]] | None = None
    output_token_ids: list[list[int]] | None = None
    #: per row, token id -> additive bias (None for rows without)
    logit_bias: list[dict[int, float] | None] | None = None
    #: per row, token ids forbidden because the row has fewer than min_tokens outputs
    #: (its EOS and stop_token_ids); None when no row is under its minimum
    min_tokens_blocked: list[set[int] | None] | None = None
    #: per row, the only token ids it may sample (``allowed_token_ids``); None for rows
    #: without, and None when no row has them
    allowed_token_ids: list[list[int] | None] | None = None
    #: per row, token ids banned this step because they would complete a bad word (the last
    #: token of a word whose earlier tokens end the output); None when no row bans any
    bad_word_tokens: list[set[int] | None] | None = None
    #: largest ``logprobs`` asked by any row, None when no row asked
    max_num_logprobs: int | None = None
    #: the engine's custom logits processors bound to this step's rows (``--logits-processors``;
    #: None without any): a sampler with ``supports_logits_processors`` calls
    #: ``apply_non_argmax_invariant`` before the penalties and ``apply_argmax_invariant``
    #: after temperature and min-p
    logits_processors: StepLogitsProcessors | None = None

    @property
    def no_penalties(self) -> bool:
        return (
            self.repetition_penalty is None
            and self.presence_penalty is None
            and self.frequency_penalty is None
        )

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


@dataclass(slots=True)
class SamplingRow:
    """One sampling request of a step, as the model runner knows it.

    ``prompt_token_ids`` and ``output_token_ids`` are read, never copied or modified.
    ``generator`` (seeded requests only) must live on the device the logits are on; the
    sampler draws exactly one ``[vocab_size]`` noise vector from it per random row, rows in
    order (a request verifying ``d`` drafts has ``d + 1`` rows sharing it), so a request's
    tokens depend only on its seed and its own history (the runner rewinds the stream past
    rejected drafts: ``core/seeded_drafts.py``).
    """

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    #: the model's end-of-sequence ids (blocked while under ``min_tokens`` unless
    #: ``ignore_eos``)
    eos_token_ids: frozenset[int] = frozenset()
    #: a custom logits processor that reads generated tokens acts on this row
    #: (``LogitsProcessor.reads_output_tokens``)
    processors_read_output: bool = False

    @property
    def reads_output_history(self) -> bool:
        """Whether sampling this row reads its generated tokens: a penalty, EOS and stop
        ids still blocked by ``min_tokens``, or a logits processor that reads them."""
        params = self.sampling_params
        return (
            self.processors_read_output
            or params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or len(self.output_token_ids) < params.min_tokens
            or any(len(s) > 1 for s in params.bad_words_token_ids or ())
        )


def host_to_device(
    data: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A tensor of ``data`` (host values or a CPU tensor) on ``device``, without making the
    host wait for the device.

    Where the platform supports pinned memory the values go through it with an asynchronous
    copy; a plain copy from pageable memory would wait for all queued device work.
    """
    device = torch.device(device)
    if isinstance(data, torch.Tensor):
        host = data.to(dtype)
    else:
        host = torch.tensor(data, dtype=dtype)
    if host.device == device:
        return host
    from chassis.platforms import get_current_platform

    if get_current_platform().pin_memory_available():
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


#: device -> a float32 zero vector: the ``temperature`` of all-greedy steps, sliced per step
_GREEDY_TEMPERATURES: dict[torch.device, torch.Tensor] = {}


def greedy_temperatures(num_rows: int, device: torch.device) -> torch.Tensor:
    """``[num_rows]`` float32 zeros on ``device``: a view of one vector per device, grown when
    needed (an all-greedy step then costs no host-to-device copy: at batch 1 on a GPU that
    copy, with its pinned staging, is a measurable share of the step's host time). Read-only,
    as every tensor of :class:`SamplingMetadata`."""
    zeros = _GREEDY_TEMPERATURES.get(device)
    if zeros is None or zeros.shape[0] < num_rows:
        zeros = torch.zeros(max(num_rows, 256), dtype=torch.float32, device=device)
        _GREEDY_TEMPERATURES[device] = zeros
    return zeros[:num_rows]


def build_sampling_metadata(
    rows: Sequence[SamplingRow], device: torch.device | str, vocab_size: int
) -> SamplingMetadata:
    """The :class:`SamplingMetadata` of ``rows`` (row ``i`` of the logits = ``rows[i]``).

    Cheap enough to call every step: one pass over the rows, tensors only for features some
    row uses. Greedy rows (temperature < :data:`SAMPLING_EPS`) get temperature 0, neutral
    top-k/top-p/min-p and no generator. ``top_k >= vocab_size`` counts as off.

    :param rows: the rows that sample this step, in logits order
    :param device: where the logits live; tensors are placed there
    :param vocab_size: the logits' last dimension
    :raises ValueError: if a ``logit_bias`` or ``allowed_token_ids`` token id is outside
        ``[0, vocab_size)``
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    device = torch.device(device)
    temperature: list[float] = []
    top_k: list[int] = []
    top_p: list[float] = []
    min_p: list[float] = []
    repetition: list[float] = []
    presence: list[float] = []
    frequency: list[float] = []
    generators: dict[int, torch.Generator] = {}
    logit_bias: list[dict[int, float] | None] = []
    blocked: list[set[int] | None] = []
    allowed: list[list[int] | None] = []
    bad_word_tokens: list[set[int] | None] = []
    max_num_logprobs: int | None = None
    num_greedy = 0
    max_top_k = 0  # -1 once a row uses top-p without top-k
    use_top_k = use_top_p = use_min_p = use_bias = use_blocked = False
    use_allowed = use_bad_words = False

    for i, row in enumerate(rows):
        params = row.sampling_params
        if params.temperature < SAMPLING_EPS:
            num_greedy += 1
            temperature.append(0.0)
            top_k.append(0)
            top_p.append(1.0)
            min_p.append(0.0)
        else:
            temperature.append(params.temperature)
            k = params.top_k if params.top_k < vocab_size else 0
            top_k.append(k)
            # float32 flushes a p below ~1e-45 to 0, which would drop every token (the filter
            # keeps what has less mass before it than p); the smallest normal float keeps the
            # most likely token, which is what any p that small means
            top_p.append(max(params.top_p, _FLOAT32_TINY))
            min_p.append(params.min_p)
            use_top_k |= k > 0
            if params.top_p < 1.0 and k == 0:
                max_top_k = -1
            elif max_top_k >= 0:
                max_top_k = max(max_top_k, k)
            use_top_p |= params.top_p < 1.0
            use_min_p |= params.min_p > 0.0
            if row.generator is not None:
                generators[i] = row.generator

        repetition.append(params.repetition_penalty)
        presence.append(params.presence_penalty)
        frequency.append(params.frequency_penalty)

        bias = params.logit_bias or None
        if bias is not None:
            for token_id in bias:
                if not 0 <= token_id < vocab_size:
                    raise ValueError(
                        f"invalid sampling parameter logit_bias: token id {token_id} is "
                        f"outside the vocabulary [0, {vocab_size})"
                    )
            use_bias = True
        logit_bias.append(bias)

        row_blocked = None
        if len(row.output_token_ids) < params.min_tokens:
            ids = set(params.stop_token_ids)
            if not params.ignore_eos:
                ids |= row.eos_token_ids
            # Ids past the logits can never be sampled, so there is nothing to block.
            row_blocked = {t for t in ids if t < vocab_size} or None
            use_blocked |= row_blocked is not None
        blocked.append(row_blocked)

        row_allowed = params.allowed_token_ids
        if row_allowed is not None:
            if max(row_allowed) >= vocab_size:  # (SamplingParams refuses negative ids)
                raise ValueError(
                    "invalid sampling parameter allowed_token_ids: a token id is outside the "
                    f"vocabulary [0, {vocab_size})"
                )
            use_allowed = True
        allowed.append(row_allowed)
        row_bad = _bad_word_tokens(params.bad_words_token_ids, row.output_token_ids, vocab_size)
        use_bad_words |= row_bad is not None
        bad_word_tokens.append(row_bad)

        if params.logprobs is not None and (
            max_num_logprobs is None or params.logprobs > max_num_logprobs
        ):
            max_num_logprobs = params.logprobs

    num_rows = len(temperature)
    metadata = SamplingMetadata(
        temperature=greedy_temperatures(num_rows, device)
        if num_greedy == num_rows
        else host_to_device(temperature, torch.float32, device),
        all_greedy=num_greedy == num_rows,
        all_random=num_greedy == 0 and num_rows > 0,
        top_k=host_to_device(top_k, torch.int64, device) if use_top_k else None,
        top_p=host_to_device(top_p, torch.float32, device) if use_top_p else None,
        min_p=host_to_device(min_p, torch.float32, device) if use_min_p else None,
        max_top_k=max_top_k if use_top_k and max_top_k > 0 else None,
        generators=generators,
        logit_bias=logit_bias if use_bias else None,
        min_tokens_blocked=blocked if use_blocked else None,
        allowed_token_ids=allowed if use_allowed else None,
        bad_word_tokens=bad_word_tokens if use_bad_words else None,
        max_num_logprobs=max_num_logprobs,
    )
    _add_penalties(metadata, rows, repetition, presence, frequency, device)
    return metadata


def _bad_word_tokens(
    sequences: list[list[int]] | None, output: list[int], vocab_size: int
) -> set[int] | None:
    """The tokens that would complete one of ``sequences`` after ``output`` (a one-token
    word is always banned), or None."""
    if not sequences:
        return None
    banned = set()
    for sequence in sequences:
        *prefix, last = sequence
        if last < vocab_size and (not prefix or output[-len(prefix) :] == prefix):
            banned.add(last)
    return banned or None


def _add_penalties(
    metadata: SamplingMetadata,
    rows: Sequence[SamplingRow],
    repetition: list[float],
    presence: list[float],
    frequency: list[float],
    device: torch.device,
) -> None:
    """Fill the penalty tensors and the histories they need, if any row has a penalty."""
    uses_prompt = [r != 1.0 for r in repetition]
    uses_output = [
        r != 1.0 or p != 0.0 or f != 0.0
        for r, p, f in zip(repetition, presence, frequency, strict=True)
    ]
    if not any(uses_output):
        return
    if any(uses_prompt):
        metadata.repetition_penalty = host_to_device(repetition, torch.float32, device)
    if any(p != 0.0 for p in presence):
        metadata.presence_penalty = host_to_device(presence, torch.float32, device)
    if any(f != 0.0 for f in frequency):
        metadata.frequency_penalty = host_to_device(frequency, torch.float32, device)
    # Only the repetition penalty reads the prompt; rows without a penalty need no history.
    metadata.prompt_token_ids = [
        row.prompt_token_ids if use else [] for row, use in zip(rows, uses_prompt, strict=True)
    ]
    metadata.output_token_ids = [
        row.output_token_ids if use else [] for row, use in zip(rows, uses_output, strict=True)
    ]
