"""From a model name to a loaded :class:`CausalLM`: locate, configure, build, fill weights.

The engine calls, in order: :func:`resolve_model_path`, :func:`load_hf_config`,
:func:`resolve_dtype`, :func:`model_max_len`, :func:`build_model`. Tokenizers are loaded by
:func:`chassis.core.tokenizer.load_tokenizer`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from chassis.core.bin_weights import BIN_WEIGHTS_GLOB, bin_weight_files
from chassis.core.config import DEFAULT_MODEL
from chassis.core.gguf_checkpoint import embedded_model_dir
from chassis.core.weights import iterate_checkpoint

if TYPE_CHECKING:
    from chassis.core.attention import AttentionBackend
    from chassis.core.config import EngineConfig
    from chassis.core.model_interface import CausalLM
    from chassis.platforms.interface import Platform

logger = logging.getLogger(__name__)

#: files fetched from the hub besides the weights: config (and a .bin shard index),
#: tokenizer, chat template
HUB_ALLOW_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
#: the weight files fetched from the hub, per kind (what core/weights.py reads of each)
HUB_WEIGHT_PATTERNS = {"safetensors": ["*.safetensors"], "pt": [BIN_WEIGHTS_GLOB]}

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

#: config fields that bound the context length, as different architectures name them
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_target_positions",  # an encoder-decoder's decoder (Whisper)
)


def resolve_model_path(
    model: str | os.PathLike[str] | None,
    revision: str | None = None,
    download_dir: str | None = None,
    load_format: str = "auto",
) -> Path:
    """Return a local directory holding the checkpoint named by ``model``.

    - ``None`` (or ``"SmolLM2-135M-Instruct"``): the embedded default model, converted once.
    - an existing local directory: itself (it must contain ``config.json``).
    - a ``.gguf`` file: converted once into a cached HF checkpoint (core/gguf_checkpoint.py).
    - otherwise a Hugging Face hub id, downloaded (or found in the HF cache, or in
      ``download_dir`` when given) at ``revision``: its config and tokenizer files and the
      weight files ``load_format`` reads (:func:`hub_weight_kinds`).

    Raises ``ValueError`` with what to do when none of these works.
    """
    if model is None or str(model) == DEFAULT_MODEL:
        return embedded_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json; is it an HF checkpoint?")
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        from chassis.core.gguf_checkpoint import gguf_model_dir

        return gguf_model_dir(path)
    if path.exists():
        raise ValueError(
            f"model {str(model)!r} is a file; name a checkpoint directory, a .gguf file or a hub id"
        )
    return _download(str(model), revision, download_dir, load_format)


def hub_weight_kinds(load_format: str) -> tuple[str, ...]:
    """The kinds of weight files (:data:`HUB_WEIGHT_PATTERNS` keys) a hub download fetches
    for ``load_format``, in order: the next kind is fetched only when the repository had no
    file of the one before. ``auto``: safetensors, else ``.bin`` (vLLM's choice); ``pt`` and
    ``safetensors``: that kind only; ``dummy``: safetensors, as before the other kinds existed
    (the weights are not read)."""
    if load_format == "pt":
        return ("pt",)
    if load_format == "auto":
        return ("safetensors", "pt")
    return ("safetensors",)


def _has_weights_of_kind(path: Path, kind: str) -> bool:
    if kind == "pt":
        return bool(bin_weight_files(path))
    return any(path.glob("*.safetensors"))


def _download(
    repo_id: str,
    revision: str | None,
    download_dir: str | None = None,
    load_format: str = "auto",
) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        for kind in hub_weight_kinds(load_format):
            # fetching one kind first, rather than listing the repository's files, also
            # works offline from the HF cache (the fallback's fetch is then a cache lookup)
            local = snapshot_download(
                repo_id=repo_id,
                revision=revision,
                allow_patterns=HUB_ALLOW_PATTERNS + HUB_WEIGHT_PATTERNS[kind],
                cache_dir=download_dir,
            )
            if _has_weights_of_kind(Path(local), kind):
                break
            logger.info("%s has no %s weights", repo_id, kind)
    except HFValidationError as exc:
        raise ValueError(
            f"model {repo_id!r} is neither an existing local directory nor a valid hub id "
            f"('org/name'): {exc}"
        ) from exc
    except GatedRepoError as exc:
        raise ValueError(
            f"model {repo_id!r} is gated on the Hugging Face hub: accept its licence and log in "
            "(`hf auth login` or HF_TOKEN)"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ValueError(
            f"model {repo_id!r} was not found on the Hugging Face hub (nor as a local directory)"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ValueError(f"model {repo_id!r} has no revision {revision!r}") from exc
    except LocalEntryNotFoundError as exc:
        raise ValueError(
            f"model {repo_id!r} is not a local directory and cannot be downloaded: the hub is "
            "unreachable (offline or HF_HUB_OFFLINE=1) and it is not in the HF cache; download "
            "it where there is network, or pass a local checkpoint directory"
        ) from exc
    path = Path(local)
    if not (path / "config.json").is_file():
        raise ValueError(f"hub model {repo_id!r} has no config.json; is it a transformers model?")
    return path


def load_hf_config(
    path: str | os.PathLike[str],
    overrides: Mapping[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """The checkpoint's ``transformers.PretrainedConfig`` (``AutoConfig``; the repository's
    own config code only with ``trust_remote_code``) with ``overrides`` applied
    (:func:`apply_hf_overrides`), or for a multimodal checkpoint its language model's
    (:func:`language_model_config`). A checkpoint directory whose
    ``config.json`` has no ``quantization_config`` but an older AWQ/GPTQ export's
    ``quantize_config.json`` or ``quant_config.json`` gets that file's as its
    ``quantization_config`` (:func:`~chassis.core.int_quant_config.checkpoint_int_config`,
    which also refuses sources that contradict each other)."""
    from transformers import AutoConfig

    from chassis.core.int_quant_config import checkpoint_int_config
    from chassis.core.quantized_weights import quantization_config

    hf_config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if overrides:
        apply_hf_overrides(hf_config, overrides)
    hf_config = language_model_config(hf_config)
    if Path(path).is_dir():
        stated = quantization_config(hf_config)
        found = checkpoint_int_config(path, stated)
        if stated is None and found is not None:
            hf_config.quantization_config = found
    return hf_config


def engine_hf_config(config: EngineConfig) -> Any:
    """The HF config the engine of ``config`` runs: ``config.model``'s with
    ``config.hf_overrides``. Every reader of the target model's config (the front-end, the
    engine core, each tensor-parallel rank) goes through here, so they all see one config."""
    assert config.model is not None
    return load_hf_config(config.model, config.hf_overrides, config.trust_remote_code)


def apply_hf_overrides(hf_config: Any, overrides: Mapping[str, Any]) -> None:
    """Apply ``--hf-overrides`` to ``hf_config`` in place, as vLLM does.

    A key whose value is not a dict is set on the config (``PretrainedConfig.update``: a
    key the config does not have yet becomes a new attribute). A dict value merges into
    the config's sub-config of that name (``text_config``, ...) key by key, recursively;
    any other dict-valued key (``rope_scaling``, ``rope_parameters``, ...) is replaced
    whole. transformers 5 folds ``rope_scaling`` and ``rope_theta`` into one dict,
    ``rope_parameters``, which is what the engine reads: a ``rope_theta`` override (of the
    config or of a sub-config) is written there too, and when a RoPE override leaves out
    ``rope_theta``, the checkpoint's is kept (a 4.x-style ``rope_scaling`` override would
    otherwise wipe it).
    """
    from transformers import PretrainedConfig

    if not isinstance(overrides, Mapping):
        raise ValueError(
            f"--hf-overrides must be a JSON object of config keys; got {type(overrides).__name__}"
        )
    overrides = copy.deepcopy(dict(overrides))  # the config keeps them: not the caller's
    # (config, its rope_theta before, its overrides) for the config and each sub-config
    # overridden
    thetas = [(hf_config, _rope_theta(hf_config), overrides)]
    flat = {k: v for k, v in overrides.items() if not isinstance(v, Mapping)}
    if flat:
        hf_config.update(flat)
    for key, value in overrides.items():
        if not isinstance(value, Mapping):
            continue
        current = getattr(hf_config, key, None)
        if isinstance(current, PretrainedConfig):
            thetas.append((current, _rope_theta(current), value))
            _merge_nested(current, value)
        else:
            setattr(hf_config, key, value)
    for config, theta, level in thetas:
        params = getattr(config, "rope_parameters", None)
        if not isinstance(params, dict):
            continue
        new_theta = level.get("rope_theta")
        if new_theta is not None and not isinstance(new_theta, Mapping):
            params["rope_theta"] = new_theta  # (set as an attribute only, it would be unread)
        elif theta is not None and params.get("rope_theta") is None:
            params["rope_theta"] = theta
    logger.debug("HF config overridden (--hf-overrides): %s", overrides)


def _rope_theta(hf_config: Any) -> float | None:
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return params["rope_theta"]
    return getattr(hf_config, "rope_theta", None)


def _merge_nested(target: Any, updates: Mapping[str, Any]) -> None:
    """Merge ``updates`` into a sub-config or dict: dict values into the dicts or objects
    already there, everything else set."""
    for key, value in updates.items():
        current = target.get(key) if isinstance(target, dict) else getattr(target, key, None)
        if isinstance(value, Mapping) and (
            isinstance(current, dict) or hasattr(current, "__dict__")
        ):
            _merge_nested(current, value)
        elif isinstance(target, dict):
            target[key] = value
        else:
            setattr(target, key, value)


def language_model_config(hf_config: Any) -> Any:
    """The config the engine builds from and sizes by.

    A multimodal checkpoint (its config has a ``text_config`` and no layer count of its
    own) is served as text only: the result is a copy of its ``text_config`` carrying the
    checkpoint's ``architectures`` (so the registry picks the class registered for the
    multimodal architecture, which knows where the language model's weights are; an
    unregistered one is the usual unknown-architecture error) and its declared dtype when
    the text config declares none. The checkpoint's ``tie_word_embeddings`` is kept as
    ``wrapper_tie_word_embeddings`` (for the classes whose transformers model ties by it),
    and becomes the copy's ``tie_word_embeddings`` when the text config has none (Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL). The checkpoint's ``vision_config`` and image token ids
    (:data:`_MULTIMODAL_FIELDS`) are copied over too, for the models that take images. Any
    other config is returned as it is.
    """
    text = getattr(hf_config, "text_config", None)
    if text is None or hasattr(hf_config, "num_hidden_layers"):
        return hf_config
    text = copy.deepcopy(text)
    text.architectures = list(getattr(hf_config, "architectures", None) or [])
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(hf_config, "dtype", None)
    wrapper_tie = getattr(hf_config, "tie_word_embeddings", None)
    text.wrapper_tie_word_embeddings = wrapper_tie
    if not hasattr(text, "tie_word_embeddings") and wrapper_tie is not None:
        text.tie_word_embeddings = bool(wrapper_tie)
    # what a model that takes images reads besides its language model's fields
    for name in _MULTIMODAL_FIELDS:
        value = getattr(hf_config, name, None)
        if value is not None and getattr(text, name, None) is None:
            setattr(text, name, copy.deepcopy(value))
    return text


#: the multimodal wrapper config's fields :func:`language_model_config` keeps on the text
#: config: the vision tower's config and the image placeholder tokens (Qwen2-VL's names);
#: LLaVA's feature selection and projector settings (and LLaVA-NeXT's tile grids)
_MULTIMODAL_FIELDS = (
    "vision_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "vision_feature_layer",
    "vision_feature_select_strategy",
    "projector_hidden_act",
    "multimodal_projector_bias",
    "image_grid_pinpoints",
    "vision_aspect_ratio",  # LLaVA-OneVision's grid cap
    "spatial_merge_size",  # Mistral 3's patch merge
    "mm_tokens_per_image",  # Gemma 3's image rows and its image frame's tokens
    "boi_token_id",
    "eoi_token_id",
    "downsample_ratio",  # InternVL's pixel shuffle
    "downsample_factor",  # Aya Vision's pixel shuffle and projector
    "adapter_layer_norm_eps",
    "scale_factor",  # Idefics3 / SmolVLM's pixel shuffle
    "alignment_intermediate_size",
    "audio_config",  # Qwen2-Audio's audio tower and its placeholder token
    "audio_token_id",
)


def checkpoint_dtype(hf_config: Any) -> torch.dtype:
    """The dtype the checkpoint declares (``dtype``/``torch_dtype``); float32 when it is silent."""
    declared = getattr(hf_config, "dtype", None)
    if declared is None:
        declared = hf_config.to_dict().get("torch_dtype") if hasattr(hf_config, "to_dict") else None
    if declared is None:
        return torch.float32
    if isinstance(declared, torch.dtype):
        return declared
    name = str(declared).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"the checkpoint declares an unsupported dtype {declared!r}")
    return DTYPE_NAMES[name]


def resolve_dtype(config_dtype: str, hf_config: Any, platform: Platform) -> torch.dtype:
    """The dtype to run in, from ``--dtype`` (``auto`` or a name) and the checkpoint.

    ``auto``: float32 checkpoints run in float32; 16-bit ones in ``platform.default_dtype()``.
    Raises ``ValueError`` for an unknown name or a dtype the platform does not support.
    """
    if config_dtype == "auto":
        stored = checkpoint_dtype(hf_config)
        dtype = torch.float32 if stored == torch.float32 else platform.default_dtype()
    elif config_dtype in DTYPE_NAMES:
        dtype = DTYPE_NAMES[config_dtype]
    else:
        raise ValueError(
            f"--dtype must be auto or one of {', '.join(DTYPE_NAMES)}; got {config_dtype!r}"
        )
    if dtype not in platform.supported_dtypes:
        supported = ", ".join(str(d).removeprefix("torch.") for d in platform.supported_dtypes)
        raise ValueError(
            f"dtype {str(dtype).removeprefix('torch.')} is not supported on the "
            f"{platform.name} platform; use --dtype with one of: {supported}"
        )
    return dtype


def model_max_len(hf_config: Any) -> int:
    """The model's context length: the smallest of the length limits its config states."""
    limits = [
        int(value)
        for key in _MAX_LEN_KEYS
        if isinstance(value := getattr(hf_config, key, None), int) and value > 0
    ]
    if not limits:
        raise ValueError(
            "the model config states no context length (max_position_embeddings); "
            "set --max-model-len"
        )
    return min(limits)


def build_model(
    engine_config: EngineConfig,
    hf_config: Any,
    model_path: str | os.PathLike[str],
    attention_backend_cls: type[AttentionBackend],
    device: torch.device | str,
    dtype: torch.dtype,
) -> CausalLM:
    """Construct the registered model class for the checkpoint on ``device`` and fill it.

    Weights come from ``model_path``'s ``*.safetensors`` or ``pytorch_model*.bin`` files, as
    ``engine_config.load_format`` picks (:func:`chassis.core.weights.iterate_checkpoint`;
    quantized ones dequantized, :mod:`chassis.core.quantized_weights`), or are random
    (``--load-format dummy``, seeded by ``engine_config.seed``). Raises ``ValueError`` when
    the architecture is not registered or a parameter was left unfilled.
    """
    from chassis.core.model_interface import ModelBuildContext

    model_cls = model_class(hf_config)
    build_ctx = ModelBuildContext(
        attention_backend=attention_backend_cls,
        dtype=dtype,
        max_model_len=engine_config.max_model_len,
    )
    dummy = engine_config.load_format == "dummy"
    int4_sources = None if dummy else _int4_sources(engine_config, hf_config)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_default_dtype(dtype))
        stack.enter_context(torch.device(device))
        if int4_sources is not None:
            from chassis.core.int4_streaming import deferred_linear_weights

            # 4-bit layers are packed one at a time as they load: their 16-bit weights are
            # allocated then, not here (core/int4_streaming.py)
            deferred = stack.enter_context(deferred_linear_weights())
        model = model_cls(hf_config, build_ctx)
    model.eval()
    if dummy:
        init_dummy_weights(model, engine_config.seed)
    else:
        from chassis.core.quantized_weights import dequantized_weights

        parameter_names = {name for name, _ in model.named_parameters()}
        weights = dequantized_weights(
            iterate_checkpoint(
                Path(model_path),
                engine_config.load_format,
                wanted=model.needs_checkpoint_tensor,
            ),
            hf_config,
            parameter_names,
            model.merged_projections,
            int4_sources.record if int4_sources is not None else None,
        )
        packer = None
        if int4_sources is not None:
            from chassis.core import parallel_state
            from chassis.core.int4_streaming import Int4StreamPacker, packed_checkpoint_modules

            packer = Int4StreamPacker(
                model,
                deferred,
                int4_sources,
                packed_checkpoint_modules(
                    Path(model_path), model.needs_checkpoint_tensor, engine_config.load_format
                ),
                model.merged_projections,
                parallel_state.tp_size(),
                parallel_state.tp_rank(),
            )
            weights = packer.stream(weights)
        loaded = model.load_weights(weights)
        missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (
                f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
            )
            raise ValueError(f"the checkpoint at {model_path} lacks weights for: {shown}")
        if packer is not None:
            logger.info("int4: %d linear layers keep their weights packed", packer.packed)
    return model


def _int4_sources(engine_config: EngineConfig, hf_config: Any) -> Any:
    """An :class:`~chassis.core.int4_packing.Int4Sources` to record a 4-bit AWQ/GPTQ
    checkpoint's packed tensors when its layers are to stay packed, else ``None`` (with the
    reason logged where packing was possible but is not done)."""
    from chassis.core.packed_int_weights import PACKED_INT_METHODS, packed_int_format
    from chassis.core.quantized_weights import quantization_config

    config = quantization_config(hf_config)
    if config is None or config.get("quant_method") not in PACKED_INT_METHODS:
        return None
    from chassis.core.int4_packing import Int4Sources, keeps_bits_packed, keeps_int4_packed

    if not keeps_int4_packed(engine_config.int4_weights, engine_config.torch_compile):
        if engine_config.int4_weights == "auto":
            logger.info(
                "int4: loading the checkpoint dequantized: %s (--int4-weights packed keeps "
                "the codes packed, at a speed cost)",
                "--torch-compile traces the layers' torch code, not the int4 kernel"
                if engine_config.torch_compile
                else "this platform has no int4 matmul kernel",
            )
        return None
    fmt = packed_int_format(config)
    if not keeps_bits_packed(fmt):
        logger.info(
            "int4: loading the %s checkpoint dequantized: %d-bit codes (4-bit and 8-bit GPTQ "
            "are kept packed)",
            fmt.method,
            fmt.bits,
        )
        return None
    return Int4Sources(fmt)


def kv_head_count(hf_config: Any) -> int:
    """The model's KV heads (``num_key_value_heads``; without it, one per attention head)."""
    return int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)


def model_class(hf_config: Any) -> type[CausalLM]:
    """The registered model class of ``config.architectures`` (the first one registered; its
    ``class_for_config(hf_config)``); a ``ValueError`` listing the supported architectures
    when none is."""
    from chassis.plugins.registries import get_registries

    registry = get_registries().models
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in registry:
            return registry.get(arch).class_for_config(hf_config)
    raise ValueError(
        f"model architecture {architectures or '(none in config.json)'} is not supported; "
        f"supported architectures: {', '.join(registry.names()) or '(none registered)'}"
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter with deterministic random values (for benchmarks, not for text).

    Matrices get ``normal(0, 0.02)``, norm weights 1 and biases 0, drawn on the CPU from a
    generator seeded with ``seed`` so every device gets the same model.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            values = torch.empty(param.shape, dtype=torch.float32)
            values.normal_(0.0, 0.02, generator=generator)
            param.copy_(values)
        elif "norm" in name:
            param.fill_(1.0)
        else:
            param.zero_()
