"""Tiny random Aya Vision checkpoints that take images, and HF's answers for them.

:func:`save_tiny_aya_vision` writes a checkpoint folder as transformers saves Aya Vision:
``config.json`` and ``model.safetensors`` (``model.language_model.*`` or the hub layout,
``vision_tower.*``, ``multi_modal_projector.*``; the LM head tied by the top-level default), a
Cohere2 text model of 2 layers (a sliding and a full one; ``logit_scale`` 0.25, which HF's Aya
Vision applies from transformers 5.25: :func:`scale_logits`) and a SigLIP tower of 2 layers,
hidden 32, patch 14 at 56 pixels (4 x 4 patches, shuffled by ``downsample_factor`` 2 into
2 x 2: 4 rows a tile; ``vision_feature_layer`` -1, ``"full"``). The tokenizer is SmolLM2's
with ``<|START_OF_IMG|>`` (49152), ``<|END_OF_IMG|>`` (49153), ``<|IMG_PATCH|>`` (49154, the
image token) and ``<|IMG_LINE_BREAK|>`` added as special tokens; ``preprocessor_config.json``
is transformers' ``GotOcr2ImageProcessor`` (56 x 56 tiles, 1 to 6 of them) and
``processor_config.json`` says ``img_size`` 56, ``patch_size`` 14, ``downsample_factor`` 2.
The chat template (ChatML) writes an image part as HF's text ``<image>``, the
``image_token`` ``AyaVisionProcessor`` expands.

:func:`hf_inputs` runs transformers' ``AyaVisionProcessor`` over that image processor (its
PIL backend) on a prompt with HF's ``<image>`` text where ours has ``<|IMG_PATCH|>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SIDE = 56
TOKENS_PER_TILE = 4
MAX_TILES = 6
START_ID, END_ID, IMAGE_TOKEN_ID = 49152, 49153, 49154
IMAGE_TOKEN = "<|IMG_PATCH|>"
SPECIAL_TOKENS = ["<|START_OF_IMG|>", "<|END_OF_IMG|>", IMAGE_TOKEN, "<|IMG_LINE_BREAK|>"]
PROCESSOR_SETTINGS = {"img_size": SIDE, "patch_size": 14, "downsample_factor": 2}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type in ['image', 'image_url', 'image_pil'] %}<image>"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_config(**overrides: Any) -> Any:
    """The ``AyaVisionConfig`` of the tiny model (module docstring)."""
    import transformers as tf
    from fixtures_models import TINY_CONFIG_FIELDS

    text = tf.Cohere2Config(
        **{**TINY_CONFIG_FIELDS, "vocab_size": 49160},
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=6,
        logit_scale=0.25,
    )
    vision = tf.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=SIDE,
        patch_size=14,
    )
    return tf.AyaVisionConfig(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_index=IMAGE_TOKEN_ID,
        **overrides,
    )


def image_processor(**overrides: Any) -> Any:
    """transformers' GOT-OCR2 image processor (PIL backend) of the tiny checkpoints."""
    import transformers as tf

    settings: dict[str, Any] = {
        "size": {"height": SIDE, "width": SIDE},
        "max_patches": MAX_TILES,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        **overrides,
    }
    return tf.GotOcr2ImageProcessorPil(**settings)


def save_tiny_aya_vision(directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny random float32 checkpoint (the module docstring) to ``directory``;
    1-D parameters (biases, norms) are randomized too."""
    import transformers as tf

    from chassis.core.gguf_checkpoint import embedded_model_dir

    directory = Path(directory)
    torch.manual_seed(seed)
    model = tf.AyaVisionForConditionalGeneration(tiny_config(**overrides)).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = tf.AutoTokenizer.from_pretrained(embedded_model_dir())
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    image_processor().save_pretrained(directory)
    (directory / "processor_config.json").write_text(
        json.dumps({**PROCESSOR_SETTINGS, "processor_class": "AyaVisionProcessor"})
    )
    return directory


def hf_processor(model_dir: Path) -> Any:
    """transformers' ``AyaVisionProcessor`` of the checkpoint (PIL image processor)."""
    import transformers as tf

    return tf.AyaVisionProcessor(
        image_processor=tf.GotOcr2ImageProcessorPil.from_pretrained(model_dir),
        tokenizer=tf.AutoTokenizer.from_pretrained(model_dir),
        **PROCESSOR_SETTINGS,
    )


def hf_inputs(model_dir: Path, prompt: str, images: list[Any]) -> dict[str, torch.Tensor]:
    """HF's model inputs for ``prompt`` (one ``<|IMG_PATCH|>`` per image, written as HF's
    ``<image>``) and ``images``."""
    processor = hf_processor(model_dir)
    text = prompt.replace(IMAGE_TOKEN, "<image>")
    out = processor(text=text, images=images or None, return_tensors="pt")
    return {name: value for name, value in out.items() if name != "attention_mask"}


def hf_model(model_dir: Path) -> Any:
    """transformers' Aya Vision on ``model_dir``, its logits scaled (:func:`scale_logits`)."""
    import transformers as tf

    model = tf.AyaVisionForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    return scale_logits(model.eval())


def scale_logits(model: Any) -> Any:
    """``model`` (transformers' ``AyaVisionForConditionalGeneration``) with its logits
    multiplied by the text config's ``logit_scale``, as chassis, vLLM and transformers from
    5.25 compute them: before 5.25 transformers left the scale out, so its LM head's output is
    scaled here (a forward hook); from 5.25 the model is returned as it is."""
    import transformers as tf
    from packaging.version import Version

    if Version(tf.__version__).release < (5, 25):
        scale = float(model.config.text_config.logit_scale)
        model.lm_head.register_forward_hook(lambda _module, _inputs, logits: logits * scale)
    return model
