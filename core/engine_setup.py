"""Turning the user's settings into the final ``EngineConfig`` (in the front-end process)."""

from __future__ import annotations

import logging
from typing import Any

from chassis.core.config import DEFAULT_MODEL, EngineConfig

logger = logging.getLogger(__name__)


def finalize_config(config: EngineConfig) -> Any:
    """Resolve the model, derive defaults, validate names, let plugins adjust; return hf_config.

    After this ``config.model`` is a local directory, ``max_model_len`` and
    ``attention_backend`` are set, and every name (scheduler, sampler, backend, architecture)
    is known to the registries. Errors are ``ValueError`` with the known alternatives.
    """
    from chassis.core.encoder_only import apply_encoder_only_settings
    from chassis.core.model_loader import (
        engine_hf_config,
        model_class,
        model_max_len,
        resolve_model_path,
    )
    from chassis.core.pooling_classify import resolve_runner
    from chassis.core.quantized_weights import check_quantization, check_quantization_flag
    from chassis.core.request_state_cache import apply_recurrent_state_settings
    from chassis.platforms import get_current_platform
    from chassis.plugins import apply_configure_hooks, get_plugin_manager, get_registries

    manager = get_plugin_manager()
    manager.load_general_plugins()
    platform = get_current_platform()
    registries = get_registries()

    if config.served_model_name is None:
        config.served_model_name = config.model or DEFAULT_MODEL
    config.model = str(
        resolve_model_path(config.model, config.revision, config.download_dir, config.load_format)
    )
    if config.tokenizer is None:
        config.tokenizer = config.model
    hf_config = engine_hf_config(config)  # with --hf-overrides
    max_model_len_given = config.max_model_len is not None
    architectures = list(getattr(hf_config, "architectures", None) or [])
    registered = any(a in registries.models for a in architectures)
    # (an unregistered architecture is refused below, after the length checks)
    model_cls = model_class(hf_config) if registered else None
    try:
        context_length = model_max_len(hf_config)
    except ValueError:
        # a config that states no length (Mamba2: a recurrence has no position limit) runs
        # as long as --max-model-len says; without it, the error asks for it
        if config.max_model_len is None:
            raise
        context_length = config.max_model_len
    own_length = getattr(model_cls, "context_length", None)
    if own_length is not None and (own := own_length(hf_config)) is not None:
        context_length = min(context_length, own)  # RoBERTa's position table starts at 2
    config.check_against_model(context_length)
    check_quantization(hf_config)  # an unreadable quantized checkpoint fails before loading
    check_quantization_flag(config.quantization, hf_config)

    if not registered:
        raise ValueError(
            f"model architecture(s) {architectures or '(none in config.json)'} not supported; "
            f"registered architectures: {', '.join(registries.models.names())}"
        )
    # vLLM's --runner auto: sequence classifiers pool, the others generate
    config.runner = resolve_runner(config.runner, architectures)
    # encoders (BERT, XLM-RoBERTa): whole prompts in one step, no prefix cache
    apply_encoder_only_settings(config, model_cls, max_model_len_given=max_model_len_given)
    # state-space models: no prefix caching, no speculative decoding
    apply_recurrent_state_settings(config, model_cls)
    config.validate()  # again: what a pooling (or generating) engine refuses
    if config.attention_backend is None:
        config.attention_backend = platform.default_attention_backend(config)
    # Unknown names fail here, in the front-end, with the list of known ones.
    registries.attention_backends.get(config.attention_backend)
    registries.schedulers.get(config.scheduler)
    sampler_cls = registries.samplers.get(config.sampler)
    if config.logits_processors:
        from chassis.core.logits_processor import check_logits_processors

        check_logits_processors(config.logits_processors, sampler_cls, config.sampler)
    registries.structured_output_backends.get(config.structured_output_backend)
    if config.reasoning_parser is not None:
        registries.reasoning_parsers.get(config.reasoning_parser)

    platform.check_and_update_config(config)
    apply_configure_hooks(config, manager)
    config.validate()
    logger.info(
        "engine config: model=%s platform=%s attention=%s scheduler=%s sampler=%s "
        "max_model_len=%d max_num_seqs=%d max_num_batched_tokens=%d prefix_caching=%s",
        config.model,
        platform.name,
        config.attention_backend,
        config.scheduler,
        config.sampler,
        config.max_model_len,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        config.enable_prefix_caching,
    )
    return hf_config
