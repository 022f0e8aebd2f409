"""Aya Vision (``AyaVisionForConditionalGeneration``) with images against HF transformers on
tiny random checkpoints (tests/fixtures_aya_vision.py: Cohere2 text, 2 layers; a 2-layer
SigLIP tower of 56-pixel tiles, 4 x 4 patches shuffled into 4 rows a tile; 1 to 6 tiles plus
a thumbnail). Checked, float32: image rows against ``get_image_features`` to 1e-5; the
expanded prompt against ``AyaVisionProcessor``; prefill and decode logits with images against
HF's forward to 1e-4; greedy tokens and logprobs through ``LLM.generate`` against HF
``generate``; a bfloat16 model's rows; which tensors are read, in the three layouts. (HF's
``<image>`` text, chat, chunked prefill, the prefix cache, tensor parallelism and the
refusals: tests/test_aya_vision_serving.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_aya_vision import (
    END_ID,
    IMAGE_TOKEN_ID,
    START_ID,
    TOKENS_PER_TILE,
    hf_inputs,
    hf_model,
    save_tiny_aya_vision,
)
from fixtures_llava import random_image
from mm_hf_compare import (
    Answer,
    assert_prefill_and_decode_match,
    checkpoint_fixtures,
    generate_answers,
    hf_generate,
    media_prompts,
    processor_fixture,
    read_tensors,
)
from safetensors.torch import load_file, save_file
from test_models_parity import Runner

from chassis.builtin_plugins.models.aya_vision_images import (
    AyaVisionForConditionalGenerationWithImages,
)
from chassis.builtin_plugins.models.aya_vision_processing import AyaVisionImageInputs

ONE = "<|im_start|>user\n<|IMG_PATCH|>What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = (
    "<|im_start|>user\nCompare <|IMG_PATCH|> with <|IMG_PATCH|>.<|im_end|>\n<|im_start|>assistant\n"
)
TEXT = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"


model_dir, hf, runner = checkpoint_fixtures(save_tiny_aya_vision, hf_model)
processor = processor_fixture(AyaVisionImageInputs)

IMAGES = {"square": (56, 56), "wide": (60, 130), "thin": (200, 20), "big": (100, 101)}


def image(name: str) -> Any:
    return random_image(*IMAGES[name], seed=list(IMAGES).index(name))


def expand(processor: AyaVisionImageInputs, model_dir: Path, prompt: str, pictures: list[Any]):
    from chassis.core.tokenizer import load_tokenizer

    ids = load_tokenizer(model_dir)(prompt).input_ids
    return processor.process(ids, {"image": pictures})


def test_image_rows_match_get_image_features(model_dir: Path, hf: Any, runner: Runner) -> None:
    model = runner.model
    assert isinstance(model, AyaVisionForConditionalGenerationWithImages)
    assert model.logit_scale == 0.25  # Cohere2's, as transformers 5.25 and vLLM apply it
    for name, tiles in (("square", 1), ("wide", 3), ("thin", 7)):
        pixels = hf_inputs(model_dir, ONE, [image(name)])["pixel_values"]
        assert pixels.shape[0] == tiles
        with torch.no_grad():
            expected = hf.get_image_features(pixel_values=pixels).pooler_output
            ours = model.image_features(pixels)
        assert ours.shape == (tiles, TOKENS_PER_TILE, 64)
        assert expected.abs().max() > 1e-3
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5, msg=name)


def test_prompts_expand_as_aya_vision_processor(
    model_dir: Path, processor: AyaVisionImageInputs
) -> None:
    """The run (start, tile labels and patches, TILE_GLOBAL, end) is HF's, with its pixels;
    each feature covers its whole run."""
    pictures = [image("thin"), image("square")]
    expected = hf_inputs(model_dir, TWO, pictures)
    expanded, features = expand(processor, model_dir, TWO, pictures)
    assert expanded == expected["input_ids"][0].tolist()
    patches = [sum(1 for t in expanded[f.offset : f.end] if t == IMAGE_TOKEN_ID) for f in features]
    assert patches == [7 * TOKENS_PER_TILE, TOKENS_PER_TILE]
    for feature in features:
        assert expanded[feature.offset] == START_ID and expanded[feature.end - 1] == END_ID
    pixels = torch.cat([f.tensors()["pixel_values"] for f in features])
    torch.testing.assert_close(pixels, expected["pixel_values"], atol=0, rtol=0)


@pytest.mark.parametrize("pictures", [("wide",), ("big", "square")])
def test_logits_with_images_match_transformers(
    model_dir: Path,
    hf: Any,
    runner: Runner,
    processor: AyaVisionImageInputs,
    pictures: tuple[str, ...],
) -> None:
    prompt = ONE if len(pictures) == 1 else TWO
    chosen = [image(name) for name in pictures]
    inputs = hf_inputs(model_dir, prompt, chosen)
    ids, features = expand(processor, model_dir, prompt, chosen)
    assert ids == inputs["input_ids"][0].tolist()
    assert_prefill_and_decode_match(runner, hf, inputs, features)


def hf_answer(hf: Any, model_dir: Path, prompt: str, pictures: list[Any]) -> Answer:
    """HF ``generate``'s greedy answer with each token's logprob."""
    return hf_generate(hf, hf_inputs(model_dir, prompt, pictures))


def test_generate_matches_hf(model_dir: Path, hf: Any) -> None:
    """One image, two images and text in one batch: every answer is HF's."""
    cases = {
        "one": (ONE, [image("wide")]),
        "two": (TWO, [image("big"), image("square")]),
        "text": (TEXT, []),
    }
    batch = generate_answers(model_dir, media_prompts(cases.values()))
    for (what, (prompt, pictures)), answer in zip(cases.items(), batch, strict=True):
        answer.assert_matches(hf_answer(hf, model_dir, prompt, pictures), what)


def test_the_tower_runs_in_the_model_dtype(model_dir: Path, runner: Runner) -> None:
    """A bfloat16 model's rows are bfloat16, near the float32 model's."""
    processor = AyaVisionImageInputs.from_pretrained(model_dir, runner.hf_config)
    (feature,) = expand(processor, model_dir, ONE, [image("wide")])[1]
    with torch.no_grad():
        rows = Runner(model_dir, torch.bfloat16).model.embed_multimodal("image", feature.tensors())
        reference = runner.model.embed_multimodal("image", feature.tensors())
    assert feature.tensors()["pixel_values"].dtype == torch.float32
    assert rows.dtype == torch.bfloat16 and rows.shape == (feature.end - feature.offset, 64)
    torch.testing.assert_close(rows.float(), reference, atol=5e-2, rtol=5e-2)


def test_every_tensor_is_read_in_every_layout(
    model_dir: Path, runner: Runner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The saved names (``language_model.model.*``, ``vision_tower.*``,
    ``multi_modal_projector.*``): every tensor is read but SigLIP's pooling head and
    ``post_layernorm`` (HF's Aya Vision never runs them). The hub files' tower names
    (``vision_tower.vision_model.*``) and transformers' in-memory names (``model.*``) load
    the same parameters."""
    in_file = set(load_file(model_dir / "model.safetensors"))
    unused = {
        n for n in in_file if n.startswith(("vision_tower.head.", "vision_tower.post_layernorm."))
    }
    assert unused and any(n.startswith("vision_tower.encoder.layers.1.") for n in in_file)
    read, model = read_tensors(model_dir, monkeypatch)
    assert read == in_file - unused
    assert model.tie_word_embeddings  # the top-level default, as HF ties

    def hub(name: str) -> str:
        tower = "vision_tower."
        return tower + "vision_model." + name[len(tower) :] if name.startswith(tower) else name

    def in_memory(name: str) -> str:
        text = "language_model.model."
        if name.startswith(text):
            return "model.language_model." + name[len(text) :]
        return "model." + name

    params = dict(runner.model.named_parameters())
    tensors = load_file(model_dir / "model.safetensors")
    for rename in (hub, in_memory):
        renamed = tmp_path / rename.__name__
        renamed.mkdir()
        for path in model_dir.iterdir():
            if path.name != "model.safetensors":
                (renamed / path.name).write_bytes(path.read_bytes())
        save_file({rename(n): t for n, t in tensors.items()}, renamed / "model.safetensors")
        reloaded = dict(Runner(renamed).model.named_parameters())
        assert reloaded.keys() == params.keys()
        for name, param in params.items():
            assert torch.equal(reloaded[name], param), (rename.__name__, name)
