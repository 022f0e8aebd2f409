"""Tiny random Mistral 3 checkpoints that take images, and HF's answers for them.

:func:`save_tiny_mistral3` writes a checkpoint folder as transformers 5 saves
``Mistral3ForConditionalGeneration`` (``language_model.model.*``, ``language_model.lm_head.*``,
``vision_tower.*``, ``multi_modal_projector.*``): a Mistral text model of 2 layers and hidden
64 (untied; or Ministral 3's, ``text="ministral3"``), a Pixtral tower of 2 layers (width 32,
2 heads, patch 4, SwiGLU of ``silu``), ``spatial_merge_size`` 2, ``vision_feature_layer`` -1.
One image token covers 8x8 pixels. The tokenizer is SmolLM2's with ``[IMG]``,
``[IMG_BREAK]``, ``[IMG_END]`` added (ids 49152-49154) and a chat template in Mistral's style
(``[INST]...[/INST]``, ``[IMG]`` for an image part); ``preprocessor_config.json`` is
transformers' Pixtral image processor with ``longest_edge`` 48, and ``processor_config.json``
names patch 4 and merge 2.

:func:`hf_inputs` runs transformers' ``PixtralProcessor`` over the Pixtral image processor's
PIL backend (no torchvision here: the processor's module is imported with its torchvision
image processor module stood in for by the PIL one, which has the same size rule).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

IMAGE_TOKEN_ID = 49152
BREAK_TOKEN_ID = 49153
END_TOKEN_ID = 49154
PATCH = 4
MERGE = 2
LONGEST_EDGE = 48

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}[INST]"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type in ['image', 'image_url', 'image_pil'] %}[IMG]"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}[/INST]"
    "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)


def tiny_config(text: str = "mistral", **overrides: Any) -> Any:
    """The ``Mistral3Config`` of the tiny model over a ``"mistral"`` or ``"ministral3"`` text
    model; ``overrides`` set Mistral 3's own fields."""
    import transformers as tf
    from fixtures_models import TINY_CONFIG_FIELDS

    fields = {**TINY_CONFIG_FIELDS, "vocab_size": 49160, "head_dim": 32}
    if text == "ministral3":
        # YaRN with an original length of 8: the query scale steps up inside the prompts
        rope = {
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 64.0,
            "original_max_position_embeddings": 8,
            "max_position_embeddings": 512,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "llama_4_scaling_beta": 0.1,
        }
        text_config = tf.Ministral3Config(**fields, rope_parameters=rope, tie_word_embeddings=False)
    else:
        text_config = tf.MistralConfig(**fields, sliding_window=None, tie_word_embeddings=False)
    vision = tf.PixtralVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=64,
        patch_size=PATCH,
        hidden_act="silu",
    )
    return tf.Mistral3Config(
        text_config=text_config.to_dict(),
        vision_config=vision.to_dict(),
        image_token_index=IMAGE_TOKEN_ID,
        spatial_merge_size=MERGE,
        tie_word_embeddings=False,
        **overrides,
    )


def image_processor() -> Any:
    """transformers' Pixtral image processor (PIL backend) of the tiny checkpoints."""
    import transformers as tf

    return tf.PixtralImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE}, patch_size={"height": PATCH, "width": PATCH}
    )


def save_tiny_mistral3(
    directory: Path, seed: int = 0, text: str = "mistral", **overrides: Any
) -> Path:
    """Write the tiny random float32 checkpoint (see the module docstring) to ``directory``;
    1-D parameters (norms, projector biases) are randomized too."""
    import transformers as tf

    from chassis.core.gguf_checkpoint import embedded_model_dir

    directory = Path(directory)
    torch.manual_seed(seed)
    config = tiny_config(text, **overrides)
    model = tf.Mistral3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = tf.AutoTokenizer.from_pretrained(embedded_model_dir())
    tokenizer.add_tokens(["[IMG]", "[IMG_BREAK]", "[IMG_END]"], special_tokens=True)
    assert tokenizer.convert_tokens_to_ids("[IMG_END]") == END_TOKEN_ID
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    image_processor().save_pretrained(directory)
    processor_config = {
        "processor_class": "PixtralProcessor",
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]",
    }
    (directory / "processor_config.json").write_text(json.dumps(processor_config))
    return directory


def random_image(height: int, width: int, seed: int = 0) -> Any:
    """A ``height`` x ``width`` RGB PIL image of random pixels."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def pixtral_processor_class() -> type:
    """transformers' ``PixtralProcessor``, imported without torchvision: its module imports
    the size rule from the torchvision image processor's module, which is stood in for by
    the PIL backend's (the same function) while it is imported."""
    name = "transformers.models.pixtral.image_processing_pixtral"
    module_name = "transformers.models.pixtral.processing_pixtral"
    if module_name not in sys.modules:
        from transformers.models.pixtral import image_processing_pil_pixtral as pil

        stub = types.ModuleType(name)
        stub.get_resize_output_image_size = pil.get_resize_output_image_size  # type: ignore[attr-defined]
        saved = sys.modules.get(name)
        sys.modules[name] = stub
        try:
            __import__(module_name)
        finally:
            if saved is None:
                del sys.modules[name]
            else:
                sys.modules[name] = saved
    return sys.modules[module_name].PixtralProcessor


def hf_processor(model_dir: Path) -> Any:
    """transformers' ``PixtralProcessor`` of the checkpoint: its tokenizer, the image
    processor (PIL backend), patch 4, merge 2."""
    import transformers as tf

    return pixtral_processor_class()(
        image_processor=tf.PixtralImageProcessorPil.from_pretrained(model_dir),
        tokenizer=tf.AutoTokenizer.from_pretrained(model_dir),
        patch_size=PATCH,
        spatial_merge_size=MERGE,
    )


def hf_inputs(model_dir: Path, prompt: str, images: list[Any]) -> dict[str, torch.Tensor]:
    """HF's model inputs for ``prompt`` (one ``[IMG]`` per image) and ``images``:
    ``input_ids``, ``pixel_values`` (padded to the largest) and ``image_sizes``."""
    processor = hf_processor(model_dir)
    out = processor(text=prompt, images=images or None, return_tensors="pt")
    return {name: value for name, value in out.items() if name != "attention_mask"}


def hf_model(model_dir: Path) -> Any:
    import transformers as tf

    return tf.Mistral3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
