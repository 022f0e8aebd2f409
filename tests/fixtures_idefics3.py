"""Tiny random Idefics3 / SmolVLM checkpoints that take images, and HF's answers for them.

:func:`save_tiny_idefics3` writes a checkpoint folder as transformers saves
``Idefics3ForConditionalGeneration`` (``smolvlm=False``) or
``SmolVLMForConditionalGeneration`` (``smolvlm=True``; its LM head tied at the top level):
``config.json`` and ``model.safetensors`` (``model.text_model.*``, ``model.vision_model.*``,
``model.connector.*``, ``lm_head.*``), a Llama text model of 2 layers and a tower of 2 layers,
hidden 32, patch 14 at 56 pixels (4 x 4 patches, shuffled by ``scale_factor`` 2 into 2 x 2:
4 rows a tile). The tokenizer is SmolLM2's with ``<fake_token_around_image>`` (49152),
``<image>`` (49153, the image token), ``<end_of_utterance>`` and ``<global-img>`` added as
special tokens (SmolVLM: the ``<row_r_col_c>`` labels too; Idefics3's are plain text here);
``preprocessor_config.json`` is transformers' image processor (longest edge 112, tiles of 56,
splitting on) and ``processor_config.json`` says ``image_seq_len`` 4. The chat template
writes an image part as ``<image>``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

SIDE = 56
ROWS_PER_TILE = 4
FAKE_ID, IMAGE_TOKEN_ID = 49152, 49153
IMAGE_TOKEN = "<image>"
BASE_TOKENS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
ROW_COL_TOKENS = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
CHAT_TEMPLATE = (
    "<|im_start|>{% for m in messages %}{{ m.role | capitalize }}:"
    "{% if m.content is string %} {{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type in ['image', 'image_url', 'image_pil'] %}<image>"
    "{% elif p.type == 'text' %} {{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def tiny_config(smolvlm: bool = False) -> Any:
    """The ``Idefics3Config`` / ``SmolVLMConfig`` of the tiny model (module docstring)."""
    import transformers as tf
    from fixtures_models import TINY_CONFIG_FIELDS

    text = tf.LlamaConfig(**{**TINY_CONFIG_FIELDS, "vocab_size": 49200})
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": SIDE,
        "patch_size": 14,
    }
    if smolvlm:
        return tf.SmolVLMConfig(
            text_config=text.to_dict(),
            vision_config=tf.SmolVLMVisionConfig(**vision).to_dict(),
            image_token_id=IMAGE_TOKEN_ID,
            scale_factor=2,
            tie_word_embeddings=True,
        )
    return tf.Idefics3Config(
        text_config=text.to_dict(),
        vision_config=tf.Idefics3VisionConfig(**vision).to_dict(),
        image_token_id=IMAGE_TOKEN_ID,
        scale_factor=2,
    )


def image_processor(smolvlm: bool = False, **overrides: Any) -> Any:
    """transformers' image processor (PIL backend) of the tiny checkpoints."""
    import transformers as tf

    settings: dict[str, Any] = {
        "size": {"longest_edge": 2 * SIDE},
        "max_image_size": {"longest_edge": SIDE},
        **overrides,
    }
    kind = tf.SmolVLMImageProcessorPil if smolvlm else tf.Idefics3ImageProcessorPil
    return kind(**settings)


def save_tiny_idefics3(directory: Path, smolvlm: bool = False, seed: int = 0) -> Path:
    """Write the tiny random float32 checkpoint (the module docstring) to ``directory``;
    1-D parameters (biases, norms) are randomized too."""
    import transformers as tf

    from chassis.core.gguf_checkpoint import embedded_model_dir

    directory = Path(directory)
    torch.manual_seed(seed)
    kind = tf.SmolVLMForConditionalGeneration if smolvlm else tf.Idefics3ForConditionalGeneration
    model = kind(tiny_config(smolvlm)).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = tf.AutoTokenizer.from_pretrained(embedded_model_dir())
    specials = BASE_TOKENS + (ROW_COL_TOKENS if smolvlm else [])
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    image_processor(smolvlm).save_pretrained(directory)
    processor = "SmolVLMProcessor" if smolvlm else "Idefics3Processor"
    (directory / "processor_config.json").write_text(
        json.dumps({"image_seq_len": ROWS_PER_TILE, "processor_class": processor})
    )
    return directory


@functools.cache
def hf_processor(model_dir: Path, smolvlm: bool = False) -> Any:
    """transformers' ``Idefics3Processor`` of the checkpoint (PIL image processor). SmolVLM's
    processor needs ``num2words``; its image prompt strings are Idefics3's (the test checks
    them against ``processing_smolvlm.get_image_prompt_string``), so Idefics3's processor
    over SmolVLM's image processor stands for it."""
    import transformers as tf

    kind = tf.SmolVLMImageProcessorPil if smolvlm else tf.Idefics3ImageProcessorPil
    return tf.Idefics3Processor(
        image_processor=kind.from_pretrained(model_dir),
        tokenizer=tf.AutoTokenizer.from_pretrained(model_dir),
        image_seq_len=ROWS_PER_TILE,
    )


def hf_inputs(
    model_dir: Path, prompt: str, images: list[Any], smolvlm: bool = False
) -> dict[str, torch.Tensor]:
    """HF's model inputs for ``prompt`` (one ``<image>`` per image) and ``images``."""
    out = hf_processor(model_dir, smolvlm)(text=prompt, images=images or None, return_tensors="pt")
    return {name: value for name, value in out.items() if name != "attention_mask"}


def hf_model(model_dir: Path, smolvlm: bool = False) -> Any:
    import transformers as tf

    kind = tf.SmolVLMForConditionalGeneration if smolvlm else tf.Idefics3ForConditionalGeneration
    return kind.from_pretrained(model_dir, dtype=torch.float32).eval()
