"""Tiny random LLaVA-NeXT checkpoints that take images, and HF's answers for them.

:func:`save_tiny_llava_next` writes a checkpoint folder as the hub ships llava-hf's v1.6 ones:
``config.json`` and ``model.safetensors`` in the hub's tensor names (``language_model.*``,
``vision_tower.vision_model.*``, ``multi_modal_projector.*``, ``image_newline``): a Mistral
text model of 2 layers and hidden 64 (untied) and a CLIP tower of 2 layers, patch 14 at 42
pixels (3 x 3 features a tile; ``vision_feature_layer`` -2, ``"default"``), with grid
pinpoints ``[[42, 84], [84, 42], [84, 84]]``: an image is 2 to 4 tiles of 42 pixels plus its
base tile. The tokenizer and chat template are tests/fixtures_llava.py's (``<image>`` =
49152); ``preprocessor_config.json`` is transformers' ``LlavaNextImageProcessor`` (shortest
edge 42, centre crop 42, the same pinpoints).

:func:`hf_inputs` runs transformers' ``LlavaNextProcessor`` over that image processor (its
PIL backend; no torchvision here): ``<image>`` expanded, ``pixel_values`` and
``image_sizes``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from fixtures_llava import CHAT_TEMPLATE, IMAGE_TOKEN, IMAGE_TOKEN_ID

SIDE = 42  # the tower's image_size: a tile
PATCH = 14
PINPOINTS = [[42, 84], [84, 42], [84, 84]]


def tiny_config(**overrides: Any) -> Any:
    """The ``LlavaNextConfig`` of the tiny model; ``overrides`` set LLaVA-NeXT's own fields."""
    import transformers as tf
    from fixtures_models import TINY_CONFIG_FIELDS

    text = tf.MistralConfig(
        **{**TINY_CONFIG_FIELDS, "vocab_size": 49160},
        sliding_window=None,
        tie_word_embeddings=False,
    )
    vision = tf.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_hidden_layers=2,
        image_size=SIDE,
        patch_size=PATCH,
        projection_dim=32,
    )
    fields: dict[str, Any] = {
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "image_grid_pinpoints": PINPOINTS,
        **overrides,
    }
    # (a "text_config" override replaces the text model: tests/test_llava_granite.py)
    text_config = fields.pop("text_config", None) or text.to_dict()
    return tf.LlavaNextConfig(
        text_config=text_config,
        vision_config=vision.to_dict(),
        image_token_index=IMAGE_TOKEN_ID,
        tie_word_embeddings=False,
        **fields,
    )


def image_processor(**overrides: Any) -> Any:
    """transformers' LLaVA-NeXT image processor (PIL backend) of the tiny checkpoints."""
    import transformers as tf

    settings: dict[str, Any] = {
        "size": {"shortest_edge": SIDE},
        "crop_size": {"height": SIDE, "width": SIDE},
        "image_grid_pinpoints": PINPOINTS,
        **overrides,
    }
    return tf.LlavaNextImageProcessorPil(**settings)


def save_tiny_llava_next(directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny random float32 checkpoint (the module docstring) to ``directory``;
    1-D parameters (biases, norms, the class row, ``image_newline``) are randomized too."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    from chassis.core.gguf_checkpoint import embedded_model_dir

    directory = Path(directory)
    torch.manual_seed(seed)
    model = tf.LlavaNextForConditionalGeneration(tiny_config(**overrides)).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    # llava-hf's files name the tower's tensors vision_tower.vision_model.*
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
    image_processor().save_pretrained(directory)
    return directory


def hf_processor(model_dir: Path) -> Any:
    """transformers' ``LlavaNextProcessor`` of the checkpoint: its tokenizer, the image
    processor (PIL backend), patch 14, the config's strategy, CLIP's class row counted (as
    llava-hf's ``processor_config.json`` says)."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(model_dir)
    return tf.LlavaNextProcessor(
        image_processor=tf.LlavaNextImageProcessorPil.from_pretrained(model_dir),
        tokenizer=tf.AutoTokenizer.from_pretrained(model_dir),
        patch_size=PATCH,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=1,
    )


def hf_inputs(model_dir: Path, prompt: str, images: list[Any]) -> dict[str, torch.Tensor]:
    """HF's model inputs for ``prompt`` (one ``<image>`` per image) and ``images``."""
    processor = hf_processor(model_dir)
    out = processor(text=prompt, images=images or None, return_tensors="pt")
    return {name: value for name, value in out.items() if name != "attention_mask"}


def hf_model(model_dir: Path) -> Any:
    import transformers as tf

    return tf.LlavaNextForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
