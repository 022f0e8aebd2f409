"""Tiny random ``*ForSequenceClassification`` checkpoints, shared by the classification tests.

``tests/conftest.py`` registers the fixtures (once for the run; a test module imports only
the helpers it calls, ``LABELS``, ``hf_classifier``, ...). Session fixtures (each a
directory with ``config.json``, ``model.safetensors`` and the SmolLM2 tokenizer):

- ``tiny_llama_cls_dir``: ``LlamaForSequenceClassification`` with 3 labels (named).
- ``tiny_qwen2_cls_dir``: ``Qwen2ForSequenceClassification`` with 3 labels (QKV bias).
- ``tiny_qwen3_cls_dir``: ``Qwen3ForSequenceClassification`` with 1 label: a cross-encoder.

Each has the tiny models' shapes (:data:`fixtures_models.TINY_CONFIG_FIELDS`: 2 layers,
hidden 64) and float32 weights from ``torch.manual_seed``, every 1-D parameter randomized.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS

__all__ = [
    "LABELS",
    "hf_classifier",
    "tiny_llama_cls_dir",
    "tiny_qwen2_cls_dir",
    "tiny_qwen3_cls_dir",
    "write_tiny_classifier",
]

#: the 3-label models' id2label
LABELS = ("negative", "neutral", "positive")


def write_tiny_classifier(arch: str, directory: Path, num_labels: int, seed: int = 0) -> Path:
    """Save a random float32 HF ``*ForSequenceClassification`` model of ``arch`` (``llama``,
    ``qwen2`` or ``qwen3``) with ``num_labels`` classes and the SmolLM2 tokenizer."""
    from transformers import (
        AutoModelForSequenceClassification,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
    )

    from chassis.core.gguf_checkpoint import embedded_model_dir

    fields: dict[str, Any] = dict(TINY_CONFIG_FIELDS)
    fields["num_labels"] = num_labels
    if num_labels == len(LABELS):
        fields["id2label"] = dict(enumerate(LABELS))
        fields["label2id"] = {label: i for i, label in enumerate(LABELS)}
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    if arch == "qwen3":
        fields["head_dim"] = 32
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
        model.score.weight.mul_(4.0)  # logits of a few units: probabilities far from uniform
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / name, directory / name)
    return directory


def hf_classifier(model_dir: Path) -> Any:
    """The checkpoint in ``model_dir`` loaded by HF transformers (float32, eval mode)."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama_cls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_classifier("llama", tmp_path_factory.mktemp("tiny_llama_cls"), 3)


@pytest.fixture(scope="session")
def tiny_qwen2_cls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_classifier("qwen2", tmp_path_factory.mktemp("tiny_qwen2_cls"), 3, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3_cls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_classifier("qwen3", tmp_path_factory.mktemp("tiny_qwen3_cls"), 1, seed=2)
