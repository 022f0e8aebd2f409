"""LLaVA-family checkpoints over a Granite text model (ibm-granite/granite-vision-3.x:
LLaVA-NeXT over Granite) against HF transformers on tiny random float32 checkpoints
(tests/fixtures_llava.py, tests/fixtures_llava_next.py with a Granite ``text_config`` whose
multipliers are far from 1).

transformers' LLaVA classes compute the logits with their own LM head (no division by
Granite's ``logits_scaling``) and hand the text model ``inputs_embeds`` with the image rows
spliced in, which Granite's forward multiplies by ``embedding_multiplier``, image rows
included. Checked: prefill and decode logits with an image (LLaVA-1.5 and LLaVA-NeXT) and on
a text prompt to 1e-4; greedy tokens and logprobs through ``LLM`` with an image, with HF's
image features given as image embeddings, and on text, as HF ``generate``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fixtures_llava
import fixtures_llava_next
import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS
from mm_hf_compare import (
    PARAMS,
    answers,
    assert_prefill_and_decode_match,
    hf_generate,
    media_prompts,
    small_llm,
)
from test_models_parity import Runner

from chassis.builtin_plugins.models.granite import GraniteForCausalLM
from chassis.core.multimodal import MultiModalFeature, make_feature

ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TEXT = "USER: Tell me a story. ASSISTANT:"
#: multipliers far from 1, so a missing or doubled one shows
MULTIPLIERS = {
    "embedding_multiplier": 6.0,
    "logits_scaling": 4.0,
    "residual_multiplier": 0.3,
    "attention_multiplier": 0.2,
}


def granite_text_config() -> dict[str, Any]:
    import transformers as tf

    fields = {**TINY_CONFIG_FIELDS, "vocab_size": 49160}
    return tf.GraniteConfig(**fields, tie_word_embeddings=False, **MULTIPLIERS).to_dict()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per family: (folder, HF model, runner)."""
    text_config = granite_text_config()
    llava = fixtures_llava.save_tiny_llava(
        tmp_path_factory.mktemp("llava_granite"), text_config=text_config
    )
    llava_next = fixtures_llava_next.save_tiny_llava_next(
        tmp_path_factory.mktemp("llava_next_granite"), text_config=text_config
    )
    return {
        "llava": (llava, fixtures_llava.hf_model(llava), Runner(llava)),
        "llava_next": (llava_next, fixtures_llava_next.hf_model(llava_next), Runner(llava_next)),
    }


def image_features(inputs: dict[str, torch.Tensor], length: int) -> list[MultiModalFeature]:
    """The one image of HF's ``inputs`` as the front-end's feature (``length`` tokens)."""
    ids = inputs["input_ids"][0].tolist()
    start = ids.index(fixtures_llava.IMAGE_TOKEN_ID)
    tensors = {"pixel_values": inputs["pixel_values"][:1]}
    if "image_sizes" in inputs:
        tensors["image_sizes"] = inputs["image_sizes"][:1]
    return [make_feature("image", start, length, tensors)]


def hf_inputs(family: str, model_dir: Path, prompt: str, images: list[Any]) -> Any:
    fixtures = fixtures_llava if family == "llava" else fixtures_llava_next
    return fixtures.hf_inputs(model_dir, prompt, images)


@pytest.mark.parametrize("family", ["llava", "llava_next"])
def test_logits_with_an_image_and_on_text_match_transformers(
    checkpoints: dict[str, Any], family: str
) -> None:
    model_dir, hf, runner = checkpoints[family]
    assert isinstance(runner.model, GraniteForCausalLM)
    assert not runner.model.applies_logits_scaling  # HF's LLaVA head divides nothing
    inputs = hf_inputs(family, model_dir, ONE, [fixtures_llava.random_image(90, 60, seed=1)])
    length = int((inputs["input_ids"][0] == fixtures_llava.IMAGE_TOKEN_ID).sum())
    assert_prefill_and_decode_match(runner, hf, inputs, image_features(inputs, length))
    text = hf_inputs(family, model_dir, TEXT, [])
    assert_prefill_and_decode_match(runner, hf, text, [])


def test_generate_with_an_image_its_embeddings_and_text_match_hf(
    checkpoints: dict[str, Any],
) -> None:
    """LLaVA over Granite through ``LLM``: an image, HF's ``get_image_features`` rows given as
    image embeddings (scaled by the runner as HF's Granite scales them) and a text prompt in
    one batch; each answer is HF ``generate``'s."""
    model_dir, hf, _ = checkpoints["llava"]
    picture = fixtures_llava.random_image(90, 60, seed=1)
    inputs = hf_inputs("llava", model_dir, ONE, [picture])
    with torch.no_grad():
        features = hf.get_image_features(pixel_values=inputs["pixel_values"])
    rows = getattr(features, "pooler_output", features)
    rows = torch.cat([r.reshape(-1, r.shape[-1]) for r in rows]).detach()
    prompts = media_prompts([(ONE, [picture]), (ONE, [rows]), (TEXT, [])])
    llm = small_llm(model_dir, enable_mm_embeds=True)
    try:
        got = answers(llm.generate(prompts, PARAMS))
    finally:
        llm.shutdown()
    expected = hf_generate(hf, inputs)
    got[0].assert_matches(expected, "image")
    got[1].assert_matches(expected, "image embeddings")
    got[2].assert_matches(hf_generate(hf, hf_inputs("llava", model_dir, TEXT, [])), "text")
