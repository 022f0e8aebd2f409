"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints that take images, and HF's answers for them.

:func:`save_tiny_qwen2_vl` writes a checkpoint folder as the hub ships one: ``config.json``
and ``model.safetensors`` (2 text layers of hidden 64, a 2-block vision tower of patch 14,
spatial merge 2), the SmolLM2 tokenizer with Qwen2-VL's vision tokens added
(``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``, ids 49152..49155)
and a ChatML chat template that renders an image part as
``<|vision_start|><|image_pad|><|vision_end|>`` (a video part as
``<|vision_start|><|video_pad|><|vision_end|>``, as Qwen2-VL's template), and
``preprocessor_config.json`` for transformers' ``Qwen2VLImageProcessor`` (56x56 to 112x112
pixels: 4 to 16 image tokens).

:func:`hf_inputs` expands each ``<|image_pad|>`` of a prompt to the image's token count and
runs transformers' image processor (its PIL backend; no torchvision here), as
``Qwen2VLProcessor`` would; :func:`hf_greedy_with_images` is HF ``generate``'s greedy answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type in ['image', 'image_url'] %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p.type in ['video', 'video_url'] %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 49160,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    # head_dim 16: mrope_section covers its 8 frequencies
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
}

#: the image processor's pixel bounds (patch 14, merge 2: 4 to 16 image tokens an image)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112


def tiny_config(arch: str, token_ids: list[int]) -> Any:
    """The ``Qwen2VLConfig`` (``arch`` ``"qwen2_vl"``) or ``Qwen2_5_VLConfig``
    (``"qwen2_5_vl"``) of the tiny model; ``token_ids`` are the four vision tokens' ids."""
    import transformers as tf

    ids = dict(
        zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
            token_ids,
            strict=True,
        )
    )
    if arch == "qwen2_vl":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
        return tf.Qwen2VLConfig(
            text_config=TEXT_CONFIG, vision_config=vision, tie_word_embeddings=True, **ids
        )
    if arch == "qwen2_5_vl":
        # window 56 px = 2x2 merged tokens: images above 56 px get several windows; block 0
        # windowed, block 1 full attention
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        }
        return tf.Qwen2_5_VLConfig(
            text_config=TEXT_CONFIG, vision_config=vision, tie_word_embeddings=False, **ids
        )
    raise ValueError(f"unknown tiny vision-language architecture {arch!r}")


def save_tiny_qwen2_vl(directory: Path, arch: str = "qwen2_vl", seed: int = 0) -> Path:
    """Write the tiny random float32 checkpoint of ``arch`` to ``directory`` (see the module
    docstring); 1-D parameters (biases, norms) are randomized too."""
    import transformers as tf

    from chassis.core.gguf_checkpoint import embedded_model_dir

    directory = Path(directory)
    tokenizer = tf.AutoTokenizer.from_pretrained(embedded_model_dir())
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    token_ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    config = tiny_config(arch, token_ids)
    model_class = (
        tf.Qwen2VLForConditionalGeneration
        if arch == "qwen2_vl"
        else tf.Qwen2_5_VLForConditionalGeneration
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    tf.Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(
        directory
    )
    return directory


def random_image(height: int, width: int, seed: int = 0) -> Any:
    """A ``height`` x ``width`` RGB PIL image of random pixels."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def hf_inputs(
    model_dir: Path, prompt: str, images: list[Any], pad: str = "<|image_pad|>"
) -> dict[str, torch.Tensor]:
    """HF's model inputs for ``prompt`` (one ``pad`` token per image, in order) and
    ``images``: ``input_ids`` with each ``pad`` repeated ``t*h*w / merge**2`` times,
    ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` (with images). Any
    image processor with ``merge_size`` and ``image_grid_thw`` (Qwen2-VL's, GLM-4.1V's)."""
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    processor = tf.AutoImageProcessor.from_pretrained(model_dir)
    assert prompt.count(pad) == len(images)
    out: dict[str, torch.Tensor] = {}
    if images:
        out = dict(processor(images=images, return_tensors="pt"))
        merge = processor.merge_size**2
        pieces = prompt.split(pad)
        counts = [int(grid.prod()) // merge for grid in out["image_grid_thw"]]
        prompt = pieces[0] + "".join(
            "<|placeholder|>" * n + rest for n, rest in zip(counts, pieces[1:], strict=True)
        )
        prompt = prompt.replace("<|placeholder|>", pad)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if images:
        # transformers 5 computes M-RoPE from the token types (1: image), as its processor
        # returns them; its forward refuses images without them
        image_id = tokenizer.convert_tokens_to_ids(pad)
        out["mm_token_type_ids"] = (ids == image_id).to(torch.int32)
    return {"input_ids": ids, **out}


def hf_greedy_with_images(
    model_dir: Path, prompt: str, images: list[Any], max_new_tokens: int
) -> list[int]:
    """HF ``generate``'s greedy new tokens for ``prompt`` with ``images`` (float32)."""
    import transformers as tf

    model = tf.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    inputs = hf_inputs(model_dir, prompt, images)
    with torch.no_grad():
        out = model.eval().generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist()
