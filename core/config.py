"""``EngineConfig``: every setting of one engine, validated with actionable errors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chassis.core.speculative import SpeculativeConfig

#: What ``chassis serve`` serves when no model is named (see docs/models.md).
DEFAULT_MODEL = "SmolLM2-135M-Instruct"

DTYPES = ("auto", "float32", "bfloat16", "float16")
#: ``--kv-cache-dtype`` values (vLLM's names): "auto" stores K/V in the model's dtype; "fp8"
#: (= "fp8_e4m3") and "fp8_e5m2" store them in 8-bit floats (see docs/performance.md)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
#: the values of --mamba-cache-dtype / --mamba-ssm-cache-dtype (vLLM's)
MAMBA_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
#: ``--load-format`` values (vLLM's names): "auto" reads ``*.safetensors`` files when the
#: checkpoint has any, else PyTorch ``pytorch_model*.bin`` files; "safetensors" and "pt"
#: read only that kind; "dummy" fills random weights (core/weights.py)
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
#: ``--int4-weights`` values (4-bit AWQ/GPTQ checkpoints, docs/models.md): "packed" keeps the
#: linear layers' codes packed, "dequantized" loads 16-bit weights, "auto" packs where the
#: platform's layer kernels have an ``int4_linear`` matmul (``core/int4_packing.py``)
INT4_WEIGHT_MODES = ("auto", "packed", "dequantized")
#: what an engine runs (vLLM's ``--runner``): "generate" samples tokens, "pooling" returns one
#: vector per prompt (embeddings, class logits); "auto" (vLLM's default) is resolved from the
#: checkpoint when the model is read: "pooling" for ``*ForSequenceClassification``, else
#: "generate"
RUNNERS = ("auto", "generate", "pooling")
#: ``--tokenizer-mode`` values (vLLM's names): "auto" and "hf" load the fast (Rust) tokenizer
#: where the checkpoint has one, "slow" the Python one
TOKENIZER_MODES = ("auto", "hf", "slow")
#: ``distributed_executor_backend`` values (vLLM's names)
EXECUTOR_BACKENDS = ("mp", "ray", "uni", None)


@dataclass
class EngineConfig:
    """All settings of one engine. Fields named as vLLM's flags where the concept is the same.

    ``None`` fields are derived: from the model (``max_model_len``), or by the platform's
    ``check_and_update_config`` (``attention_backend``, ``kv_cache_memory``). Plugins adjust
    the final object in their ``chassis_configure`` hook.
    """

    # -- model -----------------------------------------------------------------------------
    #: hub id, local HF directory, or None for the embedded default model
    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    #: the hub revision of a hub ``tokenizer`` (vLLM's ``--tokenizer-revision``; None: the
    #: model's ``revision`` when the tokenizer is the model's, else the default branch)
    tokenizer_revision: str | None = None
    #: let transformers run code shipped in the checkpoint's repository for its config and
    #: tokenizer (vLLM's ``--trust-remote-code``); the model itself always runs chassis'
    #: implementation of its architecture
    trust_remote_code: bool = False
    #: where hub checkpoints (and a hub ``tokenizer``) are downloaded to and looked up
    #: (vLLM's ``--download-dir``; None: the Hugging Face cache)
    download_dir: str | None = None
    #: :data:`TOKENIZER_MODES` (vLLM's ``--tokenizer-mode``)
    tokenizer_mode: str = "auto"
    served_model_name: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    #: vLLM's ``--quantization``: the method the checkpoint is quantized with, checked
    #: against its config (None: read from the checkpoint, which chassis always does)
    quantization: str | None = None
    #: 4-bit AWQ/GPTQ checkpoints (:data:`INT4_WEIGHT_MODES`): "auto" keeps linear layers'
    #: codes packed where the platform has an int4 matmul kernel, else loads 16-bit weights
    int4_weights: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    chat_template: str | None = None
    #: where default sampling values come from (core/generation_defaults.py): "auto" = the
    #: model's generation_config.json, "none" (or vLLM's "vllm") = none, or a folder
    generation_config: str = "auto"
    #: sampling defaults set over the ``generation_config`` ones (vLLM's
    #: ``--override-generation-config``, e.g. ``{"temperature": 0.5}``); also with "none"
    override_generation_config: dict[str, Any] | None = None
    #: keys set on the checkpoint's HF config before anything reads it (vLLM's
    #: ``--hf-overrides``; nested dicts merge into sub-configs, ``core/model_loader.py``)
    hf_overrides: dict[str, Any] | None = None
    #: run on token ids only: load no tokenizer, take token-id prompts, return ids with empty
    #: text (vLLM's flag; for models without tokenizer files, e.g. dummy-weight benchmarks)
    skip_tokenizer_init: bool = False
    #: "generate" or "pooling" (embeddings and classification: prefill only, one vector per
    #: prompt; see docs/embeddings.md), or "auto": picked from the architecture once the
    #: model is read (until then it acts as "generate"); an engine runs one kind of request
    #: and refuses the other
    runner: str = "auto"
    #: pooling engines: ``{"pooling_type": "LAST" | "MEAN" | "CLS" | "MAX" | "MEAN_SQRT_LEN"
    #: | "WEIGHTED_MEAN", "normalize": bool}``, each key optional; what is missing comes from
    #: the checkpoint's sentence-transformers files, else last-token and normalized
    #: (``chassis.core.pooling_config``)
    pooler_config: dict[str, Any] | None = None
    #: the most items of each modality one prompt may carry (vLLM's
    #: ``--limit-mm-per-prompt``: ``{"image": 2}``; ``0`` refuses the modality); a modality
    #: left out: 999, vLLM's default (core/multimodal_limits.py)
    limit_mm_per_prompt: dict[str, Any] | None = None
    #: the folder whose files requests may name as ``file://`` image URLs (vLLM's
    #: ``--allowed-local-media-path``); "" (default): no local files (core/image_loading.py)
    allowed_local_media_path: str = ""
    #: take image (audio) embeddings in place of images (clips) (vLLM's
    #: ``--enable-mm-embeds``: tensors in ``multi_modal_data``, chat ``image_embeds`` /
    #: ``audio_embeds`` parts); False (default): refused with a ValueError naming the flag
    #: (core/multimodal_embeds.py)
    enable_mm_embeds: bool = False
    #: take prompts given as input embeddings (vLLM's ``--enable-prompt-embeds``: offline
    #: ``{"prompt_embeds": tensor}``, /v1/completions ``prompt_embeds``); False (default):
    #: refused with a ValueError naming the flag (core/prompt_embeds.py)
    enable_prompt_embeds: bool = False
    #: the model processor's kwargs for every request (vLLM's ``--mm-processor-kwargs``,
    #: e.g. Qwen2-VL's ``{"max_pixels": 401408}``); a request's own ``mm_processor_kwargs``
    #: win key by key; keys the model's processor does not take are refused at start
    #: (core/multimodal_inputs.py)
    mm_processor_kwargs: dict[str, Any] | None = None
    #: how media are loaded, per modality (vLLM's ``--media-io-kwargs``): ``{"video":
    #: {"num_frames": 32, "fps": 2}, "image": {"rgba_background_color": [255, 255, 255]}}``,
    #: each key optional; others are refused (core/media_options.py)
    media_io_kwargs: dict[str, Any] | None = None
    #: the hosts http(s) media URLs may name (vLLM's ``--allowed-media-domains``); another
    #: host is a 400 before any fetch; None (default): any host (core/media_fetching.py)
    allowed_media_domains: list[str] | None = None
    #: GiB of processed multimodal items the front-end keeps, least recently used out
    #: (vLLM's ``--mm-processor-cache-gb``): an item sent again skips the model's processor;
    #: 0 disables it (core/multimodal_item_cache.py)
    mm_processor_cache_gb: float = 4.0

    # -- KV cache --------------------------------------------------------------------------
    block_size: int = 16
    #: bytes of KV cache on the CPU (None: the platform decides)
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    #: exact number of KV blocks (tests and experiments; overrides memory sizing)
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    #: when every attention layer has a sliding window (Mistral v0.1, Phi-3-mini, ...),
    #: release each request's blocks that its window has left (docs/models.md, "Sliding
    #: window"), and, in models mixing windowed or chunked local-attention layers (Llama 4)
    #: with full ones, each group's blocks its window or current chunk left
    #: (docs/architecture.md, "KV cache per group of layers"); False keeps every position,
    #: as full attention does (the reference path)
    sliding_window_kv_release: bool = True
    #: what the KV cache stores (vLLM's flag): "auto" = the model's dtype; "fp8" / "fp8_e4m3"
    #: / "fp8_e5m2" = 8-bit floats (half a 16-bit cache's bytes per token, so twice the
    #: tokens in the same memory), quantized with per-tensor scales of 1.0 on write and
    #: dequantized on read; needs a backend that supports it (docs/performance.md)
    kv_cache_dtype: str = "auto"
    #: what a state-space model's per-request states are stored in (vLLM's flag): "auto" =
    #: the model's dtype; "float32" / "float16" / "bfloat16" (core/request_state_cache.py)
    mamba_cache_dtype: str = "auto"
    #: the SSM state alone (vLLM's flag): "auto" = as --mamba-cache-dtype says
    mamba_ssm_cache_dtype: str = "auto"

    # -- scheduling ------------------------------------------------------------------------
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    scheduler: str = "fcfs"

    # -- execution -------------------------------------------------------------------------
    sampler: str = "default"
    #: structured-output backend by name (``chassis_register_structured_output_backends``);
    #: vLLM's "auto" means this default
    structured_output_backend: str = "chassis"
    #: custom logits processors, in the order they run: registered names
    #: (``chassis_register_logits_processors``) or qualified ``"package.module:Class"``
    #: (vLLM's ``--logits-processors``; docs/plugins.md); none by default
    logits_processors: list[str] = field(default_factory=list)
    #: the reasoning format (``--reasoning-parser``), so that structured outputs constrain
    #: only what follows the reasoning when the format's tags are single tokens
    reasoning_parser: str | None = None
    attention_backend: str | None = None
    enforce_eager: bool = False
    #: run the model's forward through torch.compile (attention as one opaque op; the layers'
    #: torch code instead of the platform's kernels); start-up compiles it (see docs/gpu.md)
    torch_compile: bool = False
    #: batch sizes whose pure-decode steps are captured as device graphs (vLLM's flag): one
    #: value N = the default pattern up to N, several = exactly those, [] = none (with
    #: ``torch_compile`` still on: vLLM's ``cudagraph_mode`` NONE); None = the default
    #: pattern up to min(max_num_seqs, max_num_batched_tokens, 512) (see docs/gpu.md)
    cuda_graph_sizes: list[int] | None = None
    #: plan step N+1 while the device computes step N (vLLM's flag): the next step's input
    #: tokens come from the device, outputs reach the front-end one step later, and a request
    #: that stops may compute one token that is thrown away (see docs/scheduling.md).
    #: None: "auto", on where the platform's device runs asynchronously to the host
    #: (``Platform.device_runs_async``) and nothing in the config refuses it, resolved to a
    #: bool by the engine core (``core/async_scheduling_default.py``); True: on, a refusal
    #: is an error; False: off
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    #: pipeline stages (vLLM's ``--pipeline-parallel-size``): each of this many worker
    #: processes holds a contiguous run of the decoder layers, the hidden states passing
    #: stage to stage, one batch in flight (it fits a bigger model, it is not faster);
    #: tensor parallelism 1 only (``core/pipeline_parallel.py``; docs/architecture.md)
    pipeline_parallel_size: int = 1
    #: engine replicas behind one front-end (vLLM's ``--data-parallel-size``): ``AsyncLLM``
    #: starts this many engine-core processes, each with the whole model on its own
    #: ``tensor_parallel_size`` devices, and sends each new request to the least busy one
    #: (``core/dp_client.py``; docs/serving.md, "Data parallelism"); the offline ``LLM``
    #: runs one engine only
    data_parallel_size: int = 1
    #: which of the ``data_parallel_size`` engines this config is for (0-based); set by the
    #: front-end in the copy each engine core gets, never by users: it picks the engine's
    #: devices and its share of the host's cores (``core/data_parallel.py``)
    data_parallel_rank: int = 0
    #: mixture-of-experts layers place whole experts on the tensor-parallel ranks (vLLM's
    #: flag): each rank holds a contiguous range of about E/N experts instead of 1/N of every
    #: expert's columns; a no-op with one rank and for dense models (see docs/models.md)
    enable_expert_parallel: bool = False
    #: how the ranks run (vLLM's flag): "mp" = the engine's own process for one rank, worker
    #: processes on this host beside it for more (``core/tp_executor.py``); "ray" = one Ray
    #: actor per rank, on one node or several (``core/ray_executor.py``, needs the ``ray``
    #: extra); "uni" = the engine's own process, one rank only; None = "mp" (vLLM's auto)
    distributed_executor_backend: str | None = "mp"
    #: with worker processes for the ranks ("mp", more than one rank): how long a step may
    #: take before the engine reports the ranks that have not answered, with each one's
    #: Python stack, and fails (vLLM's ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``); 0 = never
    #: (docs/architecture.md)
    execute_model_timeout_s: float = 300.0
    max_logprobs: int = 20
    #: allow ``sleep()`` / ``wake_up()`` (vLLM's ``--enable-sleep-mode``): free the KV cache
    #: and move the weights to host memory (level 1) or drop them (level 2) while the
    #: engine is idle (docs/serving.md, "Sleep mode"); off: those calls are refused
    enable_sleep_mode: bool = False
    #: speculative decoding (vLLM's ``--speculative-config``, a dict of its keys; see
    #: :class:`~chassis.core.speculative.SpeculativeConfig`); None: off
    speculative_config: dict[str, Any] | None = None
    #: engine-wide structured-output settings (vLLM's ``--structured-outputs-config``: keys
    #: ``backend``, ``disable_any_whitespace``, ...; see core/structured_outputs_config.py);
    #: None: the defaults
    structured_outputs_config: dict[str, Any] | None = None

    # -- LoRA adapters (docs/lora.md) ------------------------------------------------------
    #: serve LoRA adapters: requests name one (``LoRARequest``; the API's ``model`` field)
    enable_lora: bool = False
    #: the most distinct adapters in one batch (device slots)
    max_loras: int = 1
    #: the largest adapter rank accepted (smaller ones are zero-padded to it)
    max_lora_rank: int = 16
    #: adapters kept read in host memory (None: ``max_loras``)
    max_cpu_loras: int | None = None

    # -- statistics (docs/serving.md) ------------------------------------------------------
    #: stat loggers of the front-end, in order: registered names
    #: (``chassis_register_stat_loggers``) or ``"package.module:Class"``; None = the
    #: front-end's default: ``["logging"]`` for ``chassis serve`` (``AsyncLLM``), none for
    #: the offline ``LLM``; ``[]`` = none
    stat_loggers: list[str] | None = None
    #: seconds between two calls of every stat logger's ``log`` (vLLM logs every 10 s)
    stat_log_interval: float = 10.0

    # -- plugins ---------------------------------------------------------------------------
    #: values of flags added through ``chassis_add_cli_args``
    plugin_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field and what would be valid."""
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(
                f"--tokenizer-mode must be one of {', '.join(TOKENIZER_MODES)}; "
                f"got {self.tokenizer_mode!r}"
            )
        if self.int4_weights not in INT4_WEIGHT_MODES:
            raise ValueError(
                f"--int4-weights must be one of {', '.join(INT4_WEIGHT_MODES)}; "
                f"got {self.int4_weights!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"--load-format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
        for flag, value in (
            ("--mamba-cache-dtype", self.mamba_cache_dtype),
            ("--mamba-ssm-cache-dtype", self.mamba_ssm_cache_dtype),
        ):
            if value not in MAMBA_CACHE_DTYPES:
                raise ValueError(
                    f"{flag} must be one of {', '.join(MAMBA_CACHE_DTYPES)}; got {value!r}"
                )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two >= 1; got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1; got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be > 0 bytes; got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1]; got {self.gpu_memory_utilization}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be >= 1; got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1; got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1; got {self.max_num_batched_tokens}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be >= 1; got {self.tensor_parallel_size}"
            )
        self._validate_data_parallel()
        self._validate_pipeline_parallel()
        # (not inf: the watchdog's thread cannot wait that long; 0 is "no limit")
        if not (math.isfinite(self.execute_model_timeout_s) and self.execute_model_timeout_s >= 0):
            raise ValueError(
                f"--execute-model-timeout-s must be a finite number >= 0 (0: no limit); got "
                f"{self.execute_model_timeout_s}"
            )
        self._validate_executor_backend()
        if self.cuda_graph_sizes is not None:
            self._validate_cuda_graph_sizes(self.cuda_graph_sizes)
        if self.torch_compile and self.enforce_eager:
            raise ValueError(
                "--torch-compile and --enforce-eager contradict each other (--enforce-eager "
                "means no graph capture and no compilation); drop one"
            )
        if self.structured_output_backend == "auto":  # vLLM's default name: the default here
            self.structured_output_backend = type(self).structured_output_backend
        if self.structured_outputs_config is not None:
            from chassis.core.structured_outputs_config import check_structured_outputs_config

            self.structured_output_backend = check_structured_outputs_config(
                self.structured_outputs_config,
                self.structured_output_backend,
                type(self).structured_output_backend,
            )
        if self.speculative_config is not None:
            _ = self.speculative  # parsed and validated (SpeculativeConfig.from_value)
            if self.async_scheduling is True:  # (None, the default, resolves to off)
                raise ValueError(
                    "--speculative-config and --async-scheduling cannot be combined yet: a "
                    "step's accepted tokens must be known before the next one is planned"
                )
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    "--speculative-config is not supported with --tensor-parallel-size > 1 yet"
                )
        if self.enable_prompt_embeds and self.speculative_config is not None:
            # (a draft model or head would read the placeholder ids as the prompt)
            raise ValueError(
                "--enable-prompt-embeds and --speculative-config cannot be combined yet"
            )
        self._validate_lora()
        self._validate_logits_processors()
        self._validate_runner()
        if self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be >= 0; got {self.max_logprobs}")
        self._validate_stat_logging()
        self._validate_multimodal()
        for flag, value in (
            ("--hf-overrides", self.hf_overrides),
            ("--override-generation-config", self.override_generation_config),
        ):
            if value is not None and not isinstance(value, dict):
                raise ValueError(
                    f"{flag} must be a JSON object (a dict of keys to values); "
                    f"got {type(value).__name__} {value!r}"
                )
        if self.override_generation_config:
            from chassis.core.generation_defaults import check_generation_overrides

            check_generation_overrides(self.override_generation_config)
        if not self.generation_config.strip():
            raise ValueError(
                "--generation-config must be 'auto', 'none' or a folder holding "
                "generation_config.json"
            )
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name must not be empty (omit it to use MODEL)")
        if self.chat_template is not None:
            from chassis.core.tokenizer import check_chat_template

            # a mistyped path, an unreadable file or a syntax error fails here, before the
            # model loads, not as every request's error
            check_chat_template(self.chat_template)

    def _validate_executor_backend(self) -> None:
        backend = self.distributed_executor_backend
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"--distributed-executor-backend must be mp, ray or uni; got {backend!r}"
            )
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                "--distributed-executor-backend uni runs one rank; use mp or ray for "
                f"--tensor-parallel-size {self.tensor_parallel_size}"
            )
        if backend == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ValueError(
                    "--distributed-executor-backend ray needs Ray, which is not installed: "
                    "pip install 'chassis-llm[ray]'"
                )

    def _validate_data_parallel(self) -> None:
        size, rank = self.data_parallel_size, self.data_parallel_rank
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"--data-parallel-size must be an integer >= 1 (engine replicas); got {size!r}"
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(
                f"data_parallel_rank must be in 0..{size - 1} (--data-parallel-size {size}); "
                f"got {rank!r}"
            )
        if size > 1 and self.distributed_executor_backend == "ray":
            raise ValueError(
                "--data-parallel-size above 1 runs every engine's ranks on this host (mp or "
                "uni); not with --distributed-executor-backend ray yet"
            )

    @property
    def world_size(self) -> int:
        """The ranks of one engine: tensor-parallel ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _validate_pipeline_parallel(self) -> None:
        size = self.pipeline_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"--pipeline-parallel-size must be an integer >= 1; got {size!r}")
        if size == 1:
            return
        # (the first cut: what a stage would need to be told about is refused, not guessed)
        for flag, on in (
            ("--tensor-parallel-size above 1", self.tensor_parallel_size > 1),
            ("--data-parallel-size above 1", self.data_parallel_size > 1),
            ("--speculative-config", self.speculative_config is not None),
            ("--enable-lora", self.enable_lora),
            ("--enable-prompt-embeds", self.enable_prompt_embeds),
            ("--torch-compile", self.torch_compile),
            ("--runner pooling", self.runner == "pooling"),
            (
                f"--distributed-executor-backend {self.distributed_executor_backend}",
                self.distributed_executor_backend not in (None, "mp"),
            ),
        ):
            if on:
                raise ValueError(
                    f"--pipeline-parallel-size {size} cannot be combined with {flag} yet"
                )

    def _validate_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be an integer >= 1; got {value!r}"
                )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras})"
            )

    def _validate_logits_processors(self) -> None:
        names = self.logits_processors
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(
                "--logits-processors takes processor names or 'package.module:Class', "
                f"comma-separated; got {names!r}"
            )

    def _validate_stat_logging(self) -> None:
        names = self.stat_loggers
        if names is not None and (
            not isinstance(names, list) or not all(isinstance(n, str) and n for n in names)
        ):
            raise ValueError(
                "--stat-loggers takes logger names or 'package.module:Class', "
                f"comma-separated; got {names!r}"
            )
        interval = self.stat_log_interval
        # finite: the timer waits that long (NaN would make it log in a busy loop, infinity
        # overflows the wait)
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not 0 < interval < math.inf
        ):
            raise ValueError(
                f"--stat-log-interval must be a finite number of seconds > 0; got {interval!r}"
            )

    def _validate_multimodal(self) -> None:
        # (the folder's existence is checked where images load, by the front-end at start:
        # a Ray worker on another node need not have it)
        from chassis.core.multimodal_limits import parse_limits

        parse_limits(self.limit_mm_per_prompt)
        from chassis.core.media_options import check_media_options

        check_media_options(self)
        if not isinstance(self.allowed_local_media_path, str):
            raise ValueError(
                "--allowed-local-media-path must be a folder path; got "
                f"{self.allowed_local_media_path!r}"
            )

    def _validate_runner(self) -> None:
        # "auto" stays until the architecture is known (core.engine_setup resolves it, then
        # validates again)
        if self.runner not in RUNNERS:
            raise ValueError(f"--runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}")
        from chassis.core.pooling_config import check_pooler_config

        check_pooler_config(self.pooler_config)
        if self.runner != "pooling":
            if self.pooler_config is not None and self.runner == "generate":
                raise ValueError("--pooler-config is for --runner pooling only")
            return
        # A pooling request finishes when its prompt is computed: nothing to draft. (LoRA
        # adapters, async scheduling and tensor parallelism do run: docs/embeddings.md.)
        for flag, on in (
            ("--speculative-config", self.speculative_config is not None),
            ("--logits-processors", bool(self.logits_processors)),
        ):
            if on:
                raise ValueError(f"{flag} cannot be combined with --runner pooling yet")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """:attr:`speculative_config` parsed (``ValueError`` when invalid); None when off."""
        if self.speculative_config is None:
            return None
        from chassis.core.speculative import SpeculativeConfig

        return SpeculativeConfig.from_value(self.speculative_config)

    def _validate_cuda_graph_sizes(self, sizes: list[int]) -> None:
        # [] captures no graphs and leaves torch_compile as it is (--enforce-eager turns off
        # both); the command line spells it --compilation-config '{"cudagraph_mode": "NONE"}'
        bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(
                f"--cuda-graph-sizes takes batch sizes >= 1; got {bad[0]!r}. To capture no "
                f"graphs, use --enforce-eager (or, to keep --torch-compile, "
                f"--compilation-config cudagraph_mode NONE)"
            )
        largest_batch = min(self.max_num_seqs, self.max_num_batched_tokens)
        too_big = sorted(s for s in sizes if s > largest_batch)
        if len(sizes) > 1 and too_big:
            raise ValueError(
                f"--cuda-graph-sizes {too_big[-1]} can never be used: a decode batch has at "
                f"most min(--max-num-seqs, --max-num-batched-tokens) = {largest_batch} "
                f"requests; drop sizes above {largest_batch} or raise --max-num-seqs"
            )

    def check_against_model(self, model_max_len: int) -> None:
        """Derive ``max_model_len`` from the model and check the token budget against it."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        elif self.max_model_len > model_max_len:
            raise ValueError(
                f"--max-model-len {self.max_model_len} exceeds the model's context length "
                f"{model_max_len}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, --max-num-batched-tokens ({self.max_num_batched_tokens}) "
                f"must be >= --max-model-len ({self.max_model_len})"
            )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown engine settings: {', '.join(unknown)}")
        return cls(**data)
