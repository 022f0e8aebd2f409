"""Tiny random LLaVA checkpoints that take images, and HF's answers for them.

:func:`save_tiny_llava` writes a checkpoint folder as the hub ships llava-hf's: ``config.json``
and ``model.safetensors`` in the hub's tensor names (``language_model.model.*``,
``language_model.lm_head.*``, ``vision_tower.vision_model.*``, ``multi_modal_projector.*``;
``layout="saved"`` keeps what transformers 5 saves, ``vision_tower.*``), a Llama text model of
2 layers and hidden 64 (untied, as Vicuna), and a vision tower of patch 14 at 56 pixels
(16 patches): CLIP's (3 layers, ``vision_feature_layer`` -2, ``"default"``: 16 image tokens) or
SigLIP's (2 layers, -1, ``"full"``: 16 image tokens). The tokenizer is SmolLM2's with
``<image>`` added (id 49152) and a chat template in LLaVA-1.5's style (``USER: <image>\\n...
ASSISTANT:``); ``preprocessor_config.json`` is transformers' CLIP image processor (shortest edge
56, centre crop 56) or SigLIP's (56x56).

:func:`hf_inputs` runs transformers' ``LlavaProcessor`` over the checkpoint's image processor
(its PIL backend; no torchvision here): ``<image>`` expanded and ``pixel_values``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 49152
SIDE = 56  # the towers' image_size
TOKENS_PER_IMAGE = 16

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type in ['image', 'image_url', 'image_pil'] %}<image>\n"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "{% if m.role != 'user' %}</s>{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def tiny_config(tower: str = "clip", **overrides: Any) -> Any:
    """The ``LlavaConfig`` of the tiny model with a ``"clip"`` or ``"siglip"`` tower;
    ``overrides`` set LLaVA's own fields (``vision_feature_layer``, ...)."""
    import transformers as tf
    from fixtures_models import TINY_CONFIG_FIELDS

    text = tf.LlamaConfig(**{**TINY_CONFIG_FIELDS, "vocab_size": 49160}, tie_word_embeddings=False)
    vision: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "image_size": SIDE,
        "patch_size": 14,
    }
    if tower == "clip":
        vision_config = tf.CLIPVisionConfig(**vision, num_hidden_layers=3, projection_dim=32)
        fields: dict[str, Any] = {
            "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default",
        }
    elif tower == "siglip":
        vision_config = tf.SiglipVisionConfig(**vision, num_hidden_layers=2)
        fields = {"vision_feature_layer": -1, "vision_feature_select_strategy": "full"}
    else:
        raise ValueError(f"unknown tower {tower!r}")
    fields.update(overrides)
    # (a "text_config" override replaces the text model: tests/test_llava_granite.py)
    text_config = fields.pop("text_config", None) or text.to_dict()
    return tf.LlavaConfig(
        text_config=text_config,
        vision_config=vision_config.to_dict(),
        image_token_index=IMAGE_TOKEN_ID,
        tie_word_embeddings=False,
        **fields,
    )


def image_processor(tower: str = "clip") -> Any:
    """transformers' image processor (PIL backend) of the tiny checkpoints."""
    import transformers as tf

    if tower == "siglip":
        return tf.SiglipImageProcessorPil(size={"height": SIDE, "width": SIDE})
    return tf.CLIPImageProcessorPil(
        size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE}
    )


def save_tiny_llava(
    directory: Path, tower: str = "clip", seed: int = 0, layout: str = "hub", **overrides: Any
) -> Path:
    """Write the tiny random float32 checkpoint (see the module docstring) to ``directory``;
    1-D parameters (biases, norms, the class row) are randomized too."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    from chassis.core.gguf_checkpoint import embedded_model_dir

    directory = Path(directory)
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(tiny_config(tower, **overrides)).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    if layout == "hub":  # llava-hf's files name the tower's tensors vision_tower.vision_model.*
        path = directory / "model.safetensors"
        tensors = {
            name.replace("vision_tower.", "vision_tower.vision_model.", 1): tensor
            for name, tensor in load_file(path).items()
        }
        save_file(tensors, path, metadata={"format": "pt"})
    tokenizer = tf.AutoTokenizer.from_pretrained(embedded_model_dir())
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    image_processor(tower).save_pretrained(directory)
    return directory


def random_image(height: int, width: int, seed: int = 0) -> Any:
    """A ``height`` x ``width`` RGB PIL image of random pixels."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def hf_processor(model_dir: Path, tower: str = "clip") -> Any:
    """transformers' ``LlavaProcessor`` of the checkpoint: its tokenizer, the image processor
    (PIL backend), patch 14, the config's strategy, CLIP's class row counted."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(model_dir)
    return tf.LlavaProcessor(
        image_processor=type(image_processor(tower)).from_pretrained(model_dir),
        tokenizer=tf.AutoTokenizer.from_pretrained(model_dir),
        patch_size=14,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=1 if tower == "clip" else 0,
    )


def hf_inputs(
    model_dir: Path, prompt: str, images: list[Any], tower: str = "clip"
) -> dict[str, torch.Tensor]:
    """HF's model inputs for ``prompt`` (one ``<image>`` per image) and ``images``."""
    processor = hf_processor(model_dir, tower)
    out = processor(text=prompt, images=images or None, return_tensors="pt")
    return {name: value for name, value in out.items() if name != "attention_mask"}


def hf_model(model_dir: Path) -> Any:
    import transformers as tf

    return tf.LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
