"""``LLM``: offline batch inference with the engine core in this process (vLLM's API)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from chassis.core.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    BeamStep,
    check_prompt_fits,
    run_beam_search,
    sequence_text,
    step_logprobs,
    step_sampling_params,
)
from chassis.core.chat import render_chat
from chassis.core.chat_content_format import check_content_format
from chassis.core.chat_media import ChatImages
from chassis.core.compilation_config import compilation_kwargs
from chassis.core.config import EngineConfig
from chassis.core.data_parallel import refuse_offline_data_parallel
from chassis.core.engine_core import EngineCore
from chassis.core.engine_setup import finalize_config
from chassis.core.errors import EngineSleepingError, RequestFailedError
from chassis.core.generation_defaults import generation_defaults
from chassis.core.input_processor import InputProcessor, truncation_length
from chassis.core.lone_surrogates import refuse_lone_surrogates
from chassis.core.lora.request import LoRARequest
from chassis.core.media_options import media_loaders
from chassis.core.output_processor import OutputProcessor
from chassis.core.outputs import PositionLogprobs, RequestOutput
from chassis.core.pooling_classify import (
    ClassificationOutput,
    ClassificationRequestOutput,
    apply_activation,
    cross_encoder_token_ids,
)
from chassis.core.pooling_config import PoolerConfig, apply_pooling_defaults
from chassis.core.pooling_input import EmbeddingModelInfo, process_pooling
from chassis.core.pooling_outputs import EmbeddingRequestOutput
from chassis.core.pooling_params import PoolingParams
from chassis.core.pooling_score import (
    ScoringOutput,
    ScoringRequestOutput,
    distinct,
    score_outputs,
    score_pairs,
)
from chassis.core.prompt_embeds import EmbedsPrompt
from chassis.core.sampling_params import SamplingParams
from chassis.core.sleep_mode import sleeping_message
from chassis.core.stat_logger import StatLoggerInfo
from chassis.core.stat_logger_manager import StatLoggerManager, resolve_stat_loggers
from chassis.core.tokenizer import engine_tokenizer, eos_token_ids, load_chat_template

Prompt = str | list[int] | dict[str, Any]

#: vLLM's older ``task`` argument -> ``runner`` ("auto" keeps the runner as given)
_TASK_RUNNERS = {
    "auto": None,
    "generate": "generate",
    "embed": "pooling",
    "embedding": "pooling",
    "classify": "pooling",
    "score": "pooling",
}
#: vLLM's older tasks that need a sequence-classification checkpoint
_CLASSIFIER_TASKS = ("classify", "score")


class LLM:
    """Generate for many prompts at once; ``LLM(model, **engine settings)``.

    ``model`` is a hub id, a local HF directory, or ``None`` for the embedded default. Other
    keyword arguments are :class:`EngineConfig` fields (``max_model_len``, ``dtype``,
    ``enable_prefix_caching``, ``max_num_batched_tokens``, ``scheduler``, ...). With
    ``skip_tokenizer_init=True`` no tokenizer is loaded: prompts must be token ids and
    outputs carry token ids with empty text.

    ``runner="pooling"`` (or vLLM's older ``task="embed"``) makes an embedding engine:
    :meth:`embed` returns one vector per prompt, :meth:`generate` and :meth:`chat` are
    refused (and :meth:`embed` is on a generating engine); ``pooler_config`` (a dict or
    :class:`~chassis.core.pooling_config.PoolerConfig`; vLLM's ``override_pooler_config``
    too) picks the pooling. A ``*ForSequenceClassification`` checkpoint runs as a pooling
    engine by itself (the default ``runner="auto"``; vLLM's older ``task="classify"`` or
    ``"score"`` too): :meth:`classify` and, with one label, cross-encoder :meth:`score`.
    See docs/embeddings.md.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        # vLLM's compilation_config and optimization_level become torch_compile and friends
        kwargs = compilation_kwargs(_pooling_kwargs(engine_kwargs))
        self.config = EngineConfig(model=model, **kwargs)
        refuse_offline_data_parallel(self.config)
        hf_config = finalize_config(self.config)
        #: the engine's pooling (None for a generating engine), and what embed() checks
        self.pooler_config = apply_pooling_defaults(self.config)
        assert self.config.served_model_name is not None
        self.embedding_info = (
            EmbeddingModelInfo.from_hf_config(
                hf_config, self.config.served_model_name, self.pooler_config
            )
            if self.pooler_config is not None
            else None
        )
        task = engine_kwargs.get("task")
        if task in _CLASSIFIER_TASKS and (
            self.embedding_info is None or self.embedding_info.classifier is None
        ):
            raise ValueError(
                f"task={task!r} is not supported for this model: it needs a "
                "*ForSequenceClassification checkpoint (use task='embed' for embeddings)"
            )
        assert self.config.tokenizer is not None
        if self.config.skip_tokenizer_init:
            self.tokenizer = None
            self.input_processor = InputProcessor(
                None,
                self.config,
                eos_token_ids(None, self.config.model, hf_config=hf_config),
                vocab_size=int(hf_config.vocab_size),
            )
        else:
            self.tokenizer = engine_tokenizer(self.config)
            self.input_processor = InputProcessor(
                self.tokenizer, self.config, eos_token_ids(self.tokenizer, self.config.model)
            )
        #: the model's recommended sampling values (``generation_config``), the defaults of
        #: :meth:`get_default_sampling_params` (read first: a bad file fails before loading)
        self.sampling_defaults = generation_defaults(
            self.config.generation_config,
            self.config.model,
            self.config.override_generation_config,
        )
        #: chat messages' image parts (a bad allowed_local_media_path fails here, before the
        #: model loads)
        self._chat_images = ChatImages(self.input_processor.multimodal, *media_loaders(self.config))
        # Stat loggers only when asked for (stat_loggers=[...]): batch jobs log no stats by
        # default, as vLLM's LLM. Names are resolved before the model loads (fail fast).
        stat_logger_factories = resolve_stat_loggers(self.config.stat_loggers or [])
        self.engine = EngineCore(self.config)
        self.input_processor.lora_target_shapes = self.engine.info.lora_target_shapes
        self._shut_down = False
        try:
            self._stat_loggers = StatLoggerManager(
                stat_logger_factories,
                StatLoggerInfo(self.config.served_model_name, self.config, self.engine.info),
                self.config.stat_log_interval,
            )
        except BaseException:
            # a logger that cannot start fails the constructor: the caller gets no LLM to
            # shut down, so the engine (and its tensor-parallel workers) stops here
            self.engine.shutdown()
            raise

    def get_default_sampling_params(self) -> SamplingParams:
        """The params :meth:`generate` and :meth:`chat` use when given none: the engine's
        defaults with the model's recommended values (``generation_config``, as in vLLM)."""
        return SamplingParams(**self.sampling_defaults)

    @property
    def stat_loggers(self) -> list[Any]:
        """The running stat loggers (``stat_loggers=[...]``; none by default)."""
        return self._stat_loggers.loggers

    def get_tokenizer(self) -> Any:
        """The tokenizer (``None`` with ``skip_tokenizer_init``)."""
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's worker processes now (with ``tensor_parallel_size`` above 1;
        otherwise they stop with this process). The ``LLM`` cannot generate afterwards: a
        ``RuntimeError`` says so."""
        self._shut_down = True
        self.engine.shutdown()
        self._stat_loggers.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``LLM.reset_prefix_cache``): the next
        :meth:`generate` computes its prompts from scratch, as on a fresh engine, until their
        blocks are cached again. ``True`` once done; a no-op with prefix caching off."""
        if self._shut_down:
            raise RuntimeError("this LLM was shut down; create a new one")
        return self.engine.reset_prefix_cache()

    # -- sleep mode (docs/serving.md, "Sleep mode") -----------------------------------------

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free the engine's memory while it is idle (vLLM's ``LLM.sleep``; needs
        ``enable_sleep_mode=True``): level 1 moves the weights to host memory (on the CPU
        they stay where they are) and frees the KV cache, forgetting the prefix cache; level
        2 frees the weights too. :meth:`wake_up` brings them back; generating before that
        raises :class:`~chassis.core.errors.EngineSleepingError`. Requests added to the
        engine and not finished (only possible by stepping ``self.engine`` by hand) are
        aborted (``mode="abort"``), or the sleep waits until the steps that finish them
        (``"wait"``), or is refused with ``EngineBusyError`` (``"keep"``). ``ValueError``
        without sleep mode or for another level or mode."""
        self._refuse_if_shut_down()
        self.engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what :meth:`sleep` freed: ``tags`` names the parts, ``"weights"`` and
        ``"kv_cache"`` (``None``: both), in any order over several calls (wake the weights,
        update them, then the KV cache). Weights freed at level 2 are loaded from the
        checkpoint again. ``ValueError`` for another tag or without sleep mode."""
        self._refuse_if_shut_down()
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether any part of the engine sleeps (the weights or the KV cache)."""
        return self.engine.is_sleeping()

    def _refuse_if_shut_down(self) -> None:
        if self._shut_down:
            raise RuntimeError("this LLM was shut down; create a new one")

    def _refuse_if_asleep(self) -> None:
        """:class:`EngineSleepingError` while any part of the engine sleeps."""
        if self.engine.is_sleeping():
            raise EngineSleepingError(sleeping_message(self.engine.sleeping_tags()))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``.

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}`` /
        ``{"prompt": "..."}``, which may also carry vLLM's ``"cache_salt"`` (the prompt's
        prefix-cache entries are then shared only with prompts of the same salt), and, for a
        model that takes images, vLLM's ``"multi_modal_data": {"image": image or [images]}``
        (``PIL.Image.Image``; one placeholder per image in the prompt, in order: Qwen2-VL's
        ``<|vision_start|><|image_pad|><|vision_end|>``) and ``"mm_processor_kwargs"``
        (Qwen2-VL: ``min_pixels``, ``max_pixels``). With ``enable_prompt_embeds=True`` a
        prompt may be vLLM's ``{"prompt_embeds": tensor}`` (``[seq_len, hidden_size]``
        input embeddings; core/prompt_embeds.py), mixed freely with text prompts.
        ``lora_request`` (with ``enable_lora=True``): the LoRA adapter of every prompt, or
        one per prompt (``None``: the base model). Text holding a lone UTF-16 surrogate
        (``"\\ud800"``, which no tokenizer encodes) raises ``ValueError`` naming the prompt
        (``prompts.1``), as every method taking text prompts does.
        """
        self._refuse_if_shut_down()
        self._refuse_if_asleep()
        if self.pooler_config is not None:
            raise ValueError(
                "this LLM runs a pooling model (runner='pooling'): use embed() (or classify() "
                "and score() for a classification model); generate() and chat() need a "
                "generating model (runner='generate', or 'auto' for a *ForCausalLM checkpoint)"
            )
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _per_prompt(
            sampling_params,
            isinstance(sampling_params, SamplingParams),
            len(prompt_list),
            "sampling params",
        )
        priorities = _priorities(priority, len(prompt_list))
        loras = _loras(lora_request, len(prompt_list))
        output_processor = OutputProcessor(self.tokenizer)
        order: list[str] = []
        batch_tag = uuid.uuid4().hex[:8]
        # Validate (and tokenize) everything before anything is queued: bad input loses nothing.
        prepared = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
            request_id = f"{batch_tag}-{i}"
            arrival = time.time()
            requests = self.input_processor.process(
                _prompt_input(prompt, multimodal=True),
                params,
                request_id,
                priorities[i],
                arrival,
                lora_request=loras[i],
                cache_salt=prompt.get("cache_salt") if isinstance(prompt, dict) else None,
                **_multimodal_kwargs(prompt),
            )
            prepared.append((request_id, prompt, params, requests, arrival))
        for request_id, prompt, params, requests, arrival in prepared:
            output_processor.add_request(
                request_id,
                _prompt_text(prompt),
                requests[0].prompt_token_ids,
                params,
                [r.request_id for r in requests],
                arrival,
                False,
                final_only=True,
            )
            for request in requests:
                self.engine.add_request(request)
            order.append(request_id)

        results = self._run_engine(output_processor, len(order), use_tqdm)
        return [results[request_id] for request_id in order]

    def _run_engine(
        self, output_processor: OutputProcessor, num_requests: int, use_tqdm: bool
    ) -> dict[str, Any]:
        """Step the engine until it has nothing left; every request's final output by id
        (a progress bar over ``num_requests`` with ``use_tqdm``). Each step's stats go to
        the stat loggers, and the requests a stop string finished are aborted in the engine."""
        results: dict[str, Any] = {}
        progress = _progress(num_requests) if use_tqdm else None
        while self.engine.has_unfinished():
            step = self.engine.step()
            processed = output_processor.process_outputs(step)
            if step.stats is not None:
                self._stat_loggers.record(step.stats, processed.iteration_stats)
            if processed.request_ids_to_abort:
                self.engine.abort_requests(processed.request_ids_to_abort)
            for output in processed.request_outputs:
                if output.finished:  # (a pooling request's only output is final)
                    results[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return results

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: one :class:`BeamSearchOutput` per prompt, its
        ``sequences`` best first (the rules: :mod:`chassis.core.beam_search`).

        Prompts (a dict's ``"cache_salt"`` too, given to every step request) and
        ``lora_request`` as in :meth:`generate`. Each step runs every live beam
        of (up to ``concurrency_limit``) prompts as one batch of one-token requests. A
        sequence's ``tokens`` and ``text`` include the prompt, as in vLLM. Bad input raises
        ``ValueError`` before anything runs.
        """
        self._refuse_if_shut_down()
        self._refuse_if_asleep()
        prompt_list = _as_prompt_list(prompts)
        loras = _loras(lora_request, len(prompt_list))
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
        step_params = step_sampling_params(
            params, self.input_processor.vocab_size, self.config.max_logprobs
        )
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompt_list]
        token_prompts = []
        for prompt in prompt_list:
            prompt_input = _prompt_input(prompt)
            ids = (
                self.input_processor.tokenize(prompt_input)
                if isinstance(prompt_input, str)
                else list(prompt_input)
            )
            check_prompt_fits(len(ids), params.max_tokens, self.input_processor.max_model_len)
            token_prompts.append(ids)
        chunk = concurrency_limit or max(1, len(token_prompts))
        outputs: list[BeamSearchOutput] = []
        for start in range(0, len(token_prompts), chunk):
            part = range(start, min(start + chunk, len(token_prompts)))

            def step(beams: list[BeamStep], part: range = part) -> list[PositionLogprobs | None]:
                results = self.generate(
                    [_salted(beam.token_ids, salts[part[beam.prompt_index]]) for beam in beams],
                    step_params,
                    lora_request=[loras[part[beam.prompt_index]] for beam in beams],
                )
                return [step_logprobs(result) for result in results]

            search = BeamSearch(
                [token_prompts[i] for i in part], params, self.input_processor.eos_token_ids
            )
            progress = _progress(params.max_tokens, "beam search", "step") if use_tqdm else None
            outputs += run_beam_search(search, step, progress.update if progress else None)
            if progress is not None:
                progress.close()
        for output in outputs:
            for sequence in output.sequences:
                sequence.text = sequence_text(
                    self.tokenizer, sequence, params.include_stop_str_in_output
                )
        return outputs

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (vLLM's ``LLM.embed``), in the order of ``prompts``.

        Needs ``LLM(model, runner="pooling")``. A prompt is a string, a list of token ids, or
        ``{"prompt_token_ids": [...]}``; ``pooling_params`` apply to every prompt or give one
        per prompt (``dimensions`` for Matryoshka models, ``normalize``,
        ``truncate_prompt_tokens``, which the keyword argument of that name sets for all).
        ``lora_request`` (with ``enable_lora=True``): the LoRA adapter of every prompt, or one
        per prompt (``None``: the base model), as in :meth:`generate`.
        Everything is validated before anything runs; bad input raises ``ValueError``. A
        prompt the engine core refuses (its LoRA adapter cannot be loaded any more, say)
        raises :class:`~chassis.core.errors.RequestFailedError` with its reason once the
        batch has run.
        """
        if self.pooler_config is None:
            raise ValueError(
                "embed() needs a pooling engine: create the LLM with runner='pooling' (or "
                "task='embed'); this one generates (use generate() or chat())"
            )
        assert self.embedding_info is not None  # set for every pooling engine
        if self.embedding_info.classifier is not None:
            raise ValueError(
                "embed() needs an embedding model; this LLM runs a sequence-classification "
                "model: use classify() (class probabilities) or, for a one-label "
                "cross-encoder, score()"
            )
        return self._pool(
            prompts,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            priority=priority,
            lora_request=lora_request,
        )

    def _pool(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        normalize: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Run every prompt through the pooling engine (with its LoRA adapter, one or one per
        prompt); its pooled vectors in order (``normalize``, when given, overrides every
        prompt's params)."""
        self._refuse_if_shut_down()
        self._refuse_if_asleep()
        assert self.embedding_info is not None  # set for every pooling engine
        prompt_list = _as_prompt_list(prompts)
        params = pooling_params if pooling_params is not None else PoolingParams()
        if not isinstance(params, PoolingParams | Sequence):
            # (a SamplingParams, say: a pooling request is not sampled)
            raise ValueError(
                "pooling_params must be a PoolingParams or a list of them (dimensions, "
                f"normalize, truncate_prompt_tokens); got {type(params).__name__}"
            )
        params_list = _per_prompt(
            params, isinstance(params, PoolingParams), len(prompt_list), "pooling params"
        )
        if truncate_prompt_tokens is not None:
            params_list = [
                p.clone(truncate_prompt_tokens=truncate_prompt_tokens) for p in params_list
            ]
        if normalize is not None:
            params_list = [p.clone(normalize=normalize) for p in params_list]
        priorities = _priorities(priority, len(prompt_list))
        loras = _loras(lora_request, len(prompt_list))
        batch_tag = uuid.uuid4().hex[:8]
        requests = [
            process_pooling(
                self.input_processor,
                self.embedding_info,
                _prompt_input(prompt),
                p,
                f"{batch_tag}-{i}",
                priorities[i],
                lora_request=loras[i],
            )
            for i, (prompt, p) in enumerate(zip(prompt_list, params_list, strict=True))
        ]
        output_processor = OutputProcessor(self.tokenizer)
        for prompt, request in zip(prompt_list, requests, strict=True):
            output_processor.add_pooling_request(
                request.request_id,
                _prompt_text(prompt),
                request.prompt_token_ids,
                request.arrival_time,
            )
            self.engine.add_request(request)
        results = self._run_engine(output_processor, len(requests), use_tqdm)
        refused = [r for r in results.values() if not r.outputs.embedding]
        if refused:
            if refused[0].error is not None:  # the engine core said why
                raise RequestFailedError(refused[0].error)
            raise RuntimeError(f"the engine refused request {refused[0].request_id!r} (see log)")
        return [results[request.request_id] for request in requests]

    def score(
        self,
        data_1: Prompt | Sequence[Prompt],
        data_2: Prompt | Sequence[Prompt],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: one output per pair in order, ``outputs.score`` its score.

        Embedding models (bi-encoder): the cosine similarity of each pair's embeddings, each
        distinct prompt embedded once with ``pooling_params`` (and
        ``truncate_prompt_tokens``). Sequence classifiers with one label (cross-encoders,
        rerankers): each pair read as one sequence (the tokenizer's pair encoding of two
        texts, see :func:`~chassis.core.pooling_classify.cross_encoder_token_ids`; token ids
        are concatenated), its logit through the model's score activation (sigmoid unless
        the checkpoint names another; ``PoolingParams(use_activation=False)``: the raw
        logit). Pairs are 1:1, 1:N (``data_1`` one prompt, scored against every ``data_2``
        prompt) or N:N (position by position); prompts as in :meth:`embed`. ``lora_request``
        (with ``enable_lora=True``): the LoRA adapter of every pair, or one per pair (both
        of a pair's texts are embedded with it; ``None``: the base model). Needs
        ``runner="pooling"``. Bad input raises ``ValueError`` before anything runs.
        """
        if self.pooler_config is None:
            raise ValueError(
                "score() needs a pooling engine (runner='pooling') running an embedding model "
                "(bi-encoder scoring: the cosine of the two texts' embeddings) or a one-label "
                "sequence-classification model (a cross-encoder); this LLM generates"
            )
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            # (texts are embedded once each, so per-prompt params would not line up)
            raise ValueError(
                "score() takes one PoolingParams for every text (or None); got "
                f"{type(pooling_params).__name__}"
            )
        firsts, seconds = _as_prompt_list(data_1, "data_1"), _as_prompt_list(data_2, "data_2")
        pairs = score_pairs(len(firsts), len(seconds))
        if isinstance(lora_request, Sequence) and len(lora_request) != len(pairs):
            raise ValueError(
                f"score() takes one LoRA request for every pair or one per pair; got "
                f"{len(lora_request)} for {len(pairs)} pairs"
            )
        loras = _loras(lora_request, len(pairs))
        assert self.embedding_info is not None  # set for every pooling engine
        if self.embedding_info.classifier is not None:
            return self._cross_encoder_score(
                [(firsts[i], seconds[j]) for i, j in pairs],
                pooling_params,
                truncate_prompt_tokens,
                use_tqdm,
                loras,
            )
        # each pair's two texts, with the pair's adapter; a text is embedded once per adapter
        prompts = [firsts[i] for i, _ in pairs] + [seconds[j] for _, j in pairs]
        prompt_loras = loras + loras
        # keyed by the whole adapter, not its id: two adapters under one id are both checked
        # (and refused), never merged into one embedding
        keys = [
            (_score_key(p, k), lora)
            for k, (p, lora) in enumerate(zip(prompts, prompt_loras, strict=True))
        ]
        unique, where = distinct(list(zip(prompts, prompt_loras, strict=True)), keys)
        embeddings = self.embed(
            [prompt for prompt, _ in unique],
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            lora_request=[lora for _, lora in unique],
        )
        offset = len(pairs)
        return score_outputs(
            [(embeddings[where[k]], embeddings[where[offset + k]]) for k in range(len(pairs))],
            getattr(self.tokenizer, "pad_token_id", None),
        )

    def _cross_encoder_score(
        self,
        pairs: list[tuple[Prompt, Prompt]],
        pooling_params: PoolingParams | None,
        truncate_prompt_tokens: int | None,
        use_tqdm: bool,
        loras: list[LoRARequest | None],
    ) -> list[ScoringRequestOutput]:
        """Score each pair as one sequence through a one-label classifier, with its LoRA
        adapter (see :meth:`score`)."""
        info = self.embedding_info
        assert info is not None and info.classifier is not None and self.pooler_config
        info.classifier.check_cross_encoder(info.model_name)
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = params.clone(truncate_prompt_tokens=truncate_prompt_tokens)
        keep = truncation_length(params.truncate_prompt_tokens, self.input_processor.max_model_len)
        sequences = [
            cross_encoder_token_ids(self.tokenizer, _prompt_input(a), _prompt_input(b), keep)
            for a, b in pairs
        ]
        outputs = self._pool(
            sequences, params, use_tqdm=use_tqdm, normalize=False, lora_request=loras
        )
        activation = (
            info.classifier.score_activation if self._use_activation(params) else "identity"
        )
        return [
            ScoringRequestOutput(
                request_id=out.request_id,
                outputs=ScoringOutput(score=apply_activation(out.outputs.embedding, activation)[0]),
                prompt_token_ids=list(out.prompt_token_ids),
            )
            for out in outputs
        ]

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (vLLM's ``LLM.classify``), in the order of
        ``prompts``: ``outputs.probs`` (``num_classes`` of them) are the
        ``*ForSequenceClassification`` model's logits through its activation (softmax;
        sigmoid for one label or multi-label models; none for regression), or the raw logits
        with ``PoolingParams(use_activation=False)`` or ``pooler_config={"use_activation":
        False}``. Prompts, ``pooling_params`` (one or one per prompt),
        ``truncate_prompt_tokens``, ``priority`` and ``lora_request`` (adapters of the decoder's
        projections; the ``score`` head is the base model's) as in :meth:`embed`. The labels'
        names are :attr:`classification_labels`. Bad input raises ``ValueError`` before
        anything runs.
        """
        info = self.embedding_info
        if self.pooler_config is None or info is None or info.classifier is None:
            raise ValueError(
                "classify() needs a sequence-classification model (a *ForSequenceClassification "
                "checkpoint, run with runner='pooling' or 'auto'); this LLM runs "
                + ("an embedding model: use embed()" if info is not None else "a generating one")
            )
        prompt_list = _as_prompt_list(prompts)
        outputs = self._pool(
            prompt_list,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            priority=priority,
            normalize=False,
            lora_request=lora_request,
        )
        params_list = _per_prompt(
            pooling_params or PoolingParams(),
            not isinstance(pooling_params, Sequence),
            len(prompt_list),
            "pooling params",
        )
        results = []
        for out, params in zip(outputs, params_list, strict=True):
            activation = info.classifier.activation if self._use_activation(params) else "identity"
            results.append(
                ClassificationRequestOutput(
                    request_id=out.request_id,
                    outputs=ClassificationOutput(
                        apply_activation(out.outputs.embedding, activation)
                    ),
                    prompt_token_ids=list(out.prompt_token_ids),
                )
            )
        return results

    def _use_activation(self, params: PoolingParams) -> bool:
        """Whether a classifier's output goes through its activation: the request's
        ``use_activation``, else the engine's ``pooler_config``."""
        assert self.pooler_config is not None
        if params.use_activation is not None:
            return params.use_activation
        return self.pooler_config.use_activation

    @property
    def classification_labels(self) -> list[str] | None:
        """A sequence classifier's class labels (``id2label``, in order); ``None`` for
        other models."""
        info = self.embedding_info
        if info is None or info.classifier is None:
            return None
        return list(info.classifier.labels)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation, then :meth:`generate`.

        As vLLM's ``LLM.chat`` (and the server's chat route, which renders the same way,
        :mod:`chassis.core.chat`): content may be a string or a list of text parts, and for a
        model that takes images image parts, ``{"type": "image_url", "image_url": {"url":
        ...}}`` (a data, http(s) or, under ``allowed_local_media_path``, file URL) or
        ``{"type": "image_pil", "image_pil": image}``, and for Qwen2-VL / Qwen2.5-VL video
        parts, ``{"type": "video_url", "video_url": {"url": ...}}`` (the same kinds of URL,
        decoded with PyAV, 32 frames sampled: :mod:`chassis.core.chat_media`);
        ``chat_template`` (a file path or inline Jinja) overrides the model's;
        ``chat_template_content_format`` is the shape of the content the template gets:
        ``"string"`` (text parts joined), ``"openai"`` (a list of text parts) or ``"auto"``
        (detected from the template, :mod:`chassis.core.chat_content_format`);
        ``continue_final_message`` continues the last assistant message instead of starting a
        new turn; ``tools`` and ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``
        for Qwen3) reach the template; ``lora_request`` as in :meth:`generate`;
        ``mm_processor_kwargs`` apply to the images and videos of every conversation. A
        message or conversation the template cannot take, or text holding a lone UTF-16
        surrogate (no tokenizer encodes it; the error names the message), raises
        ``ValueError``.
        """
        if self.tokenizer is None:
            raise ValueError(
                "chat needs a tokenizer, and this LLM was created with skip_tokenizer_init"
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        # text the tokenizer cannot encode fails here, named (messages.0.content), not as
        # the tokenizer's TypeError after the template ran
        for i, conversation in enumerate(conversations):
            refuse_lone_surrogates(
                conversation, "messages" if len(conversations) == 1 else f"messages.{i}"
            )
        refuse_lone_surrogates(tools, "tools")
        refuse_lone_surrogates(chat_template_kwargs, "chat_template_kwargs")
        check_content_format(chat_template_content_format)
        template = load_chat_template(chat_template or self.config.chat_template)
        prompts: list[Prompt] = []
        for conversation in conversations:
            media = self._chat_images.extract_media(conversation)
            text = render_chat(
                self.tokenizer,
                media.messages,
                chat_template=template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                content_format=chat_template_content_format,
                image_placeholder=media.image_placeholder,
                video_placeholder=media.video_placeholder,
                audio_placeholder=media.audio_placeholder,
            )
            # The template already contains the special tokens it needs.
            prompt: dict[str, Any] = {
                "prompt_token_ids": self.tokenizer(text, add_special_tokens=False).input_ids,
                "prompt": text,
            }
            multi_modal_data = media.multi_modal_data()
            if multi_modal_data:
                prompt["multi_modal_data"] = multi_modal_data
                if mm_processor_kwargs:
                    prompt["mm_processor_kwargs"] = mm_processor_kwargs
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)


def _pooling_kwargs(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``engine_kwargs`` with vLLM's older spellings mapped: ``task`` to ``runner``,
    ``override_pooler_config`` to ``pooler_config``, a ``PoolerConfig`` to its dict."""
    kwargs = dict(engine_kwargs)
    task = kwargs.pop("task", None)
    if task is not None:
        if task not in _TASK_RUNNERS:
            raise ValueError(
                f"task={task!r} is not supported; use {', '.join(map(repr, _TASK_RUNNERS))} "
                "(or runner='generate' / runner='pooling')"
            )
        runner = _TASK_RUNNERS[task]
        given = kwargs.get("runner", "auto")
        if runner is not None and given not in ("auto", runner):
            raise ValueError(f"task={task!r} and runner={given!r} disagree; give one")
        if runner is not None:
            kwargs["runner"] = runner
    if "override_pooler_config" in kwargs:
        if kwargs.get("pooler_config") is not None:
            raise ValueError("give pooler_config or override_pooler_config, not both")
        kwargs["pooler_config"] = kwargs.pop("override_pooler_config")
    if isinstance(kwargs.get("pooler_config"), PoolerConfig):
        kwargs["pooler_config"] = kwargs["pooler_config"].as_dict()
    return kwargs


def _per_prompt(value: Any, is_one: bool, num_prompts: int, what: str) -> list[Any]:
    """One ``value`` per prompt: ``value`` repeated when ``is_one`` (it applies to every
    prompt), else its items, which must be ``num_prompts`` (a ``ValueError`` naming
    ``what``)."""
    values = [value] * num_prompts if is_one else list(value)
    if len(values) != num_prompts:
        raise ValueError(f"got {len(values)} {what} for {num_prompts} prompts")
    return values


def _priorities(priority: Sequence[int] | None, num_prompts: int) -> list[int]:
    """Each prompt's priority (0 for every prompt when ``None``)."""
    return _per_prompt(
        0 if priority is None else priority, priority is None, num_prompts, "priorities"
    )


def _loras(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """Each prompt's LoRA adapter: ``lora_request`` for all, or one per prompt."""
    return _per_prompt(
        lora_request, not isinstance(lora_request, Sequence), num_prompts, "LoRA requests"
    )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt], name: str = "prompts") -> list[Prompt]:
    """``prompts`` as a list (one prompt alone becomes a list of one); a ``ValueError``
    naming the first text holding a lone surrogate (``prompts.1``, ``prompt.prompt`` for a
    dict prompt alone), which the tokenizer cannot encode (core/lone_surrogates.py)."""
    if isinstance(prompts, str | dict):
        refuse_lone_surrogates(prompts, name.removesuffix("s"))
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # a single list of token ids
    refuse_lone_surrogates(prompts, name)
    return prompts


def _score_key(prompt: Prompt, position: int) -> tuple[str, Any]:
    """What makes two prompts the same input (score embeds each distinct one once). A prompt
    that is neither text nor token ids keys by its ``position`` (never merged), so that
    ``embed`` refuses it with its own ``ValueError``."""
    value = _prompt_input(prompt)
    if isinstance(value, str):
        return ("text", value)
    if isinstance(value, list) and all(isinstance(t, int) for t in value):
        return ("ids", tuple(value))
    return ("position", position)


def _salted(token_ids: list[int], cache_salt: str | None) -> dict[str, Any]:
    """A token-id prompt dict, with its ``cache_salt`` when there is one."""
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def _prompt_input(prompt: Prompt, *, multimodal: bool = False) -> str | list[int] | EmbedsPrompt:
    """A prompt's text or token ids, or for ``{"prompt_embeds": tensor}`` its
    :class:`EmbedsPrompt`; a dict prompt carrying ``multi_modal_data`` or ``prompt_embeds``
    is a ``ValueError`` unless ``multimodal`` (the caller takes them: :meth:`LLM.generate`)."""
    if isinstance(prompt, dict):
        if not multimodal and prompt.get("multi_modal_data") is not None:
            raise ValueError(
                "multi_modal_data (images, videos, audio) is taken by generate() and chat() "
                "only; this call runs text prompts"
            )
        if "prompt_embeds" in prompt:
            if not multimodal:
                raise ValueError("prompt_embeds is taken by generate() only")
            if "prompt_token_ids" in prompt:
                raise ValueError("a prompt takes prompt_embeds or prompt_token_ids, not both")
            return EmbedsPrompt(prompt["prompt_embeds"])
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return str(prompt["prompt"])
        raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
    return prompt


def _multimodal_kwargs(prompt: Prompt) -> dict[str, Any]:
    """A dict prompt's ``multi_modal_data`` and ``mm_processor_kwargs`` (vLLM's keys), as
    :meth:`InputProcessor.process` takes them; none for other prompts."""
    if not isinstance(prompt, dict):
        return {}
    return {
        "multi_modal_data": prompt.get("multi_modal_data"),
        "mm_processor_kwargs": prompt.get("mm_processor_kwargs"),
    }


def _prompt_text(prompt: Prompt) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


def _progress(total: int, desc: str = "requests", unit: str = "req") -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit)
