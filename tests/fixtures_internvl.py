"""Tiny random InternVL checkpoints that take images, and HF's answers for them.

:func:`save_tiny_internvl` writes a checkpoint folder as transformers saves the ``-hf`` ones:
``config.json`` and ``model.safetensors`` (``language_model.model.*``, ``vision_tower.*``,
``multi_modal_projector.*``; the LM head tied by the top-level default, as InternVL3-1B's), a
Qwen2 text model of 2 layers and hidden 64, and an InternViT tower of 2 layers, hidden 32,
patch 14 at 56 pixels (4 x 4 patches, shuffled by 0.5 into 2 x 2: 4 rows a tile;
``vision_feature_layer`` -1, ``"default"``). ``vision`` overrides set tower fields (RMSNorm,
q/k norms, the final LayerNorm), ``overrides`` the wrapper's. The tokenizer is SmolLM2's with
``<img>`` (49152), ``</img>`` (49153), ``<IMG_CONTEXT>`` (49154, the image token) and
``<video>`` added as transformers' InternVL tokenizers name them, and InternVL's chat template
(``<IMG_CONTEXT>\\n`` per image); ``preprocessor_config.json`` is transformers'
``GotOcr2ImageProcessor`` (56 x 56 tiles, 1 to 6 of them, ImageNet mean and std) and
``processor_config.json`` says ``image_seq_length`` 4.

:func:`hf_inputs` runs transformers' ``InternVLProcessor`` over that image processor (its PIL
backend; no torchvision here, so the processor is built without its video processor).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SIDE = 56  # the tower's image_size: a tile
TOKENS_PER_TILE = 4
MAX_TILES = 6
START_ID, END_ID, IMAGE_TOKEN_ID = 49152, 49153, 49154
IMAGE_TOKEN = "<IMG_CONTEXT>"
SPECIAL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": IMAGE_TOKEN,
    "video_token": "<video>",
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type in ['image', 'image_url', 'image_pil'] %}<IMG_CONTEXT>\n"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_config(vision: dict[str, Any] | None = None, **overrides: Any) -> Any:
    """The ``InternVLConfig`` of the tiny model (module docstring)."""
    import transformers as tf
    from fixtures_models import TINY_CONFIG_FIELDS

    text = tf.Qwen2Config(**{**TINY_CONFIG_FIELDS, "vocab_size": 49160})
    vision_config = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": [SIDE, SIDE],
        "patch_size": [14, 14],
        "attention_bias": True,
        **(vision or {}),
    }
    fields: dict[str, Any] = {"image_seq_length": TOKENS_PER_TILE, **overrides}
    return tf.InternVLConfig(
        text_config=text.to_dict(),
        vision_config=vision_config,
        image_token_id=IMAGE_TOKEN_ID,
        **fields,
    )


def image_processor(**overrides: Any) -> Any:
    """transformers' GOT-OCR2 image processor (PIL backend) of the tiny checkpoints."""
    import transformers as tf

    settings: dict[str, Any] = {
        "size": {"height": SIDE, "width": SIDE},
        "max_patches": MAX_TILES,
        "image_mean": [0.485, 0.456, 0.406],
        "image_std": [0.229, 0.224, 0.225],
        **overrides,
    }
    return tf.GotOcr2ImageProcessorPil(**settings)


def save_tiny_internvl(
    directory: Path, seed: int = 0, vision: dict[str, Any] | None = None, **overrides: Any
) -> Path:
    """Write the tiny random float32 checkpoint (the module docstring) to ``directory``;
    1-D parameters (biases, norms, layer scales) and the class and position rows are
    randomized too."""
    import transformers as tf

    from chassis.core.gguf_checkpoint import embedded_model_dir

    directory = Path(directory)
    torch.manual_seed(seed)
    model = tf.InternVLForConditionalGeneration(tiny_config(vision, **overrides))
    model = model.to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
            elif "cls_token" in name or "position_embeddings" in name:
                param.copy_(0.5 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = tf.AutoTokenizer.from_pretrained(
        embedded_model_dir(), extra_special_tokens=SPECIAL_TOKENS
    )
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    image_processor().save_pretrained(directory)
    (directory / "processor_config.json").write_text(
        json.dumps({"image_seq_length": TOKENS_PER_TILE, "processor_class": "InternVLProcessor"})
    )
    return directory


def _processor_class() -> type:
    import transformers as tf

    class InternVLProcessorWithoutVideo(tf.InternVLProcessor):
        """``InternVLProcessor`` built without a video processor (torchvision's)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return InternVLProcessorWithoutVideo


def hf_processor(model_dir: Path) -> Any:
    """transformers' ``InternVLProcessor`` of the checkpoint: its tokenizer, the image
    processor (PIL backend), ``image_seq_length`` 4."""
    import transformers as tf

    return _processor_class()(
        image_processor=tf.GotOcr2ImageProcessorPil.from_pretrained(model_dir),
        tokenizer=tf.AutoTokenizer.from_pretrained(model_dir),
        image_seq_length=TOKENS_PER_TILE,
    )


def hf_inputs(model_dir: Path, prompt: str, images: list[Any]) -> dict[str, torch.Tensor]:
    """HF's model inputs for ``prompt`` (one ``<IMG_CONTEXT>`` per image) and ``images``."""
    processor = hf_processor(model_dir)
    out = processor(text=prompt, images=images or None, return_tensors="pt")
    return {name: value for name, value in out.items() if name != "attention_mask"}


def hf_model(model_dir: Path) -> Any:
    import transformers as tf

    return tf.InternVLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
