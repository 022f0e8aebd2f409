"""``LLM``: offline batch inference with the engine core in this process (vLLM's API)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from chassis.core.chat import render_chat
from chassis.core.config import EngineConfig
from chassis.core.engine_core import EngineCore
from chassis.core.engine_setup import finalize_config
from chassis.core.generation_defaults import generation_defaults
from chassis.core.input_processor import InputProcessor
from chassis.core.lora.request import LoRARequest
from chassis.core.output_processor import OutputProcessor
from chassis.core.outputs import RequestOutput
from chassis.core.sampling_params import SamplingParams
from chassis.core.tokenizer import eos_token_ids, load_chat_template, load_tokenizer

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Generate for many prompts at once; ``LLM(model, **engine settings)``.

    ``model`` is a hub id, a local HF directory, or ``None`` for the embedded default. Other
    keyword arguments are :class:`EngineConfig` fields (``max_model_len``, ``dtype``,
    ``enable_prefix_caching``, ``max_num_batched_tokens``, ``scheduler``, ...). With
    ``skip_tokenizer_init=True`` no tokenizer is loaded: prompts must be token ids and
    outputs carry token ids with empty text.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **engine_kwargs)
        hf_config = finalize_config(self.config)
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
            self.tokenizer = load_tokenizer(self.config.tokenizer)
            self.input_processor = InputProcessor(
                self.tokenizer, self.config, eos_token_ids(self.tokenizer, self.config.model)
            )
        #: the model's recommended sampling values (``generation_config``), the defaults of
        #: :meth:`get_default_sampling_params` (read first: a bad file fails before loading)
        self.sampling_defaults = generation_defaults(
            self.config.generation_config, self.config.model
        )
        self.engine = EngineCore(self.config)
        self.input_processor.lora_target_shapes = self.engine.info.lora_target_shapes
        self._shut_down = False

    def get_default_sampling_params(self) -> SamplingParams:
        """The params :meth:`generate` and :meth:`chat` use when given none: the engine's
        defaults with the model's recommended values (``generation_config``, as in vLLM)."""
        return SamplingParams(**self.sampling_defaults)

    def get_tokenizer(self) -> Any:
        """The tokenizer (``None`` with ``skip_tokenizer_init``)."""
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's worker processes now (with ``tensor_parallel_size`` above 1;
        otherwise they stop with this process). The ``LLM`` cannot generate afterwards: a
        ``RuntimeError`` says so."""
        self._shut_down = True
        self.engine.shutdown()

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

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}``.
        ``lora_request`` (with ``enable_lora=True``): the LoRA adapter of every prompt, or
        one per prompt (``None``: the base model).
        """
        if self._shut_down:
            raise RuntimeError("this LLM was shut down; create a new one")
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(
                f"got {len(params_list)} sampling params for {len(prompt_list)} prompts"
            )
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        loras = (
            list(lora_request)
            if isinstance(lora_request, Sequence)
            else [lora_request] * len(prompt_list)
        )
        if len(loras) != len(prompt_list):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompt_list)} prompts")
        output_processor = OutputProcessor(self.tokenizer)
        order: list[str] = []
        batch_tag = uuid.uuid4().hex[:8]
        # Validate (and tokenize) everything before anything is queued: bad input loses nothing.
        prepared = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
            request_id = f"{batch_tag}-{i}"
            arrival = time.time()
            requests = self.input_processor.process(
                _prompt_input(prompt),
                params,
                request_id,
                priorities[i],
                arrival,
                lora_request=loras[i],
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

        results: dict[str, RequestOutput] = {}
        progress = _progress(len(order)) if use_tqdm else None
        while self.engine.has_unfinished():
            processed = output_processor.process_outputs(self.engine.step())
            if processed.request_ids_to_abort:
                self.engine.abort_requests(processed.request_ids_to_abort)
            for output in processed.request_outputs:
                if output.finished:
                    results[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [results[request_id] for request_id in order]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation, then :meth:`generate`.

        As vLLM's ``LLM.chat`` (and the server's chat route, which renders the same way,
        :mod:`chassis.core.chat`): content may be a string or a list of text parts;
        ``chat_template`` (a file path or inline Jinja) overrides the model's;
        ``continue_final_message`` continues the last assistant message instead of starting a
        new turn; ``tools`` and ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``
        for Qwen3) reach the template; ``lora_request`` as in :meth:`generate`. A message or
        conversation the template cannot take raises ``ValueError``.
        """
        if self.tokenizer is None:
            raise ValueError(
                "chat needs a tokenizer, and this LLM was created with skip_tokenizer_init"
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = load_chat_template(chat_template or self.config.chat_template)
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = render_chat(
                self.tokenizer,
                conversation,
                chat_template=template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            # The template already contains the special tokens it needs.
            prompts.append(
                {
                    "prompt_token_ids": self.tokenizer(text, add_special_tokens=False).input_ids,
                    "prompt": text,
                }
            )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # a single list of token ids
    return prompts


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return str(prompt["prompt"])
        raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
    return prompt


def _prompt_text(prompt: Prompt) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
