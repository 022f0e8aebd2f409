"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``) with images against HF transformers on a
tiny random checkpoint (tests/fixtures_llava_next.py: Mistral text, 2 layers of hidden 64; a
2-layer CLIP tower of 42-pixel tiles, 3 x 3 features each; pinpoints 42x84, 84x42, 84x84).

Checked, float32: each image's packed rows (tower, projector, unpadding, ``image_newline``)
against HF's ``get_image_features`` (which packs them with ``pack_image_features``) to 1e-5,
for portrait, landscape, square, thin and tiny images (rows cut, columns cut, nothing cut),
alone and two in one HF batch; the packing at llava-v1.6's real geometry (336-pixel tiles,
its five pinpoints) against HF's ``pack_image_features`` and the token count against
``LlavaNextProcessor``'s for many sizes; our pixels against transformers'
``LlavaNextImageProcessor`` (PIL backend) and the expanded prompt against
``LlavaNextProcessor``'s; prefill and decode logits with one and two images against HF's
forward to 1e-4, and that another image changes them; greedy tokens and each token's logprob
through ``LLM.generate`` and ``LLM.chat`` against HF ``generate``, with chunked prefill through
an image and a prefix-cache hit over it; which tensors are read; and the refusals.
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
from fixtures_llava_next import (
    SIDE,
    hf_inputs,
    hf_model,
    hf_processor,
    image_processor,
    save_tiny_llava_next,
    tiny_config,
)
from mm_hf_compare import (
    ATOL,
    CHUNKED,
    PARAMS,
    Answer,
    answers,
    answers_and_cached,
    assert_prefill_and_decode_match,
    checkpoint_fixtures,
    generate_answers,
    hf_generate,
    hf_logits,
    media_prompts,
    prefill_then_decode,
    processor_fixture,
    read_tensors,
    small_llm,
)
from safetensors.torch import load_file
from test_models_parity import Runner

from chassis.builtin_plugins.models.llava import LlavaForConditionalGeneration
from chassis.builtin_plugins.models.llava_next_images import (
    LlavaNextForConditionalGenerationWithImages,
)
from chassis.builtin_plugins.models.llava_next_processing import (
    AnyresPreprocessing,
    LlavaNextImageInputs,
)
from chassis.builtin_plugins.models.llava_next_tiles import (
    DEFAULT_PINPOINTS,
    num_image_tokens,
    parse_pinpoints,
    tile_grid,
    unpadded_span,
)
from chassis.core.model_loader import language_model_config, model_class
from chassis.core.multimodal import MultiModalFeature

ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: Compare <image>\nwith <image>\nplease. ASSISTANT:"
TEXT = "USER: Tell me a story. ASSISTANT:"
#: (height, width) of the test images: the grid's rows cut (wide), columns cut (tall),
#: nothing cut, one or four tiles' worth, smaller than a tile
SIZES = {
    "tall": (90, 60),
    "wide": (60, 90),
    "thin": (30, 200),
    "square": (42, 42),
    "fits": (40, 100),
    "column": (300, 100),
    "big": (100, 101),
    "tiny": (13, 21),
}


model_dir, hf, runner = checkpoint_fixtures(save_tiny_llava_next, hf_model)
processor = processor_fixture(LlavaNextImageInputs)


@pytest.fixture(scope="module")
def images() -> dict[str, Any]:
    found = {name: random_image(h, w, seed=i) for i, (name, (h, w)) in enumerate(SIZES.items())}
    found["other"] = random_image(*SIZES["tall"], seed=99)
    return found


def expand(
    processor: LlavaNextImageInputs, model_dir: Path, prompt: str, pictures: list[Any]
) -> tuple[list[int], list[MultiModalFeature]]:
    """Our expanded prompt and features for ``prompt`` and ``pictures``, as the front-end
    makes them."""
    from chassis.core.tokenizer import load_tokenizer

    ids = load_tokenizer(model_dir)(prompt).input_ids
    return processor.process(ids, {"image": pictures})


# -- the image side ---------------------------------------------------------------------------


def test_unpadding_cuts_rows_and_columns() -> None:
    """The sizes tested cover every case of the unpadding (so the parity below covers them)."""
    pinpoints = parse_pinpoints([[42, 84], [84, 42], [84, 84]], SIDE)
    cuts = set()
    for height, width in SIZES.values():
        rows, cols = tile_grid(height, width, pinpoints, SIDE)
        top, bottom, left, right = unpadded_span(height, width, rows * 3, cols * 3)
        cuts.add("rows" if bottom - top < rows * 3 else "cols" if right - left < cols * 3 else "-")
    assert cuts == {"rows", "cols", "-"}


def test_image_rows_match_get_image_features(
    model_dir: Path,
    hf: Any,
    runner: Runner,
    images: dict[str, Any],
) -> None:
    """Every test image alone, and two of different tile counts in one HF batch (padded to
    the same tile count there): HF's packed rows, through ``embed_multimodal``."""
    model = runner.model
    for name in SIZES:
        inputs = hf_inputs(model_dir, ONE, [images[name]])
        with torch.no_grad():
            [expected] = hf.get_image_features(
                pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"]
            ).pooler_output
            ours = model.embed_multimodal(
                "image",
                {"pixel_values": inputs["pixel_values"][0], "image_sizes": inputs["image_sizes"]},
            )
        tokens = int((inputs["input_ids"] == IMAGE_TOKEN_ID).sum())
        assert ours.shape == expected.shape == (tokens, 64), name
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5, msg=name)

    inputs = hf_inputs(model_dir, TWO, [images["fits"], images["big"]])
    assert inputs["pixel_values"].shape[:2] == (2, 5)  # 3 and 5 tiles, padded to 5
    with torch.no_grad():
        expected = hf.get_image_features(
            pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"]
        ).pooler_output
        for index, tiles in enumerate((3, 5)):
            ours = model.embed_multimodal(
                "image",
                {
                    "pixel_values": inputs["pixel_values"][index, :tiles],
                    "image_sizes": inputs["image_sizes"][index : index + 1],
                },
            )
            torch.testing.assert_close(ours, expected[index], atol=1e-5, rtol=1e-5)


def test_packing_and_counts_at_llava_v16_geometry(model_dir: Path) -> None:
    """llava-v1.6's geometry (336-pixel tiles of 24 x 24 features, its five pinpoints, 576
    base rows): our packing of random rows equals HF's ``pack_image_features``, and our token
    count ``LlavaNextProcessor``'s, for sizes from thin to huge."""
    import transformers as tf

    pinpoints = [list(p) for p in DEFAULT_PINPOINTS]
    vision = SimpleNamespace(image_size=336, patch_size=14)
    hf_self = SimpleNamespace(
        config=SimpleNamespace(vision_config=vision, image_grid_pinpoints=pinpoints)
    )
    ours_self = SimpleNamespace(
        pinpoints=parse_pinpoints(pinpoints, 336),
        tile=336,
        side=24,
        image_newline=torch.randn(4),
    )
    hf_image_processor = tf.LlavaNextImageProcessorPil(
        size={"shortest_edge": 336},
        crop_size={"height": 336, "width": 336},
        image_grid_pinpoints=pinpoints,
    )
    hf_proc = tf.LlavaNextProcessor(
        image_processor=hf_image_processor,
        tokenizer=hf_processor(model_dir).tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    rng = np.random.default_rng(0)
    sizes = [(1, 3000), (3000, 2), (336, 336), (672, 1008), (1000, 667), (4000, 3000)]
    sizes += [tuple(int(v) for v in rng.integers(20, 2000, 2)) for _ in range(60)]
    hf_counts = hf_proc._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    pack = tf.models.llava_next.modeling_llava_next.LlavaNextModel.pack_image_features
    for (height, width), hf_count in zip(sizes, hf_counts, strict=True):
        count = num_image_tokens(height, width, ours_self.pinpoints, 336, 24, 576)
        assert count == hf_count, (height, width)
        rows, cols = tile_grid(height, width, ours_self.pinpoints, 336)
        features = torch.randn(1 + rows * cols, 576, 4)
        [expected], _ = pack(
            hf_self,
            [features],
            torch.tensor([[height, width]]),
            "default",
            image_newline=ours_self.image_newline,
        )
        packed = LlavaNextForConditionalGenerationWithImages.pack(
            ours_self,  # type: ignore[arg-type]
            features,
            height,
            width,
        )
        assert packed.shape[0] == count
        assert torch.equal(packed, expected), (height, width)


# -- the processor ----------------------------------------------------------------------------


@pytest.mark.parametrize("settings", ["tiny", "exact_size"])
def test_pixels_match_transformers_image_processor(settings: str) -> None:
    """Our tiles equal transformers' ``LlavaNextImageProcessor`` (PIL backend) for every
    test image, a transparent one and an image the processor must scale up."""
    from PIL import Image

    overrides = {"size": {"height": SIDE, "width": SIDE}} if settings == "exact_size" else {}
    hf = image_processor(**overrides)
    ours = AnyresPreprocessing.from_dict(json.loads(hf.to_json_string()), SIDE)
    rgba = Image.fromarray(np.random.default_rng(7).integers(0, 256, (30, 70, 4), dtype=np.uint8))
    samples = [random_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES.values())]
    # (and one too thin for any pinpoint to keep a whole row of it: HF's choice, no error)
    for image in [*samples, rgba, random_image(5, 9, seed=3), random_image(1, 3000, seed=4)]:
        out = hf(images=[image], return_tensors="np")
        expected = out["pixel_values"][0]
        got = ours(image)
        assert got.dtype == np.float32 and got.shape == expected.shape, image.size
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0, err_msg=str(image.size))


def test_prompts_expand_as_llava_next_processor(
    model_dir: Path, processor: LlavaNextImageInputs, images: dict[str, Any]
) -> None:
    """One ``<image>`` per image becomes the image's count of placeholder tokens (which
    depends on its size), where HF's processor puts them, with HF's pixels and sizes."""
    pictures = [images["thin"], images["big"]]
    expected = hf_inputs(model_dir, TWO, pictures)
    expanded, features = expand(processor, model_dir, TWO, pictures)
    assert expanded == expected["input_ids"][0].tolist()
    assert [f.length for f in features] == [16, 51]
    for index, feature in enumerate(features):
        tensors = feature.tensors()
        tiles = tensors["pixel_values"].shape[0]
        torch.testing.assert_close(
            tensors["pixel_values"], expected["pixel_values"][index, :tiles], atol=0, rtol=0
        )
        assert tensors["image_sizes"].tolist() == [expected["image_sizes"][index].tolist()]
    for name, (height, width) in SIZES.items():
        hf_count = hf_processor(model_dir)._get_num_multimodal_tokens(image_sizes=[(height, width)])
        assert processor.num_tokens(height, width) == hf_count["num_image_tokens"][0], name


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("pictures", [("tall",), ("thin", "big")])
def test_logits_with_images_match_transformers(
    model_dir: Path,
    hf: Any,
    runner: Runner,
    processor: LlavaNextImageInputs,
    images: dict[str, Any],
    pictures: tuple[str, ...],
) -> None:
    prompt = ONE if len(pictures) == 1 else TWO
    chosen = [images[name] for name in pictures]
    inputs = hf_inputs(model_dir, prompt, chosen)
    ids, features = expand(processor, model_dir, prompt, chosen)
    assert ids == inputs["input_ids"][0].tolist()
    assert_prefill_and_decode_match(runner, hf, inputs, features)


def test_another_image_changes_the_logits(
    model_dir: Path,
    hf: Any,
    runner: Runner,
    processor: LlavaNextImageInputs,
    images: dict[str, Any],
) -> None:
    """The same prompt with another image of the same size: other logits after the image,
    HF's for it (the rows are used, so the parity above is not vacuous)."""
    logits = []
    for picture in (images["tall"], images["other"]):
        ids, features = expand(processor, model_dir, ONE, [picture])
        ours, _, _ = prefill_then_decode(runner, ids, features)
        expected = hf_logits(hf, hf_inputs(model_dir, ONE, [picture]))
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=ATOL)
        logits.append(ours)
    end = features[0].end
    assert (logits[0][end:] - logits[1][end:]).abs().max() > 1e-2


# -- end to end through LLM -------------------------------------------------------------------


def next_answer(hf: Any, model_dir: Path, prompt: str, pictures: list[Any]) -> Answer:
    """HF ``generate``'s greedy answer (EOS ignored) with each token's logprob."""
    return hf_generate(hf, hf_inputs(model_dir, prompt, pictures))


def test_generate_and_chat_match_hf(model_dir: Path, hf: Any, images: dict[str, Any]) -> None:
    """One image, two images and text in one batch; then steps of 16 tokens cutting through
    a 39-token image (4-token blocks) and the same image again from the prefix cache; then
    ``LLM.chat`` with an image part. Every answer is HF's."""
    cases = {
        "one": (ONE, [images["wide"]]),
        "two": (TWO, [images["column"], images["tiny"]]),
        "text": (TEXT, []),
    }
    batch = generate_answers(model_dir, media_prompts(cases.values()))
    for (what, (prompt, pictures)), answer in zip(cases.items(), batch, strict=True):
        answer.assert_matches(next_answer(hf, model_dir, prompt, pictures), what)

    long_prompt = "USER: Look here: <image>\nWhat is in this picture? ASSISTANT:"
    expected = next_answer(hf, model_dir, long_prompt, [images["tall"]])
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": images["tall"]},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ]
    llm = small_llm(model_dir, **CHUNKED)
    runner = llm.engine.executor.worker.runner
    request = {"prompt": long_prompt, "multi_modal_data": {"image": [images["tall"]]}}
    try:
        [(cold, cold_cached)] = answers_and_cached(llm.generate([request], PARAMS))
        assert runner.mm.num_encoder_runs == 1  # once, though its 39 tokens took 3 steps
        [(warm, warm_cached)] = answers_and_cached(llm.generate([request], PARAMS))
        [chatted] = answers(llm.chat(chat, PARAMS))
    finally:
        llm.shutdown()
    cold.assert_matches(expected, "chunked")
    warm.assert_matches(expected, "prefix-cached")
    assert cold_cached == 0 and warm_cached >= 8 + 39
    assert runner.mm.num_encoder_runs == 2  # the cached image needed none; chat's did
    chatted.assert_matches(next_answer(hf, model_dir, ONE, [images["tall"]]), "chat")


# -- what is read and built -------------------------------------------------------------------


def test_image_newline_and_the_tower_are_read(
    model_dir: Path, runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Everything but the tower's unused last layer and ``post_layernorm`` is read, the
    newline row too; the class composes over the Mistral text config's decoder."""
    from chassis.builtin_plugins.models.llama import LlamaForCausalLM

    read, model = read_tensors(model_dir, monkeypatch)
    in_file = set(load_file(model_dir / "model.safetensors"))
    skipped = ("vision_tower.vision_model.encoder.layers.1.", "vision_tower.vision_model.post_")
    unused = {n for n in in_file if n.startswith(skipped)}
    assert unused and "image_newline" in in_file
    assert read == in_file - unused
    assert torch.equal(
        model.image_newline, load_file(model_dir / "model.safetensors")["image_newline"]
    )
    assert isinstance(model, LlavaNextForConditionalGenerationWithImages)
    assert isinstance(model, LlamaForCausalLM)
    assert type(model).supported_modalities == {"image"}
    assert len(model.vision_tower.encoder.layers) == 1


def test_other_towers_are_served_as_text_only() -> None:
    import transformers as tf

    config = tiny_config()
    config.vision_config = tf.Dinov2Config(hidden_size=32, num_hidden_layers=1)
    config.architectures = ["LlavaNextForConditionalGeneration"]
    cls = model_class(language_model_config(config))
    assert issubclass(cls, LlavaForConditionalGeneration)
    assert not issubclass(cls, LlavaNextForConditionalGenerationWithImages)
    assert not cls.supported_modalities


# -- refusals ---------------------------------------------------------------------------------


def test_bad_inputs_are_clear_errors(
    model_dir: Path, runner: Runner, processor: LlavaNextImageInputs, tmp_path: Path
) -> None:
    from PIL import Image

    model = runner.model
    pixels, sizes = torch.zeros(5, 3, SIDE, SIDE), torch.tensor([[90, 60]])
    with pytest.raises(ValueError, match="takes images, not 'video'"):
        model.embed_multimodal("video", {"pixel_values": pixels, "image_sizes": sizes})
    with pytest.raises(ValueError, match="need pixel_values and image_sizes"):
        model.embed_multimodal("image", {"pixel_values": pixels})
    with pytest.raises(ValueError, match=r"has 5 tiles .*pixel_values has 3"):
        model.embed_multimodal("image", {"pixel_values": pixels[:3], "image_sizes": sizes})
    with pytest.raises(ValueError, match="one image"):
        model.embed_multimodal("image", {"pixel_values": pixels, "image_sizes": sizes.repeat(2, 1)})

    with pytest.raises(ValueError, match=r"PIL\.Image\.Image"):
        processor.process([IMAGE_TOKEN_ID], {"image": [np.zeros((56, 56, 3))]})
    with pytest.raises(ValueError, match="1 image placeholder"):
        processor.process([IMAGE_TOKEN_ID], {"image": [random_image(8, 8)] * 2})
    with pytest.raises(ValueError, match="the image is empty"):
        processor.process([IMAGE_TOKEN_ID], {"image": [Image.new("RGB", (0, 5))]})
    with pytest.raises(ValueError, match="mm_processor_kwargs are not supported"):
        processor.process([IMAGE_TOKEN_ID], {"image": [random_image(8, 8)]}, {"max_pixels": 9})

    # processor configs that do not fit the model are refused when the processor is built
    hf_config = runner.hf_config
    for path in model_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config_path = tmp_path / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    for change, error in (
        ({"image_grid_pinpoints": [[42, 84]]}, "but the model's config has"),
        ({"image_grid_pinpoints": [[42, 70]]}, "not a multiple of the vision tower's"),
        ({"crop_size": {"height": 28, "width": 28}}, "cuts 28-pixel tiles"),
        ({"size": {"shortest_edge": 56}, "do_center_crop": False}, "makes 56x56 tiles"),
        ({"image_processor_type": "CLIPImageProcessor"}, "not supported for LLaVA-NeXT"),
    ):
        config_path.write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=error):
            LlavaNextImageInputs.from_pretrained(tmp_path, hf_config)
    config_path.unlink()
    with pytest.raises(ValueError, match=r"no preprocessor_config\.json"):
        LlavaNextImageInputs.from_pretrained(tmp_path, hf_config)

    # a CLIP tower keeping its class row gives tiles of 10 rows, not a 3 x 3 grid
    full = save_tiny_llava_next(tmp_path / "full", vision_feature_select_strategy="full")
    with pytest.raises(ValueError, match="need 9 feature rows per tile"):
        Runner(full)
