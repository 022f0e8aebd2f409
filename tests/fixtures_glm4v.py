"""Tiny random GLM-4.1V / GLM-4.5V checkpoints that take images, and HF's inputs for them.

:func:`save_tiny_glm4v` writes a checkpoint folder as the hub ships one: ``config.json`` and
``model.safetensors`` (2 text layers of hidden 64, head 16 with partial RoPE 0.5 and
``mrope_section`` ``[2, 1, 1]``; GLM-4.5V's second layer a mixture of 4 experts; a 2-block
vision tower of width 32, patch 14, merge 2, a 4x4 position table (``image_size`` 56) that
every larger image resamples), the SmolLM2 tokenizer with GLM's image and video tokens added
(ids 49152..49157) and a ChatML chat template that renders an image part as
``<|begin_of_image|><|image|><|end_of_image|>``, and ``preprocessor_config.json`` for
transformers' ``Glm4vImageProcessor`` (56x56 to 112x112 pixels: 4 to 16 image tokens).

:func:`hf_inputs` expands each ``<|image|>`` of a prompt to the image's token count and runs
transformers' image processor (its PIL backend; no torchvision here), as ``Glm4vProcessor``
would, with the ``mm_token_type_ids`` it returns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fixtures_qwen2_vl
import torch
from fixtures_models import TINY_CONFIG_FIELDS

IMAGE_TOKENS = (
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
)
IMAGE = "<|image|>"
PLACEHOLDER = "<|begin_of_image|><|image|><|end_of_image|>"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type in ['image', 'image_url'] %}" + PLACEHOLDER + ""
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: GLM's M-RoPE over the 4 rotary frequencies of a head of 16 with partial factor 0.5
ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "mrope_section": [2, 1, 1],
    "partial_rotary_factor": 0.5,
}
VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 2,
    "out_hidden_size": 64,
    "image_size": 56,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
MOE: dict[str, Any] = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}
#: the image processor's pixel bounds (GLM's count the two temporal copies of an image)
MIN_PIXELS = 2 * 56 * 56
MAX_PIXELS = 2 * 112 * 112


def tiny_config(arch: str, token_ids: dict[str, int]) -> tuple[type, Any]:
    """The HF class and config of the tiny ``arch`` (``"glm4v"`` or ``"glm4v_moe"``)."""
    import transformers as tf

    text: dict[str, Any] = {**TINY_CONFIG_FIELDS, "vocab_size": 49160, "rope_parameters": ROPE}
    ids = {
        "image_start_token_id": token_ids["<|begin_of_image|>"],
        "image_end_token_id": token_ids["<|end_of_image|>"],
        "video_start_token_id": token_ids["<|begin_of_video|>"],
        "video_end_token_id": token_ids["<|end_of_video|>"],
        "image_token_id": token_ids["<|image|>"],
        "video_token_id": token_ids["<|video|>"],
    }
    if arch == "glm4v":
        vision = {**VISION, "attention_bias": True}
        config = tf.Glm4vConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=False, **ids
        )
        return tf.Glm4vForConditionalGeneration, config
    if arch == "glm4v_moe":
        config = tf.Glm4vMoeConfig(
            text_config={**text, **MOE}, vision_config=VISION, tie_word_embeddings=False, **ids
        )
        return tf.Glm4vMoeForConditionalGeneration, config
    raise ValueError(f"unknown tiny GLM-V architecture {arch!r}")


def save_tiny_glm4v(directory: Path, arch: str = "glm4v", seed: int = 0) -> Path:
    """Write the tiny random float32 checkpoint of ``arch`` to ``directory`` (see the module
    docstring); 1-D parameters (biases, norms) and the routers' correction biases are
    randomized too."""
    import transformers as tf

    from chassis.core.gguf_checkpoint import embedded_model_dir

    directory = Path(directory)
    tokenizer = tf.AutoTokenizer.from_pretrained(embedded_model_dir())
    tokenizer.add_tokens(list(IMAGE_TOKENS), special_tokens=True)
    ids = tokenizer.convert_tokens_to_ids(list(IMAGE_TOKENS))
    token_ids = dict(zip(IMAGE_TOKENS, ids, strict=True))
    cls, config = tiny_config(arch, token_ids)
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    Glm4vImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    ).save_pretrained(directory)
    return directory


def hf_inputs(model_dir: Path, prompt: str, images: list[Any]) -> dict[str, torch.Tensor]:
    """HF's model inputs for ``prompt`` (one ``<|image|>`` per image, in order) and
    ``images``: ``input_ids`` with each ``<|image|>`` repeated ``t*h*w / merge**2`` times,
    ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` (1 on image tokens; all 0
    without images)."""
    out = fixtures_qwen2_vl.hf_inputs(model_dir, prompt, images, IMAGE)
    out.setdefault("mm_token_type_ids", torch.zeros_like(out["input_ids"], dtype=torch.int32))
    return out
