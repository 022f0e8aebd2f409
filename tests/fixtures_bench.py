"""Model configs without weights or tokenizer, as the GPU benchmark's presets are shipped.

``write_tiny_qwen3_config(dir)`` writes a 2-layer, hidden-64 Qwen3 ``config.json`` (vocab
``VOCAB``, float32, bos 1, eos 2) for ``--load-format dummy --skip-tokenizer-init``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TINY_QWEN3", "VOCAB", "write_tiny_qwen3_config"]

VOCAB = 512

TINY_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_qwen3_config(directory: Path, generation_eos: list[int] | None = None) -> Path:
    """A checkpoint directory holding only ``config.json`` (and optionally a generation
    config naming more EOS ids): no weights, no tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_QWEN3))
    if generation_eos is not None:
        (directory / "generation_config.json").write_text(
            json.dumps({"eos_token_id": generation_eos})
        )
    return directory
