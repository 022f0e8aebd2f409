"""Idefics3 (``Idefics3ForConditionalGeneration``) and SmolVLM
(``SmolVLMForConditionalGeneration``) with images against HF transformers on tiny random
checkpoints (tests/fixtures_idefics3.py: Llama text, 2 layers; a 2-layer tower of 56-pixel
tiles, 4 x 4 patches shuffled into 4 rows a tile; a grid of tiles plus a global image).
Checked, float32: image rows against ``get_image_features`` to 1e-5 (and the tower on tiles of
another size, whose bucketed positions are not the table's own, against HF's); the expanded
prompt and pixels against ``Idefics3Processor`` with and without splitting, several sizes;
prefill and decode logits against HF's forward to 1e-4; greedy tokens and logprobs through
``LLM.generate`` against HF ``generate`` (both classes); chunked prefill through the image
runs; ``LLM.chat`` with an ``image_url`` part; a prefix-cache hit through an image and two
tensor-parallel ranks with images in 16-token steps (both classes, against HF); which tensors
are read; the refusals (image embeddings among them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_idefics3 import (
    FAKE_ID,
    IMAGE_TOKEN_ID,
    ROWS_PER_TILE,
    hf_inputs,
    hf_model,
    save_tiny_idefics3,
)
from fixtures_llava import random_image
from mm_hf_compare import (
    CHUNKED,
    PARAMS,
    Answer,
    answers,
    answers_and_cached,
    assert_prefill_and_decode_match,
    hf_generate,
    image_url_chat,
    media_prompts,
    png_data_url,
    read_tensors,
    small_llm,
    two_rank_answers,
)
from safetensors.torch import load_file
from test_models_parity import Runner

from chassis.builtin_plugins.models.idefics3_images import (
    Idefics3ForConditionalGenerationWithImages,
)
from chassis.builtin_plugins.models.idefics3_processing import Idefics3ImageInputs
from chassis.core.multimodal_embeds import precomputed_items
from chassis.core.tokenizer import load_tokenizer

ONE = "<|im_start|>User:<image> What is in the picture?<end_of_utterance>\nAssistant:"
TWO = "<|im_start|>User: Compare<image>with<image>.<end_of_utterance>\nAssistant:"
TEXT = "<|im_start|>User: Tell me a story.<end_of_utterance>\nAssistant:"
KINDS = ("idefics3", "smolvlm")
#: name -> (height, width): tiles with the fixture's splitting (longest edge 112, tiles 56)
IMAGES = {"square": (56, 56), "wide": (60, 130), "thin": (200, 20), "small": (20, 30)}


def image(name: str) -> Any:
    return random_image(*IMAGES[name], seed=list(IMAGES).index(name))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        kind: save_tiny_idefics3(
            tmp_path_factory.mktemp(kind), smolvlm=kind == "smolvlm", seed=KINDS.index(kind)
        )
        for kind in KINDS
    }


@pytest.fixture(scope="module")
def hf_models(model_dirs: dict[str, Path]) -> dict[str, Any]:
    return {kind: hf_model(path, smolvlm=kind == "smolvlm") for kind, path in model_dirs.items()}


@pytest.fixture(scope="module")
def runners(model_dirs: dict[str, Path]) -> dict[str, Runner]:
    return {kind: Runner(path) for kind, path in model_dirs.items()}


def expand(model_dir: Path, hf_config: Any, prompt: str, pictures: list[Any]):
    processor = Idefics3ImageInputs.from_pretrained(model_dir, hf_config)
    ids = load_tokenizer(model_dir)(prompt).input_ids
    return processor.process(ids, {"image": pictures})


@pytest.mark.parametrize("kind", KINDS)
def test_image_rows_match_get_image_features(
    kind: str, model_dirs: dict[str, Path], hf_models: dict[str, Any], runners: dict[str, Runner]
) -> None:
    model = runners[kind].model
    assert isinstance(model, Idefics3ForConditionalGenerationWithImages)
    for name, tiles in (("square", 5), ("wide", 3), ("thin", 3)):
        inputs = hf_inputs(model_dirs[kind], ONE, [image(name)], kind == "smolvlm")
        pixels = inputs["pixel_values"]
        assert pixels.shape[:2] == (1, tiles)
        with torch.no_grad():
            (expected,) = hf_models[kind].get_image_features(pixel_values=pixels).pooler_output
            ours = model.image_features(pixels[0])
        assert ours.shape == (tiles, ROWS_PER_TILE, 64)
        assert expected.abs().max() > 1e-3
        torch.testing.assert_close(ours.reshape(-1, 64), expected, atol=1e-5, rtol=1e-5)


def test_the_tower_buckets_positions_as_hf(
    hf_models: dict[str, Any], runners: dict[str, Runner]
) -> None:
    """Tiles of 42 and 70 pixels (3 x 3 and 5 x 5 patches on the table's 4 x 4) take HF's
    bucketed positions; so does a grid of 19 a side, where rounding bends the buckets."""
    from chassis.builtin_plugins.models.idefics3_vision import bucket_positions

    hf_tower = hf_models["idefics3"].model.vision_model
    tower = runners["idefics3"].model.vision_tower
    for side in (42, 70):
        pixels = torch.randn(2, 3, side, side)
        with torch.no_grad():
            expected = hf_tower(pixel_values=pixels).last_hidden_state
            torch.testing.assert_close(tower(pixels), expected, atol=1e-5, rtol=1e-5)
    ids = bucket_positions(19, 19, 19)
    assert not torch.equal(ids, torch.arange(19 * 19))  # float rounding, as HF's


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"do_image_splitting": False},
        {"size": {"longest_edge": 56}},  # one tile though splitting
    ],
)
def test_prompts_expand_as_hf_processor(
    kind: str,
    settings: dict[str, Any],
    model_dirs: dict[str, Path],
    runners: dict[str, Runner],
    tmp_path: Path,
) -> None:
    """The run (grid labels, newlines, the global image) and the pixels are HF's; each
    feature covers its whole run."""
    model_dir = tmp_path / "model"
    shutil.copytree(model_dirs[kind], model_dir)
    path = model_dir / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    processor = Idefics3ImageInputs.from_pretrained(model_dir, runners[kind].hf_config)
    for names in (("thin", "square"), ("wide", "small")):
        pictures = [image(name) for name in names]
        expected = hf_inputs(model_dir, TWO, pictures, kind == "smolvlm")
        ids = load_tokenizer(model_dir)(TWO).input_ids
        expanded, features = processor.process(ids, {"image": pictures})
        assert expanded == expected["input_ids"][0].tolist(), names
        for feature, picture in zip(features, pictures, strict=True):
            assert expanded[feature.offset] == FAKE_ID and expanded[feature.end - 1] == FAKE_ID
            assert feature.end - feature.offset == processor.num_tokens(
                picture.height, picture.width
            )
        pixels = torch.cat([f.tensors()["pixel_values"] for f in features])
        torch.testing.assert_close(pixels, expected["pixel_values"][0], atol=0, rtol=0)


def test_smolvlm_prompt_strings_are_hf_smolvlm_processor_strings(
    model_dirs: dict[str, Path], runners: dict[str, Runner]
) -> None:
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    processor = Idefics3ImageInputs.from_pretrained(
        model_dirs["smolvlm"], runners["smolvlm"].hf_config
    )
    for rows, cols in ((0, 0), (1, 2), (3, 1), (2, 2)):
        expected = get_image_prompt_string(
            rows, cols, ROWS_PER_TILE, "<fake_token_around_image>", "<image>", "<global-img>"
        )
        assert processor.run_text(rows, cols) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_logits_with_images_match_transformers(
    kind: str, model_dirs: dict[str, Path], hf_models: dict[str, Any], runners: dict[str, Runner]
) -> None:
    runner, hf = runners[kind], hf_models[kind]
    pictures = [image("wide"), image("square")]
    inputs = hf_inputs(model_dirs[kind], TWO, pictures, kind == "smolvlm")
    ids, features = expand(model_dirs[kind], runner.hf_config, TWO, pictures)
    assert ids == inputs["input_ids"][0].tolist()
    assert_prefill_and_decode_match(runner, hf, inputs, features)


def hf_answer(hf: Any, model_dir: Path, prompt: str, pictures: list[Any], smolvlm: bool) -> Answer:
    """HF ``generate``'s greedy answer with each token's logprob."""
    return hf_generate(hf, hf_inputs(model_dir, prompt, pictures, smolvlm))


@pytest.mark.parametrize("kind", KINDS)
def test_generate_and_chat_match_hf(
    kind: str, model_dirs: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    """One image, two images and text in one batch, then a chat with an ``image_url`` part
    (a PNG data URL): every answer is HF's."""
    model_dir, hf, smolvlm = model_dirs[kind], hf_models[kind], kind == "smolvlm"
    cases = {
        "one": (ONE, [image("wide")]),
        "two": (TWO, [image("thin"), image("square")]),
        "text": (TEXT, []),
    }
    chat = image_url_chat(png_data_url(image("wide")))
    llm = small_llm(model_dir)
    try:
        batch = answers(llm.generate(media_prompts(cases.values()), PARAMS))
        [chatted] = llm.chat(chat, PARAMS)
    finally:
        llm.shutdown()
    for (what, (prompt, pictures)), answer in zip(cases.items(), batch, strict=True):
        answer.assert_matches(hf_answer(hf, model_dir, prompt, pictures, smolvlm), what)
    assert chatted.prompt == ONE
    [answer] = answers([chatted])
    answer.assert_matches(hf_answer(hf, model_dir, ONE, [image("wide")], smolvlm), "chat")


def test_chunked_prefill_through_images_equals_unchunked(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], runners: dict[str, Runner]
) -> None:
    """Steps of 16 tokens cut through a 3-tile image's run (4-token blocks): the answer is
    the unchunked one (HF's), each image encoded once."""
    model_dir = model_dirs["smolvlm"]
    pictures = [image("thin"), image("wide")]
    _, features = expand(model_dir, runners["smolvlm"].hf_config, TWO, pictures)
    assert features[0].end - features[0].offset > 16
    llm = small_llm(model_dir, **CHUNKED)
    runner = llm.engine.executor.worker.runner
    try:
        request = {"prompt": TWO, "multi_modal_data": {"image": pictures}}
        [chunked] = answers(llm.generate([request], PARAMS))
        assert runner.mm.num_encoder_runs == 2
    finally:
        llm.shutdown()
    expected = hf_answer(hf_models["smolvlm"], model_dir, TWO, pictures, True)
    chunked.assert_matches(expected, "chunked")


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_hit_through_an_image(
    kind: str, model_dirs: dict[str, Path], hf_models: dict[str, Any], runners: dict[str, Runner]
) -> None:
    """The same prompt and image again reuses the cached blocks past the image's run (tile
    labels and rows alike; no tower run) and answers as HF; another image of the same size
    (the same tokens, other rows) reuses only the text before it."""
    model_dir = model_dirs[kind]
    _, [feature] = expand(model_dir, runners[kind].hf_config, ONE, [image("wide")])
    other = random_image(*IMAGES["wide"], seed=99)
    llm = small_llm(model_dir, block_size=4)
    mm = llm.engine.executor.worker.runner.mm

    def run(picture: Any) -> tuple[Answer, int]:
        request = {"prompt": ONE, "multi_modal_data": {"image": [picture]}}
        [(answer, cached)] = answers_and_cached(llm.generate([request], PARAMS))
        return answer, cached

    try:
        first, first_cached = run(image("wide"))
        again, again_cached = run(image("wide"))
        assert mm.num_encoder_runs == 1
        _, other_cached = run(other)
        assert mm.num_encoder_runs == 2
    finally:
        llm.shutdown()
    assert first_cached == 0 and again_cached >= feature.end
    assert other_cached <= feature.offset
    expected = hf_answer(hf_models[kind], model_dir, ONE, [image("wide")], kind == "smolvlm")
    first.assert_matches(expected, "first")
    again.assert_matches(expected, "prefix-cache hit")


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_with_images_match_hf(
    kind: str, model_dirs: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    """Two tensor-parallel ranks (the tower and connector whole on each), 16-token steps
    through the runs: one image and two images in one batch answer as HF."""
    model_dir, smolvlm = model_dirs[kind], kind == "smolvlm"
    cases = {"one": (ONE, [image("wide")]), "two": (TWO, [image("thin"), image("square")])}
    got = two_rank_answers(model_dir, media_prompts(cases.values()), **CHUNKED)
    for (what, (prompt, pictures)), answer in zip(cases.items(), got, strict=True):
        answer.assert_matches(
            hf_answer(hf_models[kind], model_dir, prompt, pictures, smolvlm), what
        )


@pytest.mark.parametrize("kind", KINDS)
def test_every_tensor_is_read(
    kind: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    in_file = set(load_file(model_dirs[kind] / "model.safetensors"))
    read, model = read_tensors(model_dirs[kind], monkeypatch)
    assert read == in_file
    assert model.tie_word_embeddings == (kind == "smolvlm")  # the top-level flag, as HF


def test_refusals(model_dirs: dict[str, Path], runners: dict[str, Runner], tmp_path: Path) -> None:
    runner = runners["idefics3"]
    processor = Idefics3ImageInputs.from_pretrained(model_dirs["idefics3"], runner.hf_config)
    with pytest.raises(ValueError, match="PIL"):
        processor.process([1, IMAGE_TOKEN_ID], {"image": [torch.zeros(3, 4, 4)]})
    with pytest.raises(ValueError, match="placeholder"):
        processor.process([1, 2], {"image": [image("small")]})
    with pytest.raises(ValueError, match="takes images"):
        runner.model.embed_multimodal("audio", {})
    with pytest.raises(ValueError, match="does not take image embeddings"):
        precomputed_items([torch.zeros(4, 64)], type(runner.model), runner.hf_config, "m")
    bad = tmp_path / "bad"
    shutil.copytree(model_dirs["idefics3"], bad)
    (bad / "processor_config.json").write_text(json.dumps({"image_seq_len": 169}))
    with pytest.raises(ValueError, match="169 image tokens"):
        Idefics3ImageInputs.from_pretrained(bad, runner.hf_config)
