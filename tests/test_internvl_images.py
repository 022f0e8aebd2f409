"""InternVL (``InternVLForConditionalGeneration``, the ``-hf`` checkpoints) with images against
HF transformers on tiny random checkpoints (tests/fixtures_internvl.py: Qwen2 text, 2 layers of
hidden 64; a 2-layer InternViT tower of 56-pixel tiles, 4 x 4 patches shuffled into 4 rows a
tile; 1 to 6 tiles, plus a thumbnail when more than one).

Checked, float32: each image's rows against HF's ``get_image_features`` to 1e-5 (one tile and
several; LayerNorm towers with q/k biases, an RMSNorm tower with q/k norms and the final
LayerNorm, and a state before the last layer), and a bfloat16 model's rows; the tile grid,
the pixels and the token count against transformers' ``GotOcr2ImageProcessor`` (PIL backend)
and ``InternVLProcessor``; the
expanded prompt (``<img>``, the image's ``<IMG_CONTEXT>`` run, ``</img>``); prefill and decode
logits with one and two images against HF's forward to 1e-4, and that another image changes
them; greedy tokens and each token's logprob through ``LLM.generate`` and ``LLM.chat`` against
HF ``generate``, with chunked prefill through an image and a prefix-cache hit over it; which
tensors are read, in both layouts; and the refusals.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf
from fixtures_internvl import (
    END_ID,
    IMAGE_TOKEN_ID,
    SIDE,
    START_ID,
    TOKENS_PER_TILE,
    hf_inputs,
    hf_model,
    hf_processor,
    image_processor,
    save_tiny_internvl,
)
from fixtures_llava import random_image
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
from packaging.version import Version
from safetensors.torch import load_file, save_file
from test_models_parity import Runner

from chassis.builtin_plugins.models.internvl_images import (
    InternVLForConditionalGenerationWithImages,
)
from chassis.builtin_plugins.models.internvl_processing import (
    InternVLImageInputs,
    TilePreprocessing,
)
from chassis.builtin_plugins.models.qwen2 import Qwen2ForCausalLM
from chassis.core.multimodal import MultiModalFeature

ONE = "<|im_start|>user\n<IMG_CONTEXT>\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = (
    "<|im_start|>user\nCompare <IMG_CONTEXT>\nwith <IMG_CONTEXT>\nplease.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TEXT = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
#: (height, width) of the test images: one tile, wide and tall grids, the most tiles, tiny
SIZES = {
    "square": (56, 56),
    "wide": (60, 130),
    "tall": (130, 60),
    "thin": (200, 20),
    "tiny": (13, 21),
    "big": (100, 101),
}
#: tower variants (vision config overrides, wrapper overrides) for the feature parity
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "layer_norm": ({}, {}),
    "rms_qk_norm": (
        {
            "norm_type": "rms_norm",
            "use_qk_norm": True,
            "attention_bias": False,
            "use_mean_pooling": False,
        },
        {},
    ),
    "earlier_state": ({}, {"vision_feature_layer": -2}),
}


model_dir, hf, runner = checkpoint_fixtures(save_tiny_internvl, hf_model)
processor = processor_fixture(InternVLImageInputs)


@pytest.fixture(scope="module")
def images() -> dict[str, Any]:
    found = {name: random_image(h, w, seed=i) for i, (name, (h, w)) in enumerate(SIZES.items())}
    found["other"] = random_image(*SIZES["wide"], seed=99)
    return found


def expand(
    processor: InternVLImageInputs, model_dir: Path, prompt: str, pictures: list[Any]
) -> tuple[list[int], list[MultiModalFeature]]:
    """Our expanded prompt and features for ``prompt`` and ``pictures``, as the front-end
    makes them."""
    from chassis.core.tokenizer import load_tokenizer

    ids = load_tokenizer(model_dir)(prompt).input_ids
    return processor.process(ids, {"image": pictures})


# -- the image side ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_image_rows_match_get_image_features(
    variant: str, model_dir: Path, images: dict[str, Any], tmp_path: Path
) -> None:
    """HF's ``get_image_features`` rows for an image of one tile and images of 3 and 7
    tiles, through ``embed_multimodal`` (the tiles' rows in order)."""
    vision, overrides = VARIANTS[variant]
    directory = model_dir if variant == "layer_norm" else tmp_path / variant
    if variant != "layer_norm":
        save_tiny_internvl(directory, seed=3, vision=vision, **overrides)
    hf, model = hf_model(directory), Runner(directory).model
    for name, tiles in (("square", 1), ("wide", 3), ("thin", 7)):
        pixels = hf_inputs(directory, ONE, [images[name]])["pixel_values"]
        assert pixels.shape == (tiles, 3, SIDE, SIDE)
        with torch.no_grad():
            expected = hf.get_image_features(pixel_values=pixels).pooler_output
            ours = model.embed_multimodal("image", {"pixel_values": pixels})
        assert ours.shape == (tiles * TOKENS_PER_TILE, 64)
        torch.testing.assert_close(
            ours, expected.reshape(-1, 64), atol=1e-5, rtol=1e-5, msg=f"{variant} {name}"
        )
    if variant == "earlier_state":
        assert len(model.vision_tower.encoder.layer) == 1
    if variant == "rms_qk_norm":
        assert model.vision_tower.layernorm is not None


def test_the_tower_runs_in_the_model_dtype(
    model_dir: Path, runner: Runner, images: dict[str, Any]
) -> None:
    """A bfloat16 model's image rows are bfloat16, near the float32 model's."""
    pixels = {"pixel_values": hf_inputs(model_dir, ONE, [images["wide"]])["pixel_values"]}
    with torch.no_grad():
        rows = Runner(model_dir, torch.bfloat16).model.embed_multimodal("image", pixels)
        reference = runner.model.embed_multimodal("image", pixels)
    assert rows.dtype == torch.bfloat16
    torch.testing.assert_close(rows.float(), reference, atol=3e-2, rtol=3e-2)


# -- the processor ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [{}, {"min_patches": 2, "max_patches": 4}, {"max_patches": 1}, {"max_patches": 12}],
    ids=["default", "at_least_two", "one_tile", "twelve"],
)
def test_pixels_match_transformers_image_processor(settings: dict[str, Any]) -> None:
    """Our tiles equal transformers' ``GotOcr2ImageProcessor`` (PIL backend, with
    ``crop_to_patches`` as ``InternVLProcessor`` asks) for every test image, a transparent one
    and extreme aspect ratios; the tile count agrees with its ``get_number_of_image_patches``."""
    from PIL import Image

    hf = image_processor(**settings)
    ours = TilePreprocessing.from_dict(json.loads(hf.to_json_string()), SIDE)
    rgba = Image.fromarray(np.random.default_rng(7).integers(0, 256, (30, 70, 4), dtype=np.uint8))
    samples = [random_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES.values())]
    for image in [*samples, rgba, random_image(1, 300, seed=4), random_image(500, 3, seed=5)]:
        out = hf(images=[image], crop_to_patches=True, return_tensors="np")
        expected = out["pixel_values"]
        got = ours(image)
        assert got.dtype == np.float32 and got.shape == expected.shape, image.size
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0, err_msg=str(image.size))
        count = hf.get_number_of_image_patches(image.height, image.width, {"crop_to_patches": True})
        assert ours.num_tiles(image.height, image.width) == count == got.shape[0]


def test_prompts_expand_as_internvl_processor(
    model_dir: Path, processor: InternVLImageInputs, images: dict[str, Any]
) -> None:
    """Each ``<IMG_CONTEXT>`` becomes ``<img>``, the image's run and ``</img>`` where HF's
    processor puts them, with HF's pixels; the token count is HF's for many sizes."""
    pictures = [images["thin"], images["square"]]
    expected = hf_inputs(model_dir, TWO, pictures)
    expanded, features = expand(processor, model_dir, TWO, pictures)
    assert expanded == expected["input_ids"][0].tolist()
    assert [f.length for f in features] == [7 * TOKENS_PER_TILE, TOKENS_PER_TILE]
    offset = 0
    for feature in features:
        assert expanded[feature.offset - 1] == START_ID and expanded[feature.end] == END_ID
        assert set(expanded[feature.offset : feature.end]) == {IMAGE_TOKEN_ID}
        pixels = feature.tensors()["pixel_values"]
        tiles = pixels.shape[0]
        torch.testing.assert_close(
            pixels, expected["pixel_values"][offset : offset + tiles], atol=0, rtol=0
        )
        offset += tiles
    assert offset == expected["pixel_values"].shape[0]
    rng = np.random.default_rng(0)
    sizes = [(1, 3000), (3000, 2), (448, 448), (480, 640), (1080, 1920), (56, 57)]
    sizes += [tuple(int(v) for v in rng.integers(10, 2000, 2)) for _ in range(40)]
    hf_counts = hf_processor(model_dir)._get_num_multimodal_tokens(image_sizes=sizes)
    # transformers 5.25 counts the <IMG_CONTEXT> run only, no longer <img> and </img>
    framing = 0 if Version(tf.__version__).release < (5, 25) else 2
    for (height, width), count in zip(sizes, hf_counts["num_image_tokens"], strict=True):
        assert processor.num_tokens(height, width) == count + framing, (height, width)


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("pictures", [("wide",), ("big", "tiny")])
def test_logits_with_images_match_transformers(
    model_dir: Path,
    hf: Any,
    runner: Runner,
    processor: InternVLImageInputs,
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
    processor: InternVLImageInputs,
    images: dict[str, Any],
) -> None:
    """The same prompt with another image of the same size: other logits after the image,
    HF's for it (the rows are used, so the parity above is not vacuous)."""
    logits = []
    for picture in (images["wide"], images["other"]):
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
    a 28-token image (4-token blocks) and the same image again from the prefix cache; then
    ``LLM.chat`` with an image part. Every answer is HF's."""
    cases = {
        "one": (ONE, [images["wide"]]),
        "two": (TWO, [images["big"], images["square"]]),
        "text": (TEXT, []),
    }
    batch = generate_answers(model_dir, media_prompts(cases.values()))
    for (what, (prompt, pictures)), answer in zip(cases.items(), batch, strict=True):
        answer.assert_matches(next_answer(hf, model_dir, prompt, pictures), what)

    expected = next_answer(hf, model_dir, ONE, [images["thin"]])
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
    request = {"prompt": ONE, "multi_modal_data": {"image": [images["thin"]]}}
    try:
        [(cold, cold_cached)] = answers_and_cached(llm.generate([request], PARAMS))
        assert runner.mm.num_encoder_runs == 1  # once, though its 28 tokens took 2+ steps
        [(warm, warm_cached)] = answers_and_cached(llm.generate([request], PARAMS))
        [chatted] = answers(llm.chat(chat, PARAMS))
    finally:
        llm.shutdown()
    cold.assert_matches(expected, "chunked")
    warm.assert_matches(expected, "prefix-cached")
    # (past </img>: 3 tokens, <img>, the 28-token run, </img>)
    assert cold_cached == 0 and warm_cached >= 4 + 7 * TOKENS_PER_TILE + 1
    assert runner.mm.num_encoder_runs == 2  # the cached image needed none; chat's did
    chatted.assert_matches(next_answer(hf, model_dir, ONE, [images["tall"]]), "chat")


# -- what is read and built -------------------------------------------------------------------


def test_every_tensor_is_read_in_both_layouts(
    model_dir: Path, runner: Runner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every tensor of the saved layout (``language_model.model.*``, ``vision_tower.*``,
    ``multi_modal_projector.*``) is read; transformers' in-memory names (``model.*``) load
    the same parameters; the class composes over the Qwen2 text config's decoder."""
    in_file = set(load_file(model_dir / "model.safetensors"))
    assert any(n.startswith("vision_tower.encoder.layer.1.") for n in in_file)
    read, model = read_tensors(model_dir, monkeypatch)
    assert read == in_file
    assert isinstance(model, InternVLForConditionalGenerationWithImages)
    assert isinstance(model, Qwen2ForCausalLM)
    assert type(model).supported_modalities == {"image"}
    assert model.tie_word_embeddings  # the top-level default, as HF ties

    renamed = tmp_path / "in_memory"
    renamed.mkdir()
    for path in model_dir.iterdir():
        if path.name != "model.safetensors":
            (renamed / path.name).write_bytes(path.read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    prefix = ("language_model.model.", "model.language_model.")
    save_file(
        {
            (prefix[1] + n[len(prefix[0]) :]) if n.startswith(prefix[0]) else "model." + n: t
            for n, t in tensors.items()
        },
        renamed / "model.safetensors",
    )
    reloaded = dict(Runner(renamed).model.named_parameters())
    params = dict(runner.model.named_parameters())
    assert reloaded.keys() == params.keys()
    for name, param in params.items():
        assert torch.equal(reloaded[name], param), name


# -- refusals ---------------------------------------------------------------------------------


def test_bad_inputs_are_clear_errors(
    model_dir: Path, runner: Runner, processor: InternVLImageInputs, tmp_path: Path
) -> None:
    from PIL import Image

    model = runner.model
    pixels = torch.zeros(3, 3, SIDE, SIDE)
    with pytest.raises(ValueError, match="takes images, not 'video'"):
        model.embed_multimodal("video", {"pixel_values": pixels})
    with pytest.raises(ValueError, match="lack pixel_values"):
        model.embed_multimodal("image", {})
    with pytest.raises(ValueError, match="one image"):
        model.embed_multimodal("image", {"pixel_values": pixels[None].repeat(2, 1, 1, 1, 1)})
    with pytest.raises(ValueError, match="the tower's image_size"):
        model.embed_multimodal("image", {"pixel_values": torch.zeros(1, 3, 28, 28)})

    with pytest.raises(ValueError, match=r"PIL\.Image\.Image"):
        processor.process([IMAGE_TOKEN_ID], {"image": [np.zeros((56, 56, 3))]})
    with pytest.raises(ValueError, match="1 image placeholder"):
        processor.process([IMAGE_TOKEN_ID], {"image": [random_image(8, 8)] * 2})
    with pytest.raises(ValueError, match="the image is empty"):
        processor.process([IMAGE_TOKEN_ID], {"image": [Image.new("RGB", (0, 5))]})
    with pytest.raises(ValueError, match="mm_processor_kwargs are not supported"):
        processor.process([IMAGE_TOKEN_ID], {"image": [random_image(8, 8)]}, {"max_patches": 2})

    # processor files that do not fit the model are refused when the processor is built
    hf_config = runner.hf_config
    for path in model_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config_path = tmp_path / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    for change, error in (
        ({"size": {"height": 28, "width": 28}}, "vision tower takes 56x56"),
        ({"do_resize": False}, "unresized images"),
        ({"image_processor_type": "CLIPImageProcessor"}, "not supported for InternVL"),
        ({"min_patches": 3, "max_patches": 2}, "allow no grid"),
    ):
        config_path.write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=error):
            InternVLImageInputs.from_pretrained(tmp_path, hf_config)
    config_path.write_text(json.dumps(config))
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 256}))
    with pytest.raises(ValueError, match="image_seq_length is 256, but the model gives 4"):
        InternVLImageInputs.from_pretrained(tmp_path, hf_config)
    config_path.unlink()
    with pytest.raises(ValueError, match=r"no preprocessor_config\.json"):
        InternVLImageInputs.from_pretrained(tmp_path, hf_config)

    # settings HF's model cannot run either are refused when the model is built
    for overrides, error in (
        ({"vision_feature_select_strategy": "full"}, "'full' is not supported"),
        ({"downsample_ratio": 0.3}, "downsample_ratio 0.3"),
    ):
        config = json.loads((model_dir / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, **overrides}))
        with pytest.raises(ValueError, match=error):
            Runner(tmp_path)
