"""Prompt -> validated ``EngineCoreRequest``s (one per completion when ``n > 1``)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from chassis.core.lora.request import LoRARequest
from chassis.core.multimodal import MultiModalTensor
from chassis.core.multimodal_inputs import MultiModalInputs, shift_features
from chassis.core.prompt_embeds import (
    PLACEHOLDER_TOKEN_ID,
    EmbedsPrompt,
    check_embeds,
    flag_refusal,
)
from chassis.core.request import EngineCoreRequest
from chassis.core.sampling_params import is_integer
from chassis.core.structured_outputs_config import with_engine_defaults

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    import torch
    from transformers import PreTrainedTokenizerBase

    from chassis.core.config import EngineConfig
    from chassis.core.logits_processor import LogitsProcessor
    from chassis.core.multimodal import MultiModalFeature
    from chassis.core.sampling_params import SamplingParams

_SEED_SPAN = 2**64


def child_request_id(index: int, request_id: str) -> str:
    """The engine-core id of completion ``index`` of a request with ``n > 1``."""
    return f"{index}_{request_id}"


def logprobs_over_limit(name: str, value: int | None, max_logprobs: int) -> str | None:
    """The one ``--max-logprobs`` rule: the error message when ``value`` alternatives (asked
    for through the field ``name``) exceed ``max_logprobs``, else ``None``. The engine checks
    its params with it; the server checks each request field first, so that a 400 names the
    field the client sent (``top_logprobs`` on chat, ``logprobs`` on completions)."""
    if value is None or value <= max_logprobs:
        return None
    return f"{name}={value} exceeds the server's limit of {max_logprobs} (--max-logprobs)"


def truncation_length(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens ``truncate_prompt_tokens`` keeps, read as vLLM
    reads it: ``None`` (no truncation) stays ``None``, ``-1`` is ``max_model_len``, and a
    value above ``max_model_len`` is a ``ValueError`` (vLLM's message), whatever the
    prompt's length. Generation and pooling share this rule."""
    if truncate_prompt_tokens is None:
        return None
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
            f"({max_model_len}). Please, select a smaller truncation size."
        )
    return keep


def truncate_prompt(
    token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int
) -> list[int]:
    """``token_ids``' last :func:`truncation_length` tokens (all of them when it is ``None``
    or at least their number)."""
    keep = truncation_length(truncate_prompt_tokens, max_model_len)
    return token_ids if keep is None else token_ids[-keep:]


class InputProcessor:
    """Tokenizes and validates prompts in the front-end, before anything reaches the engine.

    ``config.max_model_len`` must be resolved (``EngineConfig.check_against_model``). Every
    rejection is a ``ValueError`` whose message a client can act on (the API server returns
    it as HTTP 400).

    Without a tokenizer (``tokenizer=None``, the engine's ``skip_tokenizer_init``) prompts
    must be token ids, checked against ``vocab_size`` (the model config's), and stop strings
    are rejected: there is no text to search.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        config: EngineConfig,
        eos_token_ids: Sequence[int],
        *,
        vocab_size: int | None = None,
    ) -> None:
        if config.max_model_len is None:
            raise ValueError(
                "InputProcessor needs config.max_model_len; call "
                "EngineConfig.check_against_model(...) first"
            )
        if tokenizer is None and vocab_size is None:
            raise ValueError("InputProcessor without a tokenizer needs vocab_size")
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len: int = config.max_model_len
        self._uses_priority: bool | None = None  # the scheduler's, asked on first need
        #: why the tokenizer cannot be mapped to bytes for structured outputs ("" when it
        #: can), found on the first constrained request
        self._tokenizer_refusal: str | None = None
        #: ids in [0, vocab_size) are valid (added tokens included)
        self.vocab_size = len(tokenizer) if tokenizer is not None else int(vocab_size or 0)
        #: with --enable-lora, the engine's adaptable modules (set once the engine is up)
        self.lora_target_shapes: dict[str, tuple[int, int]] | None = None
        #: adapters checked so far, by id (check_lora runs in threads: AsyncLLM processes
        #: requests with adapters off the event loop; the lock guards the id's first claim)
        self._loras: dict[int, LoRARequest] = {}
        self._loras_lock = threading.Lock()
        #: the classes ``--logits-processors`` names, resolved on first need
        self._logits_processor_classes: list[type[LogitsProcessor]] | None = None
        #: requests' images: admission and the model's processor (built on first need)
        self.multimodal = MultiModalInputs(config, tokenizer)
        #: the width prompt embeddings must have (the model's hidden size), read on first need
        self._hidden_size: int | None = None

    def _scheduler_uses_priority(self) -> bool:
        if self._uses_priority is None:
            from chassis.plugins.registries import get_registries

            scheduler_cls = get_registries().schedulers.get(self.config.scheduler)
            self._uses_priority = bool(getattr(scheduler_cls, "uses_priority", False))
        return self._uses_priority

    def tokenize(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """``prompt`` as token ids, with the tokenizer's special tokens (BOS) unless told not."""
        if self.tokenizer is None:
            raise ValueError(
                "this engine runs without a tokenizer (skip_tokenizer_init): text prompts "
                "cannot be tokenized; send the prompt as a list of token ids"
            )
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)

    def process(
        self,
        prompt: str | list[int] | EmbedsPrompt,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        arrival_time: float | None = None,
        *,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        multi_modal_data: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> list[EngineCoreRequest]:
        """Validate one request and return what to send to the engine core.

        ``prompt`` is text (tokenized here) or token ids (checked against the vocabulary).
        ``max_tokens=None`` becomes "up to the context length". For ``n == 1`` one request
        with ``request_id``; for ``n > 1``, ``n`` requests with ids ``f"{i}_{request_id}"``,
        each ``n=1``; when ``params.seed`` is set, child ``i`` gets ``seed + i`` (modulo 2**64)
        so completions differ yet reproduce. ``add_special_tokens=False`` suits prompts
        rendered by a chat template that already contains BOS; an encoder-decoder model's
        (Whisper's) text prompt never gets them (vLLM's rule: its decoder prompt names its
        special tokens), and it needs its item. ``lora_request`` names the
        LoRA adapter to run with (:meth:`check_lora`); ``cache_salt`` (vLLM's) keeps the
        request's prefix-cache entries to requests of the same salt.

        ``multi_modal_data`` (vLLM's): the request's items by modality, ``{"image": img}`` or
        ``{"image": [img, ...]}`` (``PIL.Image.Image``), with one placeholder per item in
        the prompt, in order (:meth:`MultiModalInputs.expand`); ``mm_processor_kwargs``: the
        model's per-request processor settings (Qwen2-VL: ``min_pixels``, ``max_pixels``).
        The expanded prompt is what the length checks count.

        ``prompt`` may be an :class:`~chassis.core.prompt_embeds.EmbedsPrompt` (with
        ``enable_prompt_embeds``): its rows, checked, travel in the request's
        ``prompt_embeds`` with one placeholder token id per row (truncation keeps the last
        rows).
        """
        priority = self.check_priority(priority)
        if isinstance(prompt, EmbedsPrompt):
            prompt_token_ids, embeds = self._embeds_prompt(prompt, params, multi_modal_data)
        else:
            encoder_decoder = isinstance(prompt, str) and self.multimodal.is_encoder_decoder()
            prompt_token_ids = self.token_ids(
                prompt, add_special_tokens=add_special_tokens and not encoder_decoder
            )
            embeds = None
        mm_features: list[MultiModalFeature] = []
        # (mm_processor_kwargs alone: nothing to process; an encoder-decoder's processor
        # refuses a request without its clip)
        if multi_modal_data is not None or self.multimodal.is_encoder_decoder():
            prompt_token_ids, mm_features = self.multimodal.expand(
                prompt_token_ids,
                {} if multi_modal_data is None else multi_modal_data,
                mm_processor_kwargs,
            )
        kept = self._truncate(prompt_token_ids, params)
        if embeds is not None and len(kept) < len(embeds):
            embeds = embeds[len(embeds) - len(kept) :].contiguous()
        if mm_features and len(kept) < len(prompt_token_ids):
            mm_features = shift_features(mm_features, len(prompt_token_ids) - len(kept))
        prompt_token_ids = kept
        if mm_features and len(prompt_token_ids) >= self.max_model_len:
            # (the plain message would puzzle a client that sent a short text and an image)
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt is {len(prompt_token_ids)} tokens, "
                f"{sum(f.length for f in mm_features)} of them for its {len(mm_features)} "
                "multimodal item(s), which leaves no room for a completion. Please send "
                "fewer or smaller images, or a shorter prompt."
            )
        params = self._validate(prompt_token_ids, params)
        params = self._token_restrictions(params)
        if self.config.logits_processors:
            params = self._check_logits_processor_args(params)
        self.check_lora(lora_request)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string; got {cache_salt!r}")
        if arrival_time is None:
            arrival_time = time.time()

        embeds_tensor = None if embeds is None else MultiModalTensor.from_tensor(embeds)

        def make(rid: str, p: SamplingParams) -> EngineCoreRequest:
            return EngineCoreRequest(
                request_id=rid,
                prompt_token_ids=prompt_token_ids,
                sampling_params=p,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival_time,
                priority=priority,
                lora_request=lora_request,
                cache_salt=cache_salt,
                mm_features=mm_features,
                prompt_embeds=embeds_tensor,
            )

        if params.n == 1:
            return [make(request_id, params)]
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else (params.seed + i) % _SEED_SPAN
            children.append(make(child_request_id(i, request_id), params.clone(n=1, seed=seed)))
        return children

    def check(
        self,
        prompt: str | list[int] | EmbedsPrompt,
        params: SamplingParams,
        priority: int = 0,
        *,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        multi_modal_data: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Every refusal :meth:`process` would make for this request (the same
        ``ValueError``), without keeping what it makes: for a caller that answers before it
        submits the request (the server's background responses). It is :meth:`process`
        itself, so the two cannot disagree; a constraint or adapter that passed is
        remembered (the backend's cache, :meth:`check_lora`), so the later :meth:`process`
        costs no second compile or file read."""
        self.process(
            prompt,
            params,
            "check",
            priority,
            add_special_tokens=add_special_tokens,
            lora_request=lora_request,
            cache_salt=cache_salt,
            multi_modal_data=multi_modal_data,
            mm_processor_kwargs=mm_processor_kwargs,
        )

    def _embeds_prompt(
        self,
        prompt: EmbedsPrompt,
        params: SamplingParams,
        multi_modal_data: Mapping[str, Any] | None,
    ) -> tuple[list[int], torch.Tensor]:
        """A prompt given as input embeddings: its placeholder token ids and its checked
        rows (:func:`~chassis.core.prompt_embeds.check_embeds`); ``ValueError``
        without ``enable_prompt_embeds``, and for what cannot be combined with it
        (multimodal data; ``prompt_logprobs``, which would score placeholder ids)."""
        if not self.config.enable_prompt_embeds:
            raise ValueError(flag_refusal())
        if multi_modal_data is not None:
            raise ValueError("prompt_embeds cannot be combined with multi_modal_data")
        if params.prompt_logprobs is not None:
            raise ValueError(
                "prompt_logprobs cannot be computed for prompt_embeds (the prompt has no token ids)"
            )
        if self._hidden_size is None:
            from chassis.core.model_loader import engine_hf_config, language_model_config

            hf = language_model_config(engine_hf_config(self.config))  # (the engine's sizes)
            self._hidden_size = int(hf.hidden_size)
        embeds = check_embeds(prompt.embeds, self._hidden_size)
        return [PLACEHOLDER_TOKEN_ID] * len(embeds), embeds

    def check_priority(self, priority: int) -> int:
        """``priority`` as an ``int``; a ``ValueError`` unless it is a 64-bit integer, and for
        a non-zero one unless the engine's scheduler uses priorities."""
        if not is_integer(priority) or not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
        priority = int(priority)  # numpy integers too
        if priority != 0 and not self._scheduler_uses_priority():
            raise ValueError(
                f"priority {priority} was given, but the {self.config.scheduler!r} scheduler ignores "
                "priorities; start the engine with --scheduler priority (scheduler='priority')"
            )
        return priority

    def token_ids(self, prompt: str | list[int], *, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids: text tokenized (:meth:`tokenize`), or ids converted to
        ``int`` (a ``ValueError`` for one that is not an integer; the vocabulary is checked
        later)."""
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special_tokens=add_special_tokens)
        not_ints = [t for t in prompt if not is_integer(t)]
        if not_ints:
            raise ValueError(f"prompt token ids must be integers; got {not_ints[:10]}")
        return [int(t) for t in prompt]

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """Refuse a LoRA adapter the engine cannot run: LoRA off, an id already given to
        another adapter (another name or folder, for as long as this front-end lives), or an
        adapter that does not fit the model (read the first time an id is seen;
        :func:`~chassis.core.lora.adapter.check_adapter`). Thread-safe."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest; got {lora_request!r}")
        if not self.config.enable_lora:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} was asked for, but LoRA is off; "
                "start the engine with --enable-lora (enable_lora=True)"
            )
        known = self._loras.get(lora_request.lora_int_id)
        if known is None:
            if self.lora_target_shapes is None:
                raise RuntimeError("the engine has not reported its LoRA target modules yet")
            from chassis.core.lora.adapter import check_adapter

            check_adapter(
                lora_request.lora_path, self.lora_target_shapes, self.config.max_lora_rank
            )
            # Another thread may have checked another adapter under this id meanwhile: the
            # first to claim the id keeps it.
            with self._loras_lock:
                known = self._loras.setdefault(lora_request.lora_int_id, lora_request)
        if known != lora_request:
            # the engine keys device slots and prefix-cache entries by the id: the id stays
            # the first adapter's for the engine's lifetime (docs/lora.md)
            raise ValueError(
                f"lora_int_id {lora_request.lora_int_id} already names adapter "
                f"{known.lora_name!r} ({known.lora_path}); adapter {lora_request.lora_name!r} "
                f"({lora_request.lora_path}) cannot take it: give each adapter its own id"
            )

    def _token_restrictions(self, params: SamplingParams) -> SamplingParams:
        """Check ``allowed_token_ids`` against the vocabulary and tokenize ``bad_words``
        (each word alone and after a space, the two ways it can appear in text, as vLLM
        does) into ``bad_words_token_ids``."""
        if params.allowed_token_ids is not None:
            outside = [t for t in params.allowed_token_ids if not t < self.vocab_size]
            if outside:
                raise ValueError(
                    f"invalid sampling parameter allowed_token_ids: {outside[:10]} outside the "
                    f"vocabulary [0, {self.vocab_size})"
                )
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError(
                "bad_words need a tokenizer, and this engine runs without one "
                "(skip_tokenizer_init); block single tokens with logit_bias instead"
            )
        sequences = list(params.bad_words_token_ids or [])
        for word in params.bad_words:
            for text in (word.strip(), " " + word.strip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return params.clone(bad_words_token_ids=sequences)

    def _truncate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last ``params.truncate_prompt_tokens`` tokens (all of it when unset;
        ``-1``: the last ``max_model_len``, as in vLLM; above ``max_model_len``: a
        ``ValueError``). A kept prompt that leaves no room for ``max_tokens`` (one token when
        unset) is refused here, with the largest value that would leave room."""
        keep = params.truncate_prompt_tokens
        kept = truncate_prompt(prompt_token_ids, keep, self.max_model_len)
        room = params.max_tokens or 1
        if keep is not None and len(kept) + room > self.max_model_len:
            # (-1 keeps a whole context: it fits a generation only for a shorter prompt)
            limit = self.max_model_len - room
            fix = (
                f"set truncate_prompt_tokens to at most {limit} (max_model_len - max_tokens) or "
                "reduce max_tokens"
                if limit >= 1
                else "reduce max_tokens"
            )
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"truncate_prompt_tokens={keep} keeps {len(kept)} prompt tokens, which leave no "
                f"room for {room} completion token(s). Please {fix}."
            )
        return kept

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Check the prompt and params against the model; return params with max_tokens set."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty: it must contain at least one token")
        if self.tokenizer is None and params.stop:
            raise ValueError(
                "stop strings need a tokenizer, and this engine runs without one "
                "(skip_tokenizer_init); use stop_token_ids instead"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids out of the vocabulary [0, {self.vocab_size}): {bad[:10]}"
            )
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt is {num_prompt} tokens, which leaves no room for a completion. "
                "Please reduce the length of the prompt."
            )
        if params.max_tokens is None:
            params = params.clone(max_tokens=self.max_model_len - num_prompt)
        elif num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt + params.max_tokens} tokens ({num_prompt} in the "
                f"messages, {params.max_tokens} in the completion). Please reduce the length "
                "of the messages or completion."
            )
        for name, value in (
            ("logprobs", params.logprobs),
            ("prompt_logprobs", params.prompt_logprobs),
        ):
            message = logprobs_over_limit(name, value, self.config.max_logprobs)
            if message is not None:
                raise ValueError(message)
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias or ())),
        ):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"{name} has token ids out of the vocabulary [0, {self.vocab_size}): {bad[:10]}"
                )
        if params.structured_outputs is not None:
            # the engine's --structured-outputs-config defaults (a compact JSON default)
            # apply before the check, so offline and served requests compile the same
            constraint = with_engine_defaults(
                params.structured_outputs, self.config.structured_outputs_config
            )
            if constraint is not params.structured_outputs:
                params = params.clone(structured_outputs=constraint)
            self.check_structured_outputs(params)
        return params

    def _check_logits_processor_args(self, params: SamplingParams) -> SamplingParams:
        """Each ``--logits-processors`` class checks the request (``validate_params``)."""
        from chassis.core.logits_processor import admit_params, resolve_logits_processors

        if self._logits_processor_classes is None:
            self._logits_processor_classes = resolve_logits_processors(
                self.config.logits_processors
            )
        return admit_params(self._logits_processor_classes, params)

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """The engine's backend can compile the constraint (its ``check``; no tokenizer):
        ``ValueError`` naming ``structured_outputs`` otherwise. :meth:`process` (and so
        :meth:`check`) runs it. A constraint that passed is remembered by the backend, so
        checking it again costs no compile."""
        from chassis.plugins.registries import get_registries

        if self.tokenizer is None:
            raise ValueError(
                "structured outputs need a tokenizer, and this engine runs without one "
                "(skip_tokenizer_init)"
            )
        if self._tokenizer_refusal is None:
            from chassis.core.token_vocabulary import check_tokenizer

            try:
                check_tokenizer(self.tokenizer)
                self._tokenizer_refusal = ""
            except ValueError as exc:
                self._tokenizer_refusal = str(exc)
        if self._tokenizer_refusal:
            raise ValueError(self._tokenizer_refusal)
        backend = get_registries().structured_output_backends.get(
            self.config.structured_output_backend
        )
        assert params.structured_outputs is not None
        try:
            backend.check(params.structured_outputs)
        except ValueError as exc:  # the API server's 400 then names the parameter
            raise ValueError(f"invalid sampling parameter structured_outputs: {exc}") from None
