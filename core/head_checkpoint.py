"""Reading a speculative head's checkpoint (EAGLE-1 and EAGLE-3 heads, ``core/eagle.py``,
``core/eagle3.py``): its tensors and its config.

- **Tensors.** ``*.safetensors`` files, else ``pytorch_model*.bin`` files (many published
  EAGLE heads ship only ``pytorch_model.bin``), read with ``torch.load(weights_only=True)``:
  tensors and plain containers only, no pickled code runs. Names lose a ``model.`` prefix.
- **Config.** The HF layout (``config.json`` a transformers config of the head), or the
  RedHatAI ``speculators`` layout: ``config.json`` with ``speculators_model_type``, the head's
  decoder layer in ``transformer_layer_config`` (a Llama config: sizes, vocabulary, RoPE) and
  the EAGLE-3 fields at the top level (``draft_vocab_size``, ``target_hidden_size``,
  ``norm_before_residual``, ``eagle_aux_hidden_state_layer_ids``), read into the same
  transformers config the HF layout gives. ``speculators_config`` (proposal methods, the
  verifier's name) is not needed to run the head and is not read: ``num_speculative_tokens``
  comes from ``--speculative-config``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

#: speculators' options that change the head's forward and that the head here does not have
_UNSUPPORTED_SPECULATORS_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")


def _check_has_weights(path: Path) -> None:
    from chassis.core.weights import has_weight_files

    if not has_weight_files(path):
        raise ValueError(
            f"{path} holds no *.safetensors or pytorch_model*.bin files: a speculative head "
            "is read from either"
        )


def head_tensor_names(path: Path) -> set[str]:
    """The tensor names of the head checkpoint in ``path`` without a ``model.`` prefix
    (safetensors: from the files' headers; ``.bin``: from the memory-mapped state dicts).
    ``ValueError`` when ``path`` holds neither kind."""
    from chassis.core.weights import checkpoint_tensor_names

    _check_has_weights(path)
    return checkpoint_tensor_names(path)


def iterate_head_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of the head checkpoint in ``path`` (CPU tensors;
    names as stored, the loaders strip ``model.``): the safetensors files when there are any,
    else the ``pytorch_model*.bin`` files (:func:`chassis.core.weights.iterate_checkpoint`).
    ``ValueError`` when there is neither, or a ``.bin`` entry is not a tensor."""
    from chassis.core.weights import iterate_checkpoint

    _check_has_weights(path)
    yield from iterate_checkpoint(path)


def is_speculators_config(path: Path) -> bool:
    """Whether ``path``'s ``config.json`` is in the speculators layout."""
    config = Path(path) / "config.json"
    return config.is_file() and "speculators_model_type" in json.loads(config.read_text())


def speculators_head_config(raw: dict[str, Any], architecture: str, name: str) -> Any:
    """The transformers config of a speculators-layout ``eagle3`` head (``raw``: its
    ``config.json``), as the HF layout would give it, with ``architectures`` set to
    ``architecture``. ``ValueError`` (naming ``name``) for another model type, a decoder
    layer that is not Llama's, no ``transformer_layer_config``, or an option the head here
    does not implement (``norm_before_fc``, ``fc_norm``, ``norm_output`` true)."""
    from transformers import LlamaConfig

    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise ValueError(
            f"the head {name!r} is a speculators {kind!r} checkpoint: only 'eagle3' ones are "
            "read (method 'eagle3')"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(
            f"the speculators head {name!r} has no transformer_layer_config object (its "
            "decoder layer's config)"
        )
    layer = dict(layer)
    model_type = layer.pop("model_type", "llama")
    if model_type != "llama":
        raise ValueError(
            f"the speculators head {name!r} has a {model_type!r} decoder layer: Llama-style "
            "EAGLE-3 heads only"
        )
    enabled = [key for key in _UNSUPPORTED_SPECULATORS_OPTIONS if raw.get(key)]
    if enabled:
        raise ValueError(
            f"the speculators head {name!r} sets {enabled}: not supported by the EAGLE-3 head here"
        )
    layer.pop("architectures", None)
    config = LlamaConfig(**layer)
    config.architectures = [architecture]
    config.draft_vocab_size = raw.get("draft_vocab_size")
    if raw.get("target_hidden_size") is not None:
        config.target_hidden_size = raw["target_hidden_size"]
    # vLLM reads a missing norm_before_residual as true in this layout (speculators writes it)
    config.norm_before_residual = bool(raw.get("norm_before_residual", True))
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        config.eagle_aux_hidden_state_layer_ids = list(raw["eagle_aux_hidden_state_layer_ids"])
    return config


def load_head_config(path: Path, architecture: str, name: str) -> Any:
    """The head's transformers config: :func:`speculators_head_config` for the speculators
    layout, else the HF layout's (``load_hf_config``)."""
    from chassis.core.model_loader import load_hf_config

    if is_speculators_config(path):
        raw = json.loads((Path(path) / "config.json").read_text())
        return speculators_head_config(raw, architecture, name)
    return load_hf_config(path)
