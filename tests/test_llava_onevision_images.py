"""LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``) with images against HF
transformers on a tiny random checkpoint (tests/fixtures_llava_onevision.py: Qwen2 text, 2
layers of hidden 64; a 2-layer SigLIP tower of 28-pixel tiles, 4 x 4 features each; pinpoints
of 1 to 3 tiles a side; ``anyres_max_2``, so big grids are resized down).

Checked, float32: each image's packed rows (tower, projector, unpadding, the grid's bilinear
cap, ``image_newline``) against HF's ``get_image_features`` to 1e-5, alone (tiled) and
among several in one prompt (one square tile and a newline); the packing at
llava-onevision's real geometry (384-pixel tiles of 27 x 27 features, its 36 pinpoints,
``anyres_max_9``) against HF's ``pack_image_features`` and the token count against
``LlavaOnevisionProcessor``'s for many sizes; our pixels against transformers'
``LlavaOnevisionImageProcessor`` (PIL backend) and the expanded prompt against
``LlavaOnevisionProcessor``'s; prefill and decode logits against HF's forward to 1e-4;
greedy tokens and each token's logprob through ``LLM.generate`` and ``LLM.chat`` against HF
``generate``, with chunked prefill through an image; image embeddings (``"rows"``: a tiled
image's packed rows, two square images' rows stacked, rows beside an image) and a prefix-cache
hit through an image, against HF; two tensor-parallel ranks with images in 16-token steps,
against HF; which tensors are read; the refusals.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_llava import IMAGE_TOKEN_ID, random_image
from fixtures_llava_onevision import (
    PINPOINTS,
    SIDE,
    TOKENS_PER_TILE,
    hf_inputs,
    hf_model,
    hf_processor,
    image_processor,
    save_tiny_llava_onevision,
)
from mm_hf_compare import (
    CHUNKED,
    PARAMS,
    Answer,
    answers,
    answers_and_cached,
    assert_prefill_and_decode_match,
    checkpoint_fixtures,
    generate_answers,
    hf_generate,
    image_url_chat,
    media_prompts,
    png_data_url,
    processor_fixture,
    read_tensors,
    small_llm,
    two_rank_answers,
)
from safetensors.torch import load_file
from test_models_parity import Runner

from chassis.builtin_plugins.models.llava_next_tiles import (
    parse_pinpoints,
    tile_grid,
    unpadded_span,
)
from chassis.builtin_plugins.models.llava_onevision_geometry import (
    capped_grid,
    max_tiles,
    num_image_tokens,
)
from chassis.builtin_plugins.models.llava_onevision_images import (
    LlavaOnevisionForConditionalGenerationWithImages,
)
from chassis.builtin_plugins.models.llava_onevision_processing import (
    LlavaOnevisionMediaInputs,
    anyres_steps,
    onevision_settings,
    square_steps,
)
from chassis.core.multimodal import MultiModalFeature

ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: Compare <image>\nwith <image>\nplease. ASSISTANT:"
TEXT = "USER: Tell me a story. ASSISTANT:"
#: (height, width) of the test images: rows cut, columns cut, nothing cut, grids kept and
#: grids resized down by the cap, smaller than a tile
SIZES = {
    "tall": (90, 60),
    "wide": (60, 90),
    "thin": (20, 200),
    "square": (28, 28),
    "fits": (28, 56),
    "big": (84, 84),
    "huge": (300, 250),
    "tiny": (13, 21),
}


model_dir, hf, runner = checkpoint_fixtures(save_tiny_llava_onevision, hf_model)
processor = processor_fixture(LlavaOnevisionMediaInputs)


@pytest.fixture(scope="module")
def images() -> dict[str, Any]:
    return {name: random_image(h, w, seed=i) for i, (name, (h, w)) in enumerate(SIZES.items())}


def expand(
    processor: LlavaOnevisionMediaInputs, model_dir: Path, prompt: str, pictures: list[Any]
) -> tuple[list[int], list[MultiModalFeature]]:
    """Our expanded prompt and features for ``prompt`` and ``pictures``, as the front-end
    makes them."""
    from chassis.core.tokenizer import load_tokenizer

    ids = load_tokenizer(model_dir)(prompt).input_ids
    return processor.process(ids, {"image": pictures})


# -- the image side ---------------------------------------------------------------------------


def test_sizes_cover_the_cap() -> None:
    """Some test images' grids are resized down by ``anyres_max_2``, some kept."""
    pinpoints = parse_pinpoints(PINPOINTS, SIDE)
    capped = set()
    for height, width in SIZES.values():
        rows, cols = tile_grid(height, width, pinpoints, SIDE)
        capped.add(capped_grid(rows * 4, cols * 4, 4, 2) is not None)
    assert capped == {True, False}


def test_image_rows_match_get_image_features(
    model_dir: Path, hf: Any, runner: Runner, images: dict[str, Any]
) -> None:
    """Every test image alone (tiled), and three in one prompt (a square tile each): HF's
    packed rows, through ``embed_multimodal``."""
    model = runner.model
    for name in SIZES:
        inputs = hf_inputs(model_dir, ONE, [images[name]])
        with torch.no_grad():
            [expected] = hf.get_image_features(
                pixel_values=inputs["pixel_values"],
                image_sizes=inputs["image_sizes"],
                batch_num_images=inputs["batch_num_images"],
            ).pooler_output
            ours = model.embed_multimodal(
                "image",
                {"pixel_values": inputs["pixel_values"][0], "image_sizes": inputs["image_sizes"]},
            )
        tokens = int((inputs["input_ids"] == IMAGE_TOKEN_ID).sum())
        assert ours.shape == expected.shape == (tokens, 64), name
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5, msg=name)

    pictures = [images["tall"], images["huge"], images["tiny"]]
    inputs = hf_inputs(model_dir, "<image><image><image>", pictures)
    assert inputs["pixel_values"].shape[:2] == (3, 1)
    with torch.no_grad():
        expected = hf.get_image_features(
            pixel_values=inputs["pixel_values"],
            image_sizes=inputs["image_sizes"],
            batch_num_images=inputs["batch_num_images"],
        ).pooler_output
        for index in range(3):
            ours = model.embed_multimodal(
                "image",
                {
                    "pixel_values": inputs["pixel_values"][index],
                    "image_sizes": inputs["image_sizes"][index : index + 1],
                },
            )
            assert ours.shape == (TOKENS_PER_TILE + 1, 64)
            torch.testing.assert_close(ours, expected[index], atol=1e-5, rtol=1e-5)


def test_packing_and_counts_at_onevision_geometry(model_dir: Path) -> None:
    """llava-onevision's geometry (384-pixel SigLIP tiles of 27 x 27 features, its 36
    pinpoints, 729 base rows, ``anyres_max_9``): our packing of random rows equals HF's
    ``pack_image_features``, and our token count ``LlavaOnevisionProcessor``'s, for sizes
    from thin to huge."""
    import transformers as tf

    pinpoints = [[h * 384, w * 384] for h in range(1, 7) for w in range(1, 7)]
    vision = SimpleNamespace(image_size=384, patch_size=14)
    hf_self = SimpleNamespace(
        config=SimpleNamespace(vision_config=vision, image_grid_pinpoints=pinpoints)
    )
    ours_self = SimpleNamespace(
        pinpoints=parse_pinpoints(pinpoints, 384),
        tile=384,
        side=27,
        max_tiles=9,
        image_newline=torch.randn(4),
    )
    hf_proc = hf_processor(model_dir, size={"height": 384, "width": 384})
    hf_proc.image_processor.image_grid_pinpoints = pinpoints
    hf_proc.num_image_tokens = 729
    hf_proc.vision_aspect_ratio = "anyres_max_9"
    rng = np.random.default_rng(0)
    sizes = [(1, 3000), (3000, 2), (384, 384), (768, 1152), (1000, 667), (4000, 3000)]
    sizes += [(2304, 2304), (5000, 5000), (383, 385), (1080, 1920), (1920, 1080)]
    sizes += [tuple(int(v) for v in rng.integers(20, 3000, 2)) for _ in range(25)]
    hf_counts = hf_proc._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    pack = (
        tf.models.llava_onevision.modeling_llava_onevision.LlavaOnevisionModel.pack_image_features
    )
    resized = 0
    for (height, width), hf_count in zip(sizes, hf_counts, strict=True):
        count = num_image_tokens(height, width, ours_self.pinpoints, 384, 27, 729, 9)
        assert count == hf_count, (height, width)
        rows, cols = tile_grid(height, width, ours_self.pinpoints, 384)
        features = torch.randn(1 + rows * cols, 729, 4)
        [expected], _ = pack(
            hf_self,
            [features],
            torch.tensor([[height, width]]),
            image_newline=ours_self.image_newline,
            vision_aspect_ratio="anyres_max_9",
        )
        packed = LlavaOnevisionForConditionalGenerationWithImages.pack(
            ours_self,  # type: ignore[arg-type]
            features,
            height,
            width,
        )
        assert packed.shape[0] == count
        torch.testing.assert_close(packed, expected, atol=1e-6, rtol=1e-6, msg=str((height, width)))
        top, bottom, left, right = unpadded_span(height, width, rows * 27, cols * 27)
        resized += capped_grid(bottom - top, right - left, 27, 9) is not None
    assert 5 < resized < len(sizes)  # the cap's resize was compared, and its absence


# -- the processor ----------------------------------------------------------------------------


def test_pixels_match_transformers_image_processor(images: dict[str, Any]) -> None:
    """Our tiles (an image alone) and squares (an image among several) equal transformers'
    ``LlavaOnevisionImageProcessor`` (PIL backend), a transparent image's too."""
    from PIL import Image

    hf = image_processor()
    settings = onevision_settings(json.loads(hf.to_json_string()))
    tiles, square = anyres_steps(settings, SIDE), square_steps(settings)
    rgba = Image.fromarray(np.random.default_rng(7).integers(0, 256, (30, 70, 4), dtype=np.uint8))
    samples = [*images.values(), rgba, random_image(1, 900, seed=4)]
    for image in samples:
        expected = hf(images=[image], return_tensors="np")["pixel_values"][0]
        got = tiles(image)
        assert got.dtype == np.float32 and got.shape == expected.shape, image.size
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0, err_msg=str(image.size))
    expected = hf(images=[samples], return_tensors="np")["pixel_values"]
    for image, pixels in zip(samples, expected, strict=True):
        np.testing.assert_allclose(square(image), pixels[0], atol=1e-6, rtol=0)


def test_prompts_expand_as_llava_onevision_processor(
    model_dir: Path, processor: LlavaOnevisionMediaInputs, images: dict[str, Any]
) -> None:
    """One ``<image>`` per image becomes the image's count of placeholder tokens (which
    depends on its size alone, and on other images in the prompt), where HF's processor puts
    them, with HF's pixels and sizes; the counts agree for ~30 sizes."""
    for prompt, pictures in ((ONE, [images["huge"]]), (TWO, [images["thin"], images["big"]])):
        expected = hf_inputs(model_dir, prompt, pictures)
        expanded, features = expand(processor, model_dir, prompt, pictures)
        assert expanded == expected["input_ids"][0].tolist()
        pixels = expected["pixel_values"]
        pixels = pixels if len(pictures) > 1 else pixels[0][None]
        for index, feature in enumerate(features):
            tensors = feature.tensors()
            tiles = tensors["pixel_values"].shape[0]
            torch.testing.assert_close(
                tensors["pixel_values"], pixels[index, :tiles], atol=0, rtol=0
            )
            assert tensors["image_sizes"].tolist() == [expected["image_sizes"][index].tolist()]
    assert [f.length for f in features] == [TOKENS_PER_TILE + 1] * 2
    rng = np.random.default_rng(1)
    sizes = [*SIZES.values(), *(tuple(int(v) for v in rng.integers(1, 400, 2)) for _ in range(24))]
    hf_counts = hf_processor(model_dir)._get_num_multimodal_tokens(image_sizes=sizes)
    for (height, width), hf_count in zip(sizes, hf_counts["num_image_tokens"], strict=True):
        assert processor.num_tokens(height, width) == hf_count, (height, width)


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("pictures", [("huge",), ("tall", "big")])
def test_logits_with_images_match_transformers(
    model_dir: Path,
    hf: Any,
    runner: Runner,
    processor: LlavaOnevisionMediaInputs,
    images: dict[str, Any],
    pictures: tuple[str, ...],
) -> None:
    prompt = ONE if len(pictures) == 1 else TWO
    chosen = [images[name] for name in pictures]
    inputs = hf_inputs(model_dir, prompt, chosen)
    ids, features = expand(processor, model_dir, prompt, chosen)
    assert ids == inputs["input_ids"][0].tolist()
    assert_prefill_and_decode_match(runner, hf, inputs, features)


# -- end to end through LLM -------------------------------------------------------------------


def next_answer(hf: Any, model_dir: Path, prompt: str, pictures: list[Any]) -> Answer:
    """HF ``generate``'s greedy answer (EOS ignored) with each token's logprob."""
    return hf_generate(hf, hf_inputs(model_dir, prompt, pictures))


def test_generate_and_chat_match_hf(model_dir: Path, hf: Any, images: dict[str, Any]) -> None:
    """One image, two images and text in one batch; then steps of 16 tokens cutting through
    a 46-token image (4-token blocks), which equal one unchunked prefill; then ``LLM.chat``
    with an image_url part. Every answer is HF's."""
    cases = {
        "one": (ONE, [images["wide"]]),
        "two": (TWO, [images["huge"], images["tiny"]]),
        "text": (TEXT, []),
        "big": (ONE, [images["big"]]),
    }
    batch = generate_answers(model_dir, media_prompts(cases.values()))
    for (what, (prompt, pictures)), answer in zip(cases.items(), batch, strict=True):
        answer.assert_matches(next_answer(hf, model_dir, prompt, pictures), what)

    chat = image_url_chat(png_data_url(images["tall"]))
    llm = small_llm(model_dir, **CHUNKED, enable_prefix_caching=False)
    runner = llm.engine.executor.worker.runner
    request = {"prompt": ONE, "multi_modal_data": {"image": [images["big"]]}}
    try:
        [chunked] = answers(llm.generate([request], PARAMS))
        assert runner.mm.num_encoder_runs == 1  # once, though its 46 tokens took 3 steps
        [chatted] = answers(llm.chat(chat, PARAMS))
    finally:
        llm.shutdown()
    chunked.assert_matches(batch[3], "chunked vs unchunked")
    chatted.assert_matches(next_answer(hf, model_dir, ONE, [images["tall"]]), "chat")


def our_rows(
    runner: Runner,
    processor: LlavaOnevisionMediaInputs,
    model_dir: Path,
    prompt: str,
    pictures: list[Any],
) -> list[torch.Tensor]:
    """Each picture's packed rows as our model gives them for ``prompt`` (tiled alone, a
    square tile among several): what a caller of image embeddings would send."""
    _, features = expand(processor, model_dir, prompt, pictures)
    with torch.no_grad():
        return [runner.model.embed_multimodal("image", f.tensors()) for f in features]


def test_image_embeddings_and_prefix_cache_match_hf(
    model_dir: Path,
    hf: Any,
    runner: Runner,
    processor: LlavaOnevisionMediaInputs,
    images: dict[str, Any],
) -> None:
    """``--enable-mm-embeds`` with LLaVA's ``"rows"`` form: a tiled, capped image's packed
    rows ``[46, 64]`` (newlines in), two images' square rows as ``[2, 17, 64]`` and a list
    mixing an image and rows each answer as HF on the images, no tower run for rows; the
    same image again hits the prefix cache through its run (same answer), another image of
    its size does not."""
    [big] = our_rows(runner, processor, model_dir, ONE, [images["big"]])
    two = our_rows(runner, processor, model_dir, TWO, [images["huge"], images["tiny"]])
    assert big.shape == (46, 64) and [r.shape for r in two] == [(17, 64)] * 2
    _, [feature] = expand(processor, model_dir, ONE, [images["big"]])
    llm = small_llm(model_dir, block_size=4, enable_mm_embeds=True)
    mm = llm.engine.executor.worker.runner.mm

    def run(prompt: str, data: Any) -> tuple[Answer, int]:
        request = {"prompt": prompt, "multi_modal_data": {"image": data}}
        [(answer, cached)] = answers_and_cached(llm.generate([request], PARAMS))
        return answer, cached

    try:
        image, image_cached = run(ONE, [images["big"]])
        again, again_cached = run(ONE, [images["big"]])
        runs = mm.num_encoder_runs
        _, other_cached = run(ONE, [random_image(*SIZES["big"], seed=99)])
        assert mm.num_encoder_runs == runs + 1
        rows, _ = run(ONE, big)
        stacked, _ = run(TWO, torch.stack(two))
        mixed, _ = run(TWO, [images["huge"], two[1]])
        assert mm.num_encoder_runs == runs + 2  # only the mixed prompt's image
    finally:
        llm.shutdown()
    assert image_cached == 0 and again_cached >= feature.end
    assert other_cached <= feature.offset
    expected = next_answer(hf, model_dir, ONE, [images["big"]])
    for answer, what in ((image, "image"), (again, "prefix-cache hit"), (rows, "rows")):
        answer.assert_matches(expected, what)
    expected = next_answer(hf, model_dir, TWO, [images["huge"], images["tiny"]])
    stacked.assert_matches(expected, "[2, 17, 64]")
    mixed.assert_matches(expected, "image and rows")


def test_two_ranks_with_images_match_hf(model_dir: Path, hf: Any, images: dict[str, Any]) -> None:
    """Two tensor-parallel ranks, 16-token steps through the runs: one tiled image and two
    square ones in one batch answer as HF."""
    cases = {"one": (ONE, [images["huge"]]), "two": (TWO, [images["wide"], images["big"]])}
    got = two_rank_answers(model_dir, media_prompts(cases.values()), **CHUNKED)
    for (what, (prompt, pictures)), answer in zip(cases.items(), got, strict=True):
        answer.assert_matches(next_answer(hf, model_dir, prompt, pictures), what)


# -- what is read and built -------------------------------------------------------------------


def test_image_newline_and_the_tower_are_read(
    model_dir: Path, runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Everything but the tower's ``post_layernorm`` and head is read, the newline row too;
    the class composes over the Qwen2 text config's decoder."""
    from chassis.builtin_plugins.models.qwen2 import Qwen2ForCausalLM

    read, model = read_tensors(model_dir, monkeypatch)
    tensors = load_file(model_dir / "model.safetensors")
    unused = {n for n in tensors if n.startswith(("vision_tower.post_", "vision_tower.head."))}
    assert "image_newline" in tensors
    assert read == set(tensors) - unused
    assert torch.equal(model.image_newline, tensors["image_newline"])
    assert isinstance(model, LlavaOnevisionForConditionalGenerationWithImages)
    assert isinstance(model, Qwen2ForCausalLM)
    assert type(model).supported_modalities == {"image", "video"}
    assert model.max_tiles == 2


def test_other_towers_are_served_as_text_only() -> None:
    import transformers as tf
    from fixtures_llava_onevision import tiny_config

    from chassis.builtin_plugins.models.llava import LlavaForConditionalGeneration
    from chassis.core.model_loader import language_model_config, model_class

    config = tiny_config()
    config.vision_config = tf.Dinov2Config(hidden_size=32, num_hidden_layers=1)
    config.architectures = ["LlavaOnevisionForConditionalGeneration"]
    cls = model_class(language_model_config(config))
    assert issubclass(cls, LlavaForConditionalGeneration)
    assert not issubclass(cls, LlavaOnevisionForConditionalGenerationWithImages)
    assert not cls.supported_modalities


# -- refusals ---------------------------------------------------------------------------------


def test_bad_inputs_are_clear_errors(
    model_dir: Path, runner: Runner, processor: LlavaOnevisionMediaInputs, tmp_path: Path
) -> None:
    model = runner.model
    pixels, sizes = torch.zeros(7, 3, SIDE, SIDE), torch.tensor([[60, 90]])
    with pytest.raises(ValueError, match="takes images and videos, not 'audio'"):
        model.embed_multimodal("audio", {"pixel_values": pixels, "image_sizes": sizes})
    with pytest.raises(ValueError, match="need pixel_values and image_sizes"):
        model.embed_multimodal("image", {"pixel_values": pixels})
    with pytest.raises(ValueError, match=r"has 1 tile .* or 7 .*pixel_values has 3"):
        model.embed_multimodal("image", {"pixel_values": pixels[:3], "image_sizes": sizes})
    with pytest.raises(ValueError, match="mm_processor_kwargs are not supported"):
        processor.process([IMAGE_TOKEN_ID], {"image": [random_image(8, 8)]}, {"max_pixels": 9})
    with pytest.raises(ValueError, match="mm_processor_kwargs are not supported"):
        processor.process(
            [IMAGE_TOKEN_ID], {"image": [random_image(8, 8)]}, {"_llava_onevision_among_several": 1}
        )
    for bad in ("anyres", "anyres_max_0", "anyres_max_x"):
        with pytest.raises(ValueError, match="vision_aspect_ratio"):
            max_tiles(bad)
    assert max_tiles(None) == 9

    hf_config = runner.hf_config
    for path in model_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config_path = tmp_path / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    for change, error in (
        ({"image_grid_pinpoints": [[28, 56]]}, "but the model's config has"),
        ({"image_grid_pinpoints": [[28, 50]]}, "not a multiple of the vision tower's"),
        ({"size": {"height": 56, "width": 56}}, "cuts 56-pixel tiles"),
        ({"image_processor_type": "LlavaNextImageProcessor"}, "not supported for LLaVA-OneVision"),
    ):
        config_path.write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=error):
            LlavaOnevisionMediaInputs.from_pretrained(tmp_path, hf_config)
    config_path.unlink()
    with pytest.raises(ValueError, match=r"no preprocessor_config\.json"):
        LlavaOnevisionMediaInputs.from_pretrained(tmp_path, hf_config)
