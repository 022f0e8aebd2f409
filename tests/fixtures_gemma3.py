"""A tiny random Gemma 3 checkpoint that takes images, and HF's processor for it.

:func:`save_tiny_gemma3` writes ``Gemma3ForConditionalGeneration`` as the hub ships it
(``language_model.model.*``, ``vision_tower.vision_model.*``, ``multi_modal_projector.*``;
``layout="saved"`` keeps what transformers 5 saves, ``vision_tower.*``): a Gemma 3 text model
of 2 layers (hidden 64, ``head_dim`` 32; layer 0 full attention, layer 1 sliding with a
window of 5, so the window cuts through an image's 16 tokens), a SigLIP tower of 2 layers at
56 pixels in patches of 7 (64 patches), pooled 2 x 2 to 16 image tokens. Every 1-D
parameter and the projection are randomized (HF starts the projection at zeros).

The tokenizer is SmolLM2's with Gemma 3's image tokens added (``<start_of_image>`` 49152,
``<end_of_image>`` 49153, ``<image_soft_token>`` 49154, as the tokenizer's ``boi_token``,
``eoi_token`` and ``image_token``) and ``<start_of_turn>`` / ``<end_of_turn>``; a chat template
in Gemma 3's style; ``preprocessor_config.json`` is transformers' ``Gemma3ImageProcessor`` at
56 x 56. :func:`hf_processor` is transformers' ``Gemma3Processor`` over them (PIL backend).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BOI_ID, EOI_ID, IMAGE_TOKEN_ID = 49152, 49153, 49154
SIDE = 56
TOKENS_PER_IMAGE = 16
WINDOW = 5

CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type in ['image', 'image_url', 'image_pil'] %}<start_of_image>"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def tiny_config() -> Any:
    """The tiny ``Gemma3Config`` (module docstring)."""
    import transformers as tf
    from fixtures_models import TINY_CONFIG_FIELDS

    text = tf.Gemma3TextConfig(
        **{**TINY_CONFIG_FIELDS, "vocab_size": 49160},
        head_dim=32,
        sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention"],
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
    )
    vision = tf.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=SIDE,
        patch_size=7,
    )
    return tf.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=IMAGE_TOKEN_ID,
        boi_token_index=BOI_ID,
        eoi_token_index=EOI_ID,
    )


def save_tiny_gemma3(directory: Path, seed: int = 0, layout: str = "hub") -> Path:
    """Write the tiny random float32 checkpoint (module docstring) to ``directory``."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    from chassis.core.gguf_checkpoint import embedded_model_dir

    directory = Path(directory)
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(tiny_config()).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                # Gemma's RMSNorms store an offset from 1; SigLIP's LayerNorms a weight
                base = 1.0 if "vision_tower" in name and "norm" in name else 0.0
                param.copy_(base + 0.2 * torch.randn_like(param))
            elif name.endswith("mm_input_projection_weight"):
                param.copy_(0.2 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    if layout == "hub":  # google's files name the tower vision_tower.vision_model.*
        path = directory / "model.safetensors"
        tensors = {
            name.replace("vision_tower.", "vision_tower.vision_model.", 1): tensor
            for name, tensor in load_file(path).items()
        }
        save_file(tensors, path, metadata={"format": "pt"})
    tokenizer = tf.AutoTokenizer.from_pretrained(embedded_model_dir())
    tokenizer.add_tokens(
        ["<start_of_image>", "<end_of_image>", "<image_soft_token>"], special_tokens=True
    )
    tokenizer.add_tokens(["<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    assert tokenizer.convert_tokens_to_ids("<image_soft_token>") == IMAGE_TOKEN_ID
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    _declare_image_tokens(directory / "tokenizer_config.json")
    tf.Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}).save_pretrained(directory)
    return directory


def _declare_image_tokens(path: Path) -> None:
    """Name the image tokens as Gemma's tokenizer config does (``Gemma3Processor`` reads
    ``tokenizer.boi_token`` / ``eoi_token`` / ``image_token``)."""
    import json

    config = json.loads(path.read_text())
    config["extra_special_tokens"] = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    path.write_text(json.dumps(config, indent=2))


def hf_processor(model_dir: Path) -> Any:
    """transformers' ``Gemma3Processor`` of the checkpoint (PIL image processor)."""
    import transformers as tf

    return tf.Gemma3Processor(
        image_processor=tf.Gemma3ImageProcessorPil.from_pretrained(model_dir),
        tokenizer=tf.AutoTokenizer.from_pretrained(model_dir),
        image_seq_length=TOKENS_PER_IMAGE,
    )


def hf_inputs(model_dir: Path, prompt: str, images: list[Any]) -> dict[str, torch.Tensor]:
    """HF's model inputs (``input_ids``, ``token_type_ids``, ``pixel_values``) for ``prompt``
    (one ``<start_of_image>`` per image) and ``images``."""
    out = hf_processor(model_dir)(text=prompt, images=images or None, return_tensors="pt")
    return {name: value for name, value in out.items() if name != "attention_mask"}


def hf_model(model_dir: Path) -> Any:
    import transformers as tf

    return tf.Gemma3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
