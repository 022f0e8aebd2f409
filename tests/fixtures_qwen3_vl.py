"""Tiny random Qwen3-VL / Qwen3-VL-MoE checkpoints that take images.

:func:`save_tiny_qwen3_vl` writes a checkpoint folder as the hub ships one: ``config.json``
and ``model.safetensors`` (2 text layers of hidden 64, head_dim 32, interleaved M-RoPE
sections ``[6, 5, 5]``; a 2-block vision tower of hidden 32, patch 16, spatial merge 2, a
4x4 learned position grid and deepstack mergers on both blocks), the tokenizer and chat
template of :mod:`fixtures_qwen2_vl` (the same vision tokens and ``<|image_pad|>``
placeholder), and a ``preprocessor_config.json`` as Qwen3-VL's (transformers'
``Qwen2VLImageProcessorFast`` type, mean and std 0.5, pixel bounds under ``size``), here
64x64 to 128x128 pixels: 4 to 16 image tokens an image.

The dense checkpoint's deepstack indexes are ``[0, 1]``; the MoE one's ``[1, 0]``, so that
HF's order (the features in block order, each block's from the merger at its index in the
list) is exercised too. :func:`fixtures_qwen2_vl.hf_inputs` makes HF's inputs for these
checkpoints as well.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from fixtures_qwen2_vl import CHAT_TEMPLATE, VISION_TOKENS

ARCHS = ("qwen3_vl", "qwen3_vl_moe")

TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 49160,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "attention_bias": True,
    # head_dim 32: the sections cover its 16 frequencies (height and width 5 each, the
    # temporal component the other 6)
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5e5,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    },
}

VISION_CONFIG: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "out_hidden_size": 64,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,
}

#: the image processor's pixel bounds (patch 16, merge 2: 4 to 16 image tokens an image)
MIN_PIXELS = 64 * 64
MAX_PIXELS = 128 * 128

#: Qwen3-VL's preprocessor_config.json, with the tiny pixel bounds
PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


def tiny_config(arch: str, token_ids: list[int]) -> Any:
    """The ``Qwen3VLConfig`` (``arch`` ``"qwen3_vl"``) or ``Qwen3VLMoeConfig``
    (``"qwen3_vl_moe"``) of the tiny model; ``token_ids`` are the four vision tokens' ids."""
    import transformers as tf

    ids = dict(
        zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
            token_ids,
            strict=True,
        )
    )
    if arch == "qwen3_vl":
        vision = {**VISION_CONFIG, "deepstack_visual_indexes": [0, 1]}
        return tf.Qwen3VLConfig(
            text_config=TEXT_CONFIG, vision_config=vision, tie_word_embeddings=False, **ids
        )
    if arch == "qwen3_vl_moe":
        text = {**TEXT_CONFIG, "num_experts": 4, "num_experts_per_tok": 2}
        text["moe_intermediate_size"] = 48
        vision = {**VISION_CONFIG, "deepstack_visual_indexes": [1, 0]}
        return tf.Qwen3VLMoeConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=False, **ids
        )
    raise ValueError(f"unknown tiny Qwen3-VL architecture {arch!r}")


def save_tiny_qwen3_vl(directory: Path, arch: str = "qwen3_vl", seed: int = 0) -> Path:
    """Write the tiny random float32 checkpoint of ``arch`` to ``directory`` (see the module
    docstring); 1-D parameters (biases, norms) are randomized too, and so is every
    parameter of 3 or more dimensions (MoE experts, the patch embedding) with a larger
    spread than transformers' initialization, so that each one matters."""
    import transformers as tf

    from chassis.core.gguf_checkpoint import embedded_model_dir

    directory = Path(directory)
    tokenizer = tf.AutoTokenizer.from_pretrained(embedded_model_dir())
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    token_ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    config = tiny_config(arch, token_ids)
    model_class = (
        tf.Qwen3VLForConditionalGeneration
        if arch == "qwen3_vl"
        else tf.Qwen3VLMoeForConditionalGeneration
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
            elif param.dim() >= 3:
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    return directory
