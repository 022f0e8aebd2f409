"""Llama 4 (``Llama4ForConditionalGeneration``) with images against HF transformers on a tiny
random float32 checkpoint written here.

The checkpoint: tests/test_llama4.py's 4-layer text model (chunks of 8, NoPE layers, MoE)
and a vision tower of 2 layers, hidden 32 (2 heads of 16), 56-pixel tiles of 14-pixel
patches (4 x 4, pixel-shuffled into 4 rows a tile), adapter and projector of width 64; the
tokenizer is SmolLM2's with Llama 4's six image tokens added; ``preprocessor_config.json``
is ``Llama4ImageProcessorFast``'s with at most 6 tiles. transformers' image processor needs
torchvision, which is not installed here: HF's inputs come from its ``Llama4Processor`` (the
prompt expansion) over a stand-in image processor that returns our pixels with the aspect
ratios of transformers' own tiling functions (imported with a stub torchvision, used only
for their arithmetic). Checked, float32: image rows against HF's tower and projector; the
tiling and the expanded prompt against HF's at the real geometry (336-pixel tiles, 144 rows,
16 tiles) and the tiny one; prefill and decode logits against HF's forward (its steps run
one by one, :class:`HfReference`: transformers 5.24's own forward fails building its
output); greedy tokens and logprobs through ``LLM`` against HF ``generate``; chat with an
``image_url`` part; chunked prefill through the images; a prefix-cache hit over them; two
tensor-parallel ranks; which tensors are read; a bfloat16 tower; the refusals.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_llava import random_image
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
from safetensors.torch import load_file, save_file
from test_llama4 import text_fields
from test_models_parity import Runner

from chassis.builtin_plugins.models.llama4 import Llama4ForConditionalGeneration
from chassis.builtin_plugins.models.llama4_images import Llama4ForConditionalGenerationWithImages
from chassis.builtin_plugins.models.llama4_processing import Llama4ImageInputs, Llama4Tiles
from chassis.core.model_loader import language_model_config, model_class
from chassis.core.tokenizer import load_tokenizer

SIDE = 56
TOKENS_PER_TILE = 4
MAX_TILES = 6
IMAGE_TOKENS = [
    "<|image_start|>",
    "<|image_end|>",
    "<|image|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
]
START_ID, END_ID, IMAGE_ID, PATCH_ID = 49152, 49153, 49154, 49155
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type in ['image', 'image_url', 'image_pil'] %}<|image|>"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ONE = "<|im_start|>user\n<|image|>What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\nCompare <|image|> with <|image|>.<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
IMAGES = {"square": (56, 56), "wide": (60, 130), "thin": (200, 20), "big": (100, 101)}


def image(name: str) -> Any:
    return random_image(*IMAGES[name], seed=list(IMAGES).index(name))


# -- the checkpoint ---------------------------------------------------------------------------


def tiny_config() -> Any:
    import transformers as tf

    vision = tf.Llama4VisionConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        image_size=SIDE,
        patch_size=14,
        vision_output_dim=64,
        projector_input_dim=64,
        projector_output_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config = tf.Llama4Config(
        text_config=text_fields(vocab_size=49160),
        vision_config=vision.to_dict(),
        image_token_index=PATCH_ID,
        boi_token_index=START_ID,
        eoi_token_index=END_ID,
    )
    config.architectures = ["Llama4ForConditionalGeneration"]
    return config


def save_tiny_llama4_images(directory: Path) -> Path:
    """The tiny random checkpoint (module docstring); 1-D parameters randomized too."""
    import transformers as tf

    from chassis.core.gguf_checkpoint import embedded_model_dir

    torch.manual_seed(0)
    model = tf.Llama4ForConditionalGeneration(tiny_config())  # float32
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = tf.AutoTokenizer.from_pretrained(embedded_model_dir())
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    assert tokenizer.convert_tokens_to_ids("<|patch|>") == PATCH_ID
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    processor_settings = {
        "image_processor_type": "Llama4ImageProcessorFast",
        "size": {"height": SIDE, "width": SIDE},
        "max_patches": MAX_TILES,
        "resize_to_max_canvas": False,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255,
        "resample": 2,
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(processor_settings))
    (directory / "processor_config.json").write_text(
        json.dumps({"patch_size": 14, "pixel_shuffle_ratio": 0.5})
    )
    return directory


class HfReference:
    """HF's ``Llama4ForConditionalGeneration`` (its other attributes reachable as they are)
    with its forward's steps run here: transformers 5.24's forward fails building its output
    (it reads ``image_outputs`` from the language model's output), so the token embeddings,
    HF's image rows (``get_image_features``, ``multi_modal_projector``) put in place by its
    ``get_placeholder_mask`` and ``masked_scatter``, and its language model are called one by
    one, as that forward calls them."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def embeds(self, input_ids: torch.Tensor, pixel_values: Any = None) -> torch.Tensor:
        hf = self.model
        embeds = hf.get_input_embeddings()(input_ids)
        if pixel_values is not None:
            state = hf.get_image_features(pixel_values=pixel_values).last_hidden_state
            rows = hf.multi_modal_projector(state.reshape(-1, state.shape[-1]))
            mask = hf.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=rows)
            embeds = embeds.masked_scatter(mask, rows)
        return embeds

    def __call__(self, input_ids: torch.Tensor, pixel_values: Any = None) -> Any:
        return self.model.language_model(inputs_embeds=self.embeds(input_ids, pixel_values))

    def generate(self, input_ids: torch.Tensor, pixel_values: Any = None, **kwargs: Any) -> Any:
        embeds = self.embeds(input_ids, pixel_values)
        out = self.model.language_model.generate(inputs_embeds=embeds, **kwargs)
        out.sequences = torch.cat([input_ids, out.sequences], dim=1)  # (the new tokens only)
        return out


def hf_model(model_dir: Path) -> HfReference:
    import transformers as tf

    model = tf.Llama4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    return HfReference(model.eval())


model_dir, hf, runner = checkpoint_fixtures(save_tiny_llama4_images, hf_model)
processor = processor_fixture(Llama4ImageInputs)


# -- HF's side: its tiling arithmetic and its processor ---------------------------------------


def hf_tiling() -> Any:
    """transformers' ``image_processing_llama4`` module, imported over a stub torchvision
    (only its tiling functions are used: they need no torchvision)."""
    import transformers.image_processing_backends  # noqa: F401  (before the stub)

    name = "transformers.models.llama4.image_processing_llama4"
    if name in sys.modules:
        return sys.modules[name]
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2"]
    names.append("torchvision.transforms.v2.functional")
    stubs = [types.ModuleType(n) for n in names]
    for parent, child in itertools.pairwise(stubs):
        setattr(parent, child.__name__.rsplit(".", 1)[1], child)
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update(dict(zip(names, stubs, strict=True)))
    try:
        return importlib.import_module(name)
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module


def hf_grid(height: int, width: int, tile: int, max_tiles: int) -> tuple[int, int]:
    """HF's ``(rows, cols)`` of tiles for an image."""
    from transformers.image_utils import SizeDict

    m = hf_tiling()
    sizes = m.find_supported_resolutions(max_tiles, SizeDict(height=tile, width=tile))
    canvas = m.get_best_fit((height, width), torch.tensor(sizes))
    return int(canvas[0]) // tile, int(canvas[1]) // tile


def hf_processor(tokenizer: Any, pixels: list[torch.Tensor], grids: list[tuple[int, int]]) -> Any:
    """transformers' ``Llama4Processor`` over a stand-in image processor giving ``pixels``
    (each image's tiles) and the aspect ratios ``grids``."""
    import transformers as tf
    from transformers.image_processing_utils import BaseImageProcessor, BatchFeature

    class StandIn(BaseImageProcessor):
        model_input_names = ["pixel_values"]

        def __call__(self, images: Any, **kwargs: Any) -> BatchFeature:
            return BatchFeature(
                {"pixel_values": torch.cat(pixels), "aspect_ratios": torch.tensor(grids)}
            )

        preprocess = __call__

    return tf.Llama4Processor(image_processor=StandIn(), tokenizer=tokenizer, patch_size=14)


@functools.cache
def hf_tokenizer(model_dir: Path) -> Any:
    import transformers as tf

    return tf.AutoTokenizer.from_pretrained(model_dir)


def hf_inputs(model_dir: Path, prompt: str, pictures: list[Any]) -> dict[str, torch.Tensor]:
    """HF's model inputs: ``Llama4Processor``'s expansion with HF's grids, our pixels."""
    tokenizer = hf_tokenizer(model_dir)
    if not pictures:
        return {"input_ids": tokenizer(prompt, return_tensors="pt").input_ids}
    tiles = Llama4Tiles.from_dict(
        json.loads((model_dir / "preprocessor_config.json").read_text()), SIDE
    )
    pixels = [torch.from_numpy(tiles(p)) for p in pictures]
    grids = [hf_grid(p.height, p.width, SIDE, MAX_TILES) for p in pictures]
    out = hf_processor(tokenizer, pixels, grids)(text=prompt, images=pictures, return_tensors="pt")
    return {"input_ids": out["input_ids"], "pixel_values": out["pixel_values"]}


def expand(model_dir: Path, processor: Llama4ImageInputs, prompt: str, pictures: list[Any]):
    return processor.process(load_tokenizer(model_dir)(prompt).input_ids, {"image": pictures})


def hf_answer(hf: Any, model_dir: Path, prompt: str, pictures: list[Any]) -> Answer:
    return hf_generate(hf, hf_inputs(model_dir, prompt, pictures))


# -- the model --------------------------------------------------------------------------------


def test_image_rows_match_hf_tower_and_projector(
    hf: Any, runner: Runner, processor: Llama4ImageInputs
) -> None:
    model = runner.model
    assert isinstance(model, Llama4ForConditionalGenerationWithImages)
    for name, tiles in (("square", 1), ("wide", 7), ("thin", 5)):
        picture = image(name)
        pixels = torch.from_numpy(processor.tiles(picture))
        rows, cols = hf_grid(picture.height, picture.width, SIDE, MAX_TILES)
        assert rows * cols + (rows * cols > 1) == tiles
        assert pixels.shape == (tiles, 3, SIDE, SIDE)
        with torch.no_grad():
            state = hf.get_image_features(pixel_values=pixels).last_hidden_state
            expected = hf.multi_modal_projector(state)
            ours = model.image_features(pixels)
        assert ours.shape == (tiles, TOKENS_PER_TILE, 64)
        assert expected.abs().max() > 1e-3
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5, msg=name)


#: image sizes (height, width) for the real geometry: square, landscape, portrait, tiny,
#: extreme strips, just past a tile
REAL_SIZES = [(336, 336), (480, 640), (1080, 1920), (2000, 300), (50, 50), (337, 1010), (5000, 40)]


def test_tiling_and_prompt_match_hf_at_the_real_geometry(
    model_dir: Path, processor: Llama4ImageInputs
) -> None:
    """336-pixel tiles, at most 16, 144 rows a tile (transformers' defaults): each image's
    grid is HF's, and so is the run ``Llama4Processor`` writes for it; one image's pixels
    are its tiles."""
    import transformers as tf
    from PIL import Image

    tiles = Llama4Tiles.from_dict({}, 336)
    real = Llama4ImageInputs(tiles, 144, processor.ids, "<|image|>")
    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    prompt = "Look: <|image|>!"
    ids = tokenizer(prompt).input_ids
    grids = []
    for height, width in REAL_SIZES:
        rows, cols = hf_grid(height, width, 336, 16)
        assert tiles.grid(height, width) == (rows, cols), (height, width)
        grids.append((rows, cols))
        num_tiles = rows * cols + (rows * cols > 1)
        pixels = torch.zeros(num_tiles, 3, 336, 336)
        expected = hf_processor(tokenizer, [pixels], [(rows, cols)])(
            text=prompt, images=[Image.new("RGB", (1, 1))], return_tensors="pt"
        )["input_ids"][0].tolist()
        at = ids.index(IMAGE_ID)
        ours = [*ids[:at], *real.placeholder_ids(rows, cols), *ids[at + 1 :]]
        assert ours == expected, (height, width)
        assert ours.count(PATCH_ID) == 144 * num_tiles
        assert real.num_tokens(height, width) == len(ours) - len(ids) + 1
    assert len(set(grids)) > 4  # not one grid for all
    picture = random_image(480, 640)
    expanded, [feature] = real.process(ids, {"image": [picture]})
    rows, cols = tiles.grid(picture.height, picture.width)
    assert expanded[feature.offset : feature.end] == real.placeholder_ids(rows, cols)
    assert feature.tensors()["pixel_values"].shape == (rows * cols + 1, 3, 336, 336)


def test_the_tower_runs_in_the_model_dtype(
    model_dir: Path, runner: Runner, processor: Llama4ImageInputs
) -> None:
    """A bfloat16 model's rows are bfloat16, near the float32 model's."""
    (feature,) = expand(model_dir, processor, ONE, [image("wide")])[1]
    with torch.no_grad():
        rows = Runner(model_dir, torch.bfloat16).model.embed_multimodal("image", feature.tensors())
        reference = runner.model.embed_multimodal("image", feature.tensors())
    assert rows.dtype == torch.bfloat16 and rows.shape == (feature.end - feature.offset, 64)
    torch.testing.assert_close(rows.float(), reference, atol=2e-2, rtol=2e-2)


def test_tiny_prompts_expand_as_llama4_processor(
    model_dir: Path, processor: Llama4ImageInputs
) -> None:
    pictures = [image("thin"), image("square")]
    expected = hf_inputs(model_dir, TWO, pictures)
    expanded, features = expand(model_dir, processor, TWO, pictures)
    assert expanded == expected["input_ids"][0].tolist()
    runs = [expanded[f.offset : f.end] for f in features]
    assert [run.count(PATCH_ID) for run in runs] == [5 * TOKENS_PER_TILE, TOKENS_PER_TILE]
    assert all(run[0] == START_ID and run[-1] == END_ID and IMAGE_ID in run for run in runs)


@pytest.mark.parametrize("pictures", [("wide",), ("big", "square")])
def test_logits_with_images_match_transformers(
    model_dir: Path, hf: Any, runner: Runner, processor: Llama4ImageInputs, pictures: tuple
) -> None:
    prompt = ONE if len(pictures) == 1 else TWO
    chosen = [image(name) for name in pictures]
    inputs = hf_inputs(model_dir, prompt, chosen)
    ids, features = expand(model_dir, processor, prompt, chosen)
    assert ids == inputs["input_ids"][0].tolist()
    assert_prefill_and_decode_match(runner, hf, inputs, features)


def test_every_tensor_is_read_in_both_layouts(
    model_dir: Path, runner: Runner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What transformers saves (``language_model.*``, ``vision_model.*``,
    ``multi_modal_projector.*``): every tensor is read. Its in-memory names
    (``model.language_model.*``, ``model.vision_model.*``, ...; ``lm_head.*``) load the same
    parameters."""
    tensors = load_file(model_dir / "model.safetensors")
    read, model = read_tensors(model_dir, monkeypatch)
    assert read == set(tensors)
    assert isinstance(model, Llama4ForConditionalGenerationWithImages)

    def in_memory(name: str) -> str:
        if name.startswith("language_model.lm_head."):
            return name.removeprefix("language_model.")
        if name.startswith("language_model.model."):
            return "model.language_model." + name.removeprefix("language_model.model.")
        return "model." + name

    for path in model_dir.iterdir():
        if path.name != "model.safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    save_file({in_memory(n): t for n, t in tensors.items()}, tmp_path / "model.safetensors")
    params = dict(runner.model.named_parameters())
    reloaded = dict(Runner(tmp_path).model.named_parameters())
    assert reloaded.keys() == params.keys()
    for name, param in params.items():
        assert torch.equal(reloaded[name], param), name


# -- through the engine -----------------------------------------------------------------------


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


def test_chat_with_an_image_url_part_matches_hf(model_dir: Path, hf: Any) -> None:
    picture = image("wide")
    llm = small_llm(model_dir)
    try:
        [output] = llm.chat(image_url_chat(png_data_url(picture)), PARAMS)
    finally:
        llm.shutdown()
    assert output.prompt == ONE
    [chatted] = answers([output])
    chatted.assert_matches(hf_answer(hf, model_dir, ONE, [picture]), "chat")


def test_chunked_prefill_and_prefix_cache_through_two_images(
    model_dir: Path, hf: Any, processor: Llama4ImageInputs
) -> None:
    """Steps of 16 tokens cut through a 5-tile image's run and a 1-tile one (4-token
    blocks); the same request again is served from the prefix cache over both runs."""
    pictures = [image("thin"), image("square")]
    expected = hf_answer(hf, model_dir, TWO, pictures)
    _, features = expand(model_dir, processor, TWO, pictures)
    assert features[0].end - features[0].offset > 16
    llm = small_llm(model_dir, **CHUNKED)
    mm = llm.engine.executor.worker.runner.mm
    request = {"prompt": TWO, "multi_modal_data": {"image": pictures}}
    try:
        [(cold, cold_cached)] = answers_and_cached(llm.generate([request], PARAMS))
        assert mm.num_encoder_runs == 2  # once per image, though it took many steps
        [(warm, warm_cached)] = answers_and_cached(llm.generate([request], PARAMS))
    finally:
        llm.shutdown()
    cold.assert_matches(expected, "chunked")
    warm.assert_matches(expected, "prefix-cached")
    assert cold_cached == 0 and warm_cached >= features[-1].end
    assert mm.num_encoder_runs == 2  # the cached images needed none


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_tensor_parallel_ranks_with_images(model_dir: Path, hf: Any) -> None:
    pictures = [image("big"), image("square")]
    [got] = two_rank_answers(model_dir, [{"prompt": TWO, "multi_modal_data": {"image": pictures}}])
    got.assert_matches(hf_answer(hf, model_dir, TWO, pictures), "two ranks")


# -- refusals ---------------------------------------------------------------------------------


def test_bad_inputs_are_clear_errors(
    model_dir: Path, runner: Runner, processor: Llama4ImageInputs, tmp_path: Path
) -> None:
    model = runner.model
    pixels = torch.zeros(1, 3, SIDE, SIDE)
    run = torch.tensor(processor.placeholder_ids(1, 1))
    with pytest.raises(ValueError, match="takes images, not 'video'"):
        model.embed_multimodal("video", {"pixel_values": pixels, "placeholder_ids": run})
    with pytest.raises(ValueError, match="its placeholder run holds 8 image tokens"):
        model.embed_multimodal("image", {"pixel_values": pixels, "placeholder_ids": run.repeat(2)})
    with pytest.raises(ValueError, match="Llama 4 tiles are"):
        model.embed_multimodal("image", {"pixel_values": pixels[..., :28], "placeholder_ids": run})
    with pytest.raises(ValueError, match="1 image placeholder"):
        processor.process([IMAGE_ID], {"image": [random_image(8, 8)] * 2})
    with pytest.raises(ValueError, match="mm_processor_kwargs are not supported"):
        processor.process([IMAGE_ID], {"image": [random_image(8, 8)]}, {"max_patches": 2})

    for path in model_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    settings_path = tmp_path / "processor_config.json"
    settings_path.write_text(json.dumps({"patch_size": 28}))
    with pytest.raises(ValueError, match="writes 1 image tokens per tile"):
        Llama4ImageInputs.from_pretrained(tmp_path, runner.hf_config)
    settings_path.write_text("{}")
    pre = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**pre, "size": 112}))
    with pytest.raises(ValueError, match="size 112 is not supported"):
        Llama4ImageInputs.from_pretrained(tmp_path, runner.hf_config)


def test_a_vision_config_hf_cannot_run_is_served_as_text_only() -> None:
    config = tiny_config()
    assert model_class(language_model_config(config)) is Llama4ForConditionalGenerationWithImages
    config.vision_config.intermediate_size = 64  # not the pixel shuffle's width
    cls = model_class(language_model_config(config))
    assert cls is Llama4ForConditionalGeneration and not cls.supported_modalities
