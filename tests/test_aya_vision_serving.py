"""Aya Vision with images through the engine and its front-end, against HF transformers on
the tiny random checkpoint of tests/fixtures_aya_vision.py (the model itself:
tests/test_aya_vision_images.py).

Checked, float32: prompts that write images as HF's text ``<image>`` (what Aya Vision's chat
template writes; BPE merges its characters with the neighbours') expand to
``AyaVisionProcessor``'s ids; ``LLM.chat`` with an ``image_url`` part (a PNG ``data:`` URL)
renders the fixture's template and answers as HF ``generate``, and so does
``/v1/chat/completions`` (``/tokenize``: HF's expanded ids); steps of 16 tokens cutting
through two images (4-token blocks) answer as unchunked HF, each image encoded once, and the
same prompt again hits the prefix cache over both images without running the tower; two
tensor-parallel ranks answer as HF; and the refusals.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_aya_vision import (
    IMAGE_TOKEN,
    IMAGE_TOKEN_ID,
    SIDE,
    hf_inputs,
    hf_model,
    save_tiny_aya_vision,
    tiny_config,
)
from fixtures_llava import random_image
from mm_hf_compare import (
    CHUNKED,
    PARAMS,
    answers,
    answers_and_cached,
    checkpoint_fixtures,
    image_url_chat,
    png_data_url,
    processor_fixture,
    small_llm,
    two_rank_answers,
)
from test_aya_vision_images import ONE, TWO, hf_answer, image
from test_models_parity import Runner

from chassis.builtin_plugins.models.aya_vision_images import (
    AyaVisionForConditionalGenerationWithImages,
)
from chassis.builtin_plugins.models.aya_vision_processing import AyaVisionImageInputs
from chassis.builtin_plugins.models.llava import AyaVisionForConditionalGeneration
from chassis.core.model_loader import language_model_config, model_class
from chassis.core.tokenizer import load_tokenizer

#: HF's text for an image
HF_IMAGE = "<image>"


model_dir, hf, runner = checkpoint_fixtures(save_tiny_aya_vision, hf_model)
processor = processor_fixture(AyaVisionImageInputs)


# -- HF's <image> text in prompts --------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt",
    [
        ONE.replace(IMAGE_TOKEN, HF_IMAGE),
        TWO.replace(IMAGE_TOKEN, HF_IMAGE),  # " <" and ">." are single BPE tokens
        "x<image>\n<image>",
        TWO.replace(IMAGE_TOKEN, HF_IMAGE, 1),  # one of each
    ],
)
def test_hf_image_text_expands_as_aya_vision_processor(
    model_dir: Path, processor: AyaVisionImageInputs, prompt: str
) -> None:
    pictures = [image("wide"), image("square")][
        : prompt.count(HF_IMAGE) + prompt.count(IMAGE_TOKEN)
    ]
    ids = load_tokenizer(model_dir)(prompt).input_ids
    assert IMAGE_TOKEN_ID not in ids or IMAGE_TOKEN in prompt
    expected = hf_inputs(model_dir, prompt, pictures)
    expanded, features = processor.process(ids, {"image": pictures})
    assert expanded == expected["input_ids"][0].tolist()
    assert len(features) == len(pictures)
    pixels = torch.cat([f.tensors()["pixel_values"] for f in features])
    torch.testing.assert_close(pixels, expected["pixel_values"], atol=0, rtol=0)
    # a prompt without images, or with text only, passes through untouched
    text_ids = load_tokenizer(model_dir)("no image here").input_ids
    assert processor.image_tokens(text_ids) == text_ids


def test_chat_with_an_image_url_part_matches_hf(model_dir: Path, hf: Any) -> None:
    """The fixture's template writes HF's ``<image>``; the PNG data URL decodes to the same
    pixels; the answer is HF's on the same text and image."""
    picture = image("wide")
    llm = small_llm(model_dir)
    try:
        [output] = llm.chat(image_url_chat(png_data_url(picture)), PARAMS)
    finally:
        llm.shutdown()
    assert output.prompt == ONE.replace(IMAGE_TOKEN, HF_IMAGE)
    [chatted] = answers([output])
    chatted.assert_matches(hf_answer(hf, model_dir, ONE, [picture]), "chat")


def test_chat_over_the_api_server(model_dir: Path, hf: Any) -> None:
    """``/v1/chat/completions`` with an ``image_url`` part: HF's prompt length and greedy
    text; ``/tokenize`` gives the expanded prompt."""
    from fastapi.testclient import TestClient

    from chassis.core.async_llm import AsyncLLM
    from chassis.core.config import EngineConfig
    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    picture = image("thin")
    messages = image_url_chat(png_data_url(picture))
    expected_ids = hf_inputs(model_dir, ONE, [picture])["input_ids"][0].tolist()
    expected = hf_answer(hf, model_dir, ONE, [picture])
    engine = AsyncLLM.from_engine_config(
        EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64)
    )
    try:
        with TestClient(build_app(engine, ServerSettings(shutdown_engine_on_exit=False))) as client:
            body = {"messages": messages, "max_tokens": len(expected.tokens), "temperature": 0}
            answer = client.post("/v1/chat/completions", json={**body, "ignore_eos": True})
            tokens = client.post("/tokenize", json={"messages": messages})
    finally:
        engine.shutdown_sync()
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == len(expected_ids)
    text = load_tokenizer(model_dir).decode(expected.tokens, skip_special_tokens=True)
    assert answer.json()["choices"][0]["message"]["content"] == text
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["tokens"] == expected_ids


def test_chunked_prefill_and_prefix_cache_through_two_images(
    model_dir: Path, hf: Any, processor: AyaVisionImageInputs
) -> None:
    """Steps of 16 tokens cut through a 7-tile image's run and a 1-tile one (4-token
    blocks); the same request again is served from the prefix cache over both runs."""
    pictures = [image("thin"), image("square")]
    prompt = TWO.replace(IMAGE_TOKEN, HF_IMAGE)
    expected = hf_answer(hf, model_dir, prompt, pictures)
    ids = load_tokenizer(model_dir)(prompt).input_ids
    _, features = processor.process(ids, {"image": pictures})
    assert features[0].end - features[0].offset > 16  # the budget cuts through the first run
    llm = small_llm(model_dir, **CHUNKED)
    runner = llm.engine.executor.worker.runner
    request = {"prompt": prompt, "multi_modal_data": {"image": pictures}}
    try:
        [(cold, cold_cached)] = answers_and_cached(llm.generate([request], PARAMS))
        assert runner.mm.num_encoder_runs == 2  # once per image, though it took many steps
        [(warm, warm_cached)] = answers_and_cached(llm.generate([request], PARAMS))
    finally:
        llm.shutdown()
    cold.assert_matches(expected, "chunked")
    warm.assert_matches(expected, "prefix-cached")
    assert cold_cached == 0 and warm_cached >= features[-1].end
    assert runner.mm.num_encoder_runs == 2  # the cached images needed none


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_tensor_parallel_ranks_with_images(model_dir: Path, hf: Any) -> None:
    """Rank 1 gets the features over the wire and runs the whole tower itself (the Cohere2
    text model is sharded): HF's answer."""
    pictures = [image("big"), image("square")]
    [got] = two_rank_answers(model_dir, [{"prompt": TWO, "multi_modal_data": {"image": pictures}}])
    got.assert_matches(hf_answer(hf, model_dir, TWO, pictures), "two ranks")


# -- refusals ---------------------------------------------------------------------------------


def test_bad_inputs_are_clear_errors(
    model_dir: Path, runner: Runner, processor: AyaVisionImageInputs, tmp_path: Path
) -> None:
    from PIL import Image

    model = runner.model
    pixels = torch.zeros(1, 3, SIDE, SIDE)
    run = torch.tensor(processor.placeholder_ids(1))
    with pytest.raises(ValueError, match="takes images, not 'video'"):
        model.embed_multimodal("video", {"pixel_values": pixels, "placeholder_ids": run})
    with pytest.raises(ValueError, match="need pixel_values and placeholder_ids"):
        model.embed_multimodal("image", {"pixel_values": pixels})
    with pytest.raises(ValueError, match="one image"):
        model.embed_multimodal(
            "image", {"pixel_values": pixels[None].repeat(2, 1, 1, 1, 1), "placeholder_ids": run}
        )
    with pytest.raises(ValueError, match="its placeholder run holds 8 image tokens"):
        model.embed_multimodal("image", {"pixel_values": pixels, "placeholder_ids": run.repeat(2)})

    tokenizer = load_tokenizer(model_dir)
    with pytest.raises(ValueError, match=r"PIL\.Image\.Image"):
        processor.process([IMAGE_TOKEN_ID], {"image": [np.zeros((56, 56, 3))]})
    with pytest.raises(ValueError, match="1 image placeholder"):
        processor.process([IMAGE_TOKEN_ID], {"image": [random_image(8, 8)] * 2})
    with pytest.raises(ValueError, match="the image is empty"):
        processor.process([IMAGE_TOKEN_ID], {"image": [Image.new("RGB", (0, 5))]})
    with pytest.raises(ValueError, match="mm_processor_kwargs are not supported"):
        processor.process([IMAGE_TOKEN_ID], {"image": [random_image(8, 8)]}, {"max_patches": 2})
    # "<image>" spelt by tokens the tokenizer would not choose: no guessing
    odd = tokenizer.convert_tokens_to_ids(list("<image>"))
    with pytest.raises(ValueError, match="not the tokenizer's encoding"):
        processor.process(odd, {"image": [random_image(8, 8)]})

    # processor files that do not fit the model are refused when the processor is built
    hf_config = runner.hf_config
    for path in model_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    settings_path = tmp_path / "processor_config.json"
    settings = json.loads(settings_path.read_text())
    settings_path.write_text(json.dumps({**settings, "img_size": 112}))
    with pytest.raises(ValueError, match="writes 16 image tokens per tile"):
        AyaVisionImageInputs.from_pretrained(tmp_path, hf_config)
    settings_path.write_text(json.dumps({**settings, "img_patch_token": "<|NO_SUCH|>"}))
    with pytest.raises(ValueError, match=r"no '<\|NO_SUCH\|>' token"):
        AyaVisionImageInputs.from_pretrained(tmp_path, hf_config)
    settings_path.write_text(json.dumps(settings))
    (tmp_path / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match=r"no preprocessor_config\.json"):
        AyaVisionImageInputs.from_pretrained(tmp_path, hf_config)

    # settings HF's model cannot run either are refused when the model is built
    for overrides, error in (
        ({"vision_feature_select_strategy": "default"}, "only 'full'"),
        ({"downsample_factor": 3}, "downsample_factor 3 does not divide"),
    ):
        config = json.loads((model_dir / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, **overrides}))
        with pytest.raises(ValueError, match=error):
            Runner(tmp_path)


def test_another_tower_is_served_as_text_only() -> None:
    import transformers as tf

    config = tiny_config()
    config.architectures = ["AyaVisionForConditionalGeneration"]
    with_images = model_class(language_model_config(config))
    assert issubclass(with_images, AyaVisionForConditionalGenerationWithImages)
    assert with_images.supported_modalities == {"image"}
    config.vision_config = tf.CLIPVisionConfig(
        hidden_size=32, num_attention_heads=2, num_hidden_layers=1
    )
    cls = model_class(language_model_config(config))
    assert not issubclass(cls, AyaVisionForConditionalGenerationWithImages)
    assert issubclass(cls, AyaVisionForConditionalGeneration)
    assert not cls.supported_modalities
