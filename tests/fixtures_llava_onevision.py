"""Tiny random LLaVA-OneVision checkpoints that take images, and HF's answers for them.

:func:`save_tiny_llava_onevision` writes a checkpoint folder as llava-hf's ov-hf ones:
``config.json`` and ``model.safetensors`` in the hub's tensor names (``language_model.*``,
``vision_tower.*``, ``multi_modal_projector.*``, ``image_newline``), as
transformers saves them: a Qwen2 text model of 2 layers and hidden 64
(untied) and a SigLIP tower of 2 layers, patch 7 at 28 pixels (4 x 4 features a tile;
``vision_feature_layer`` -1, ``"full"``), with the nine grid pinpoints of 1 to 3 tiles a side
and ``vision_aspect_ratio`` ``anyres_max_2`` (a grid of more than about two tiles' features
is resized down, so the tests reach that step). The tokenizer and chat template are
tests/fixtures_llava.py's (``<image>`` = 49152), with ``<video>`` (49153) added and written
for video parts; ``preprocessor_config.json`` is
transformers' ``LlavaOnevisionImageProcessor`` (28 x 28, SigLIP's mean and std of 0.5, the
same pinpoints).

:func:`hf_inputs` runs transformers' ``LlavaOnevisionProcessor`` over that image processor
(its PIL backend; no torchvision here): ``<image>`` expanded, ``pixel_values``,
``image_sizes`` and ``batch_num_images``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from fixtures_llava import CHAT_TEMPLATE as LLAVA_CHAT_TEMPLATE
from fixtures_llava import IMAGE_TOKEN, IMAGE_TOKEN_ID

VIDEO_TOKEN = "<video>"
VIDEO_TOKEN_ID = IMAGE_TOKEN_ID + 1
#: LLaVA-1.5's template of tests/fixtures_llava.py, with ``<video>`` for video parts
CHAT_TEMPLATE = LLAVA_CHAT_TEMPLATE.replace(
    "{% elif p.type == 'text' %}",
    "{% elif p.type in ['video', 'video_url'] %}<video>\n{% elif p.type == 'text' %}",
)

SIDE = 28  # the tower's image_size: a tile
PATCH = 7
TOKENS_PER_TILE = 16
PINPOINTS = [[h * SIDE, w * SIDE] for h in (1, 2, 3) for w in (1, 2, 3)]
ASPECT = "anyres_max_2"


def tiny_config(**overrides: Any) -> Any:
    """The ``LlavaOnevisionConfig`` of the tiny model; ``overrides`` set its own fields."""
    import transformers as tf
    from fixtures_models import TINY_CONFIG_FIELDS

    text = tf.Qwen2Config(**{**TINY_CONFIG_FIELDS, "vocab_size": 49160}, tie_word_embeddings=False)
    vision = tf.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_hidden_layers=2,
        image_size=SIDE,
        patch_size=PATCH,
    )
    fields: dict[str, Any] = {
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "image_grid_pinpoints": PINPOINTS,
        "vision_aspect_ratio": ASPECT,
        **overrides,
    }
    return tf.LlavaOnevisionConfig(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_index=IMAGE_TOKEN_ID,
        video_token_index=VIDEO_TOKEN_ID,
        tie_word_embeddings=False,
        **fields,
    )


def image_processor(**overrides: Any) -> Any:
    """transformers' LLaVA-OneVision image processor (PIL backend) of the tiny checkpoints."""
    import transformers as tf

    settings: dict[str, Any] = {
        "size": {"height": SIDE, "width": SIDE},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_grid_pinpoints": PINPOINTS,
        **overrides,
    }
    return tf.LlavaOnevisionImageProcessorPil(**settings)


def save_tiny_llava_onevision(directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny random float32 checkpoint (the module docstring) to ``directory``;
    1-D parameters (biases, norms, ``image_newline``) are randomized too."""
    import transformers as tf

    from chassis.core.gguf_checkpoint import embedded_model_dir

    directory = Path(directory)
    torch.manual_seed(seed)
    model = tf.LlavaOnevisionForConditionalGeneration(tiny_config(**overrides)).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = tf.AutoTokenizer.from_pretrained(embedded_model_dir())
    tokenizer.add_tokens([IMAGE_TOKEN, VIDEO_TOKEN], special_tokens=True)
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    assert tokenizer.convert_tokens_to_ids(VIDEO_TOKEN) == VIDEO_TOKEN_ID
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    image_processor().save_pretrained(directory)
    return directory


def _processor_class() -> type:
    import transformers as tf

    class LlavaOnevisionProcessorWithoutVideo(tf.LlavaOnevisionProcessor):
        """``LlavaOnevisionProcessor`` built without a video processor (torchvision's)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return LlavaOnevisionProcessorWithoutVideo


def hf_processor(model_dir: Path, **image_overrides: Any) -> Any:
    """transformers' ``LlavaOnevisionProcessor`` of the checkpoint: its tokenizer, the image
    processor (PIL backend), 16 rows a tile, the config's strategy and aspect ratio."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(model_dir)
    processor = (
        image_processor(**image_overrides)
        if image_overrides
        else tf.LlavaOnevisionImageProcessorPil.from_pretrained(model_dir)
    )
    return _processor_class()(
        image_processor=processor,
        tokenizer=tf.AutoTokenizer.from_pretrained(model_dir),
        num_image_tokens=TOKENS_PER_TILE,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        vision_aspect_ratio=config.vision_aspect_ratio,
    )


def hf_inputs(model_dir: Path, prompt: str, images: list[Any]) -> dict[str, torch.Tensor]:
    """HF's model inputs for ``prompt`` (one ``<image>`` per image) and ``images``, as one
    sample (several images in it are HF's multi-image case)."""
    processor = hf_processor(model_dir)
    out = processor(text=prompt, images=[images] if images else None, return_tensors="pt")
    return {name: value for name, value in out.items() if name != "attention_mask"}


def hf_model(model_dir: Path) -> Any:
    import transformers as tf

    return tf.LlavaOnevisionForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
