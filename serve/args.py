"""Engine flags shared by ``chassis serve`` and ``chassis bench``, named as vLLM's.

:func:`add_engine_args` adds every :class:`~chassis.core.config.EngineConfig` setting plus the
flags plugins add through ``chassis_add_cli_args``; :func:`engine_config_from_args` turns the
parsed values into an ``EngineConfig`` (flags left out keep ``EngineConfig``'s defaults, so
those stay defined in one place) with the plugin flags' values in ``config.plugin_args``.
The ``chassis_configure`` hooks run later, when the engine finalizes the config (after the
platform's ``check_and_update_config``, as the hookspec promises).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import MISSING, fields
from typing import Any

from chassis.core.config import (
    DTYPES,
    INT4_WEIGHT_MODES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    MAMBA_CACHE_DTYPES,
    RUNNERS,
    TOKENIZER_MODES,
    EngineConfig,
)
from chassis.serve.compilation_config import add_compilation_args, compilation_settings

#: ``--scheduling-policy`` values (vLLM's), each the built-in scheduler of the same name
SCHEDULING_POLICIES = ("fcfs", "priority")
#: where add_engine_args records the parser it added the flags to (for --config)
ENGINE_PARSER_DEST = "_chassis_engine_parser"
#: where add_engine_args records the dests of plugin flags on the parser's defaults
_PLUGIN_DESTS = "_chassis_plugin_arg_dests"
_PLUGIN_ERROR = "_chassis_plugin_load_error"

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory_size(text: str) -> int:
    """Bytes from ``"4GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"4G"`` or ``"1073741824"``.

    IEC units (KiB, MiB, GiB, TiB) and single letters (K, M, G, T) are powers of 1024; SI
    units (KB, MB, GB, TB) powers of 1000. Case-insensitive. Raises ``ValueError``.
    """
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"invalid memory size {text!r}: use bytes or a number with a unit, "
            "e.g. 4GiB, 512MiB, 2GB"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"invalid memory size {text!r}: must be > 0")
    return size


def _memory_size_arg(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _default(name: str) -> Any:
    for f in fields(EngineConfig):
        if f.name == name:
            return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    raise KeyError(name)


def _help(text: str, name: str) -> str:
    return f"{text} (default: {_default(name)})"


def add_engine_args(parser: argparse.ArgumentParser, *, with_plugins: bool = True) -> None:
    """Add the engine flags (and, with ``with_plugins``, the plugins' flags) to ``parser``.

    Every engine flag defaults to ``None`` here, meaning "``EngineConfig``'s default". A
    plugin that fails to load does not break ``chassis --help`` or other sub-commands: the
    error is recorded and :func:`engine_config_from_args` raises it.
    """
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="read flags from this YAML file (vLLM's flag: 'port: 8000', 'max_model_len: "
        "2048', 'model: ...'); flags on the command line win over it; see docs/serving.md",
    )
    # cli.main finds this parser again to read --config's keys as its flags
    parser.set_defaults(**{ENGINE_PARSER_DEST: parser})
    g = parser.add_argument_group("model")
    g.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="hub id, local HF directory or .gguf file; omit for the embedded default model",
    )
    g.add_argument(
        "--model", dest="model_flag", default=None, metavar="MODEL", help="same as MODEL"
    )
    g.add_argument("--tokenizer", help="tokenizer hub id or directory (default: the model's)")
    g.add_argument("--revision", help="model revision (branch, tag or commit) on the hub")
    g.add_argument(
        "--tokenizer-revision",
        metavar="REV",
        help="hub revision of a hub --tokenizer (default: its default branch)",
    )
    g.add_argument(
        "--tokenizer-mode",
        choices=TOKENIZER_MODES,
        help=_help(
            "auto (or hf) = the fast tokenizer where the checkpoint has one, slow = the Python "
            "one (transformers' use_fast=False)",
            "tokenizer_mode",
        ),
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=None,
        help="let transformers run code from the checkpoint's repository for its config and "
        "tokenizer (the model itself runs chassis' implementation of its architecture)",
    )
    g.add_argument(
        "--download-dir",
        metavar="DIR",
        help="where hub checkpoints are downloaded to and looked up (default: the Hugging "
        "Face cache)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the names clients may send as 'model' (default: MODEL); the first is the one "
        "responses and /metrics report",
    )
    g.add_argument("--dtype", choices=DTYPES, help=_help("weights and activations dtype", "dtype"))
    g.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        help=_help(
            "weight files read: 'auto' = *.safetensors, else pytorch_model*.bin; 'pt' = "
            ".bin only; 'dummy' = random weights",
            "load_format",
        ),
    )
    g.add_argument(
        "--quantization",
        "-q",
        metavar="METHOD",
        help="vLLM's flag: the method the checkpoint is quantized with (fp8, awq, gptq, "
        "mxfp4, compressed-tensors; awq_marlin and gptq_marlin name awq and gptq), checked "
        "against its config; chassis reads the method from the checkpoint and does not "
        "quantize an unquantized one",
    )
    g.add_argument(
        "--int4-weights",
        choices=INT4_WEIGHT_MODES,
        help=_help(
            "4-bit AWQ/GPTQ layers: keep codes packed, load 16-bit weights, or auto = packed "
            "where the platform has an int4 kernel (CUDA/ROCm), 16-bit elsewhere (the CPU)",
            "int4_weights",
        ),
    )
    g.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    g.add_argument("--seed", type=int, help=_help("engine random seed", "seed"))
    g.add_argument(
        "--chat-template",
        help="chat template: a file path or an inline Jinja string (default: the tokenizer's)",
    )
    g.add_argument(
        "--generation-config",
        help=_help(
            "default sampling values: 'auto' = the model's generation_config.json, 'none' "
            "(or 'vllm') = the engine's own, or a folder holding generation_config.json",
            "generation_config",
        ),
    )
    g.add_argument(
        "--override-generation-config",
        type=_json_object_arg,
        metavar="JSON",
        help="sampling defaults set over --generation-config's (also with 'none'), vLLM's "
        "flag: '{\"temperature\": 0.5}'; keys: temperature, top_p, top_k, min_p, "
        "repetition_penalty (a request's own values still win)",
    )
    g.add_argument(
        "--hf-overrides",
        type=_json_object_arg,
        metavar="JSON",
        help="set keys of the model's HF config before it is read, vLLM's flag: "
        "'{\"max_position_embeddings\": 4096}'; a nested object merges into the sub-config "
        "of that name (text_config, ...), any other object value replaces the key whole "
        "(see docs/serving.md)",
    )
    g.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        default=None,
        help="load no tokenizer: prompts must be token ids, outputs carry ids and empty text",
    )
    g.add_argument(
        "--runner",
        choices=RUNNERS,
        help=_help("'pooling' serves embeddings (/v1/embeddings) instead of text", "runner"),
    )
    g.add_argument(
        "--pooler-config",
        "--override-pooler-config",
        dest="pooler_config",
        type=_json_object_arg,
        metavar="JSON",
        help=(
            'with --runner pooling: \'{"pooling_type": "LAST"|"MEAN"|"CLS"|"MAX"|'
            '"MEAN_SQRT_LEN"|"WEIGHTED_MEAN", "normalize": true|false}\' (default: the '
            "checkpoint's sentence-transformers files, else last token, normalized); see "
            "docs/embeddings.md"
        ),
    )

    g = parser.add_argument_group("images (see docs/serving.md, Images)")
    g.add_argument(
        "--limit-mm-per-prompt",
        type=_json_object_arg,
        metavar="JSON",
        help="the most items of each modality one prompt may carry, vLLM's flag: "
        "'{\"image\": 2}' (0 refuses images; a modality left out: 999, vLLM's default)",
    )
    g.add_argument(
        "--allowed-local-media-path",
        metavar="DIR",
        help="the folder whose files requests may name as file:// image URLs (default: "
        "none, file URLs are refused)",
    )
    g.add_argument(
        "--enable-mm-embeds",
        action="store_true",
        default=None,
        help="take image (audio) embeddings in place of images (clips): tensors in "
        "multi_modal_data, chat image_embeds (audio_embeds) parts; vLLM's flag; off by "
        "default: they are refused",
    )
    g.add_argument(
        "--enable-prompt-embeds",
        action="store_true",
        default=None,
        help="take prompts given as input embeddings [seq_len, hidden_size] (/v1/completions "
        "prompt_embeds: base64 of a torch.save'd tensor), vLLM's flag; off by default: they "
        "are refused",
    )
    g.add_argument(
        "--mm-processor-kwargs",
        type=_json_object_arg,
        metavar="JSON",
        help="the model processor's kwargs for every request, vLLM's flag: Qwen2-VL "
        "'{\"max_pixels\": 401408}'; a request's own mm_processor_kwargs win key by key",
    )
    g.add_argument(
        "--media-io-kwargs",
        type=_json_object_arg,
        metavar="JSON",
        help='how media are loaded, vLLM\'s flag: \'{"video": {"num_frames": 16, '
        '"fps": 2}, "image": {"rgba_background_color": [0, 0, 0]}}\' (defaults: 32 '
        "frames, no fps limit, white)",
    )
    g.add_argument(
        "--allowed-media-domains",
        nargs="+",
        metavar="HOST",
        help="the only hosts http(s) media URLs may name (default: any)",
    )
    g.add_argument(
        "--mm-processor-cache-gb",
        type=float,
        metavar="GIB",
        help=_help(
            "GiB of processed images, videos and audio clips kept to skip the processor "
            "when an item comes again (0: no cache)",
            "mm_processor_cache_gb",
        ),
    )
    g.add_argument(
        "--mm-processor-cache-type",
        choices=("lru",),
        help="vLLM's flag; chassis' cache is the front-end's LRU one (vLLM's 'shm' is not "
        "supported)",
    )

    g = parser.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, help=_help("tokens per KV block", "block_size"))
    g.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help=_help(
            "what the KV cache stores: auto = the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2 "
            "= 8-bit floats, twice the tokens in the same memory (docs/performance.md)",
            "kv_cache_dtype",
        ),
    )
    for flag, what in (
        ("--mamba-cache-dtype", "the per-request states of state-space layers (conv and SSM)"),
        ("--mamba-ssm-cache-dtype", "the SSM state alone (auto: as --mamba-cache-dtype)"),
    ):
        g.add_argument(
            flag,
            choices=MAMBA_CACHE_DTYPES,
            help=_help(
                f"what stores {what}: auto = the model's dtype; float32 for more precision at "
                "twice a 16-bit state's memory (docs/architecture.md)",
                flag.removeprefix("--").replace("-", "_"),
            ),
        )
    g.add_argument(
        "--kv-cache-memory",
        type=_memory_size_arg,
        help="KV cache size on the CPU, e.g. 4GiB, 512MiB or bytes (default: the platform's)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help=_help("fraction of accelerator memory the engine may use", "gpu_memory_utilization"),
    )
    g.add_argument(
        "--num-kv-blocks",
        "--num-gpu-blocks-override",
        dest="num_kv_blocks",
        type=int,
        help="exact number of KV blocks, overriding memory sizing (tests, experiments); "
        "--num-gpu-blocks-override is vLLM's name",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_help("reuse KV blocks of shared prompt prefixes", "enable_prefix_caching"),
    )
    g.add_argument(
        "--sliding-window-kv-release",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_help(
            "free each request's KV blocks that sliding windows (or Llama 4's attention "
            "chunks) have left",
            "sliding_window_kv_release",
        ),
    )

    g = parser.add_argument_group("scheduling")
    g.add_argument(
        "--max-num-seqs", type=int, help=_help("most requests in one batch", "max_num_seqs")
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help=_help("token budget of one engine step", "max_num_batched_tokens"),
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_help("split long prompts across steps", "enable_chunked_prefill"),
    )
    g.add_argument("--scheduler", help=_help("scheduler plugin by name", "scheduler"))
    g.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        help="vLLM's name for the two built-in policies: fcfs = --scheduler fcfs, priority = "
        "--scheduler priority (a request's 'priority' field orders the queue)",
    )

    g = parser.add_argument_group("execution")
    g.add_argument("--sampler", help=_help("sampler plugin by name", "sampler"))
    g.add_argument(
        "--structured-output-backend",
        "--guided-decoding-backend",
        dest="structured_output_backend",
        help=_help(
            "constrained-decoding backend plugin by name (response_format, structured_outputs)",
            "structured_output_backend",
        ),
    )
    g.add_argument(
        "--structured-outputs-config",
        type=_json_object_arg,
        metavar="JSON",
        help="engine-wide structured-output settings, as vLLM's flag: '{\"backend\": NAME, "
        '"disable_any_whitespace": true}\' (compact JSON for every JSON constraint whose '
        "request sets no whitespace option; disable_fallback and "
        "disable_additional_properties are accepted; see docs/structured_outputs.md)",
    )
    g.add_argument(
        "--attention-backend", help="attention backend plugin by name (default: the platform's)"
    )
    g.add_argument(
        "--logits-processors",
        nargs="+",
        action=_NameListAction,
        metavar="NAME",
        help="custom logits processors, in the order they run: registered names "
        "(chassis plugins) or 'package.module:Class', comma- or space-separated; "
        "requests pass their arguments as vllm_xargs (default: none; docs/plugins.md)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="no graph capture or compilation",
    )
    g.add_argument(
        "--torch-compile",
        action="store_true",
        default=None,
        help="compile the model's forward with torch.compile at start-up (off by default: "
        "it costs start-up time; the log reports how much); see docs/gpu.md",
    )
    g.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        metavar="N",
        help="batch sizes whose pure-decode steps replay captured device graphs: one value N "
        "= 1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, up to N; several values = "
        "exactly those (default: that pattern up to min(--max-num-seqs, "
        "--max-num-batched-tokens, 512); see docs/gpu.md)",
    )
    add_compilation_args(g)
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan step N+1 while the device runs step N; pays off where the host's "
        "per-step work is a large part of a step (small models on a GPU). Default: on for "
        "platforms whose device runs asynchronously to the host (CUDA, ROCm) unless "
        "speculative decoding or the scheduler rules it out, off elsewhere; see "
        "docs/scheduling.md",
    )
    g.add_argument(
        "--speculative-config",
        type=_json_object_arg,
        metavar="JSON",
        help='speculative decoding, as vLLM\'s flag: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "(greedy and unseeded sampled requests without logprobs, penalties or structured "
        "outputs; see docs/scheduling.md)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        help=_help("devices to shard the model over", "tensor_parallel_size"),
    )
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        metavar="N",
        help=_help(
            "engine replicas behind this server, each with the whole model on its own "
            "--tensor-parallel-size devices (on the CPU: its share of the cores); each new "
            "request goes to the least busy one (docs/serving.md, 'Data parallelism')",
            "data_parallel_size",
        ),
    )
    g.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        metavar="N",
        help=_help(
            "pipeline stages: each of N worker processes holds a contiguous run of the decoder "
            "layers, one batch in flight (fits a bigger model, not faster; Llama, Qwen2, Qwen3; "
            "not with --tensor-parallel-size above 1); see docs/architecture.md",
            "pipeline_parallel_size",
        ),
    )
    g.add_argument(
        "--enable-expert-parallel",
        "-ep",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_help(
            "with --tensor-parallel-size N, place whole experts of the mixture-of-experts "
            "layers on each rank (E/N each) instead of 1/N of every expert; see docs/models.md",
            "enable_expert_parallel",
        ),
    )
    g.add_argument(
        "--distributed-executor-backend",
        choices=("mp", "ray", "uni"),
        help="how the ranks run: mp = worker processes on this host, ray = Ray actors on one "
        "node or several (pip install 'chassis-llm[ray]'), uni = this process, one rank "
        "(default: mp); see docs/architecture.md",
    )
    g.add_argument(
        "--execute-model-timeout-s",
        type=float,
        metavar="SECONDS",
        help=_help(
            "with more than one rank (mp worker processes or ray actors), how long a step may "
            "take before the engine names the ranks that have not answered, logs each one's "
            "Python stack, stops the ranks and fails its requests; 0 = no limit; see "
            "docs/architecture.md",
            "execute_model_timeout_s",
        ),
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        help=_help("largest logprobs a request may ask for", "max_logprobs"),
    )
    g.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        default=None,
        help="allow sleep and wake_up while the engine is idle (vLLM's flag): level 1 frees "
        "the KV cache and moves the weights to host memory, level 2 frees both; the routes "
        "POST /sleep, POST /wake_up and GET /is_sleeping need VLLM_SERVER_DEV_MODE=1 too; "
        "see docs/serving.md",
    )

    g = parser.add_argument_group("LoRA adapters (see docs/lora.md)")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="serve LoRA adapters: a request names one as 'model' (chassis serve "
        "--lora-modules) or passes a LoRARequest (LLM, AsyncLLM)",
    )
    g.add_argument(
        "--max-loras",
        type=int,
        help=_help("the most distinct adapters in one batch (device slots)", "max_loras"),
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        help=_help("the largest adapter rank accepted", "max_lora_rank"),
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        help="adapters kept read in host memory (default: --max-loras)",
    )

    g = parser.add_argument_group("statistics (see docs/serving.md)")
    g.add_argument(
        "--stat-loggers",
        type=_comma_separated,
        metavar="NAMES",
        help="stat loggers of the front-end, comma-separated: registered names (chassis "
        "plugins) or 'package.module:Class'; '' = none (default: logging, the periodic "
        "throughput line)",
    )
    g.add_argument(
        "--disable-log-stats",
        dest="stat_loggers",
        action="store_const",
        const=[],
        help="run no stat logger (vLLM's flag; same as --stat-loggers '')",
    )
    g.add_argument(
        "--stat-log-interval",
        type=float,
        metavar="SECONDS",
        help=_help("seconds between two periodic stat logs", "stat_log_interval"),
    )

    if with_plugins:
        _add_plugin_args(parser)


def _comma_separated(text: str) -> list[str]:
    """``--stat-loggers logging,my_plugin`` -> ``["logging", "my_plugin"]``; ``""`` -> ``[]``."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _add_plugin_args(parser: argparse.ArgumentParser) -> None:
    from chassis.plugins import PluginLoadError, add_plugin_cli_args

    try:
        dests = add_plugin_cli_args(parser)
    except PluginLoadError as exc:
        parser.set_defaults(**{_PLUGIN_DESTS: [], _PLUGIN_ERROR: str(exc)})
        return
    parser.set_defaults(**{_PLUGIN_DESTS: dests, _PLUGIN_ERROR: None})


class _NameListAction(argparse.Action):
    """``--flag a,b c`` -> ``["a", "b", "c"]`` (empty items dropped)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, [n for v in values for n in _comma_separated(str(v))])


def _json_object_arg(text: str) -> dict[str, Any]:
    """A flag value that is a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


#: flag dest -> EngineConfig field (where they differ)
_FIELD_OF = {"model_flag": "model"}


def _check_vllm_only_flags(args: argparse.Namespace) -> None:
    """vLLM's flags whose only supported value means "what chassis does anyway"."""
    policy, scheduler = getattr(args, "scheduling_policy", None), getattr(args, "scheduler", None)
    if policy is not None:
        if scheduler is not None and scheduler != policy:
            raise ValueError(
                f"--scheduling-policy {policy} and --scheduler {scheduler} disagree; give one"
            )
        args.scheduler = policy


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """An :class:`EngineConfig` from parsed :func:`add_engine_args` flags.

    Raises ``ValueError`` for invalid values (from ``EngineConfig``), for MODEL and
    ``--model`` naming different models (or ``--scheduling-policy`` and ``--scheduler``
    different schedulers), for ``-O``/``--compilation-config`` and a chassis flag that disagree
    (:mod:`chassis.serve.compilation_config`), and for a plugin that failed to load.
    """
    load_error = getattr(args, _PLUGIN_ERROR, None)
    if load_error:
        raise ValueError(load_error)
    _check_vllm_only_flags(args)
    positional, flag = getattr(args, "model", None), getattr(args, "model_flag", None)
    if positional and flag and positional != flag:
        raise ValueError(f"MODEL {positional!r} and --model {flag!r} disagree; give one")
    known = {f.name for f in fields(EngineConfig)} - {"plugin_args"}
    values: dict[str, Any] = {}
    for dest, value in vars(args).items():
        name = _FIELD_OF.get(dest, dest)
        if name in known and value is not None:
            values[name] = value
    names = values.get("served_model_name")
    if isinstance(names, list):
        # --served-model-name takes several names (vLLM's nargs="+"); the engine reports the
        # first, the server accepts the others too (ServerSettings.served_model_aliases)
        values["served_model_name"] = names[0]
    dests = getattr(args, _PLUGIN_DESTS, None) or []
    from chassis.plugins import plugin_args_from

    values["plugin_args"] = plugin_args_from(args, dests)
    return EngineConfig(**compilation_settings(args, values))
