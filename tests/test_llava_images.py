"""LLaVA-1.5 (``LlavaForConditionalGeneration``) with images against HF transformers on tiny
random checkpoints (tests/fixtures_llava.py: Llama text, 2 layers of hidden 64; a CLIP tower
of 3 layers or a SigLIP one of 2, 56-pixel images of 16 patches).

Checked, float32: the tower and projector rows against HF's ``get_image_features`` (CLIP with
``vision_feature_layer`` -2 and ``"default"``, a list of layers with ``"full"``, SigLIP) to
1e-5; our pixels against transformers' image processors (CLIP, LLaVA's with ``do_pad``,
SigLIP; PIL backends) and the expanded prompt against ``LlavaProcessor``'s; prefill and decode
logits with one and two images against HF's forward to 1e-4; greedy tokens and each token's
logprob through ``LLM.generate`` and ``LLM.chat`` against HF ``generate``, with chunked
prefill through an image; that another image changes the logits; which tensors are read in
each layout; and the refusals (LLaVA-NeXT without an image processor config, unknown towers,
bad inputs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_llava import (
    IMAGE_TOKEN_ID,
    TOKENS_PER_IMAGE,
    hf_inputs,
    hf_model,
    image_processor,
    random_image,
    save_tiny_llava,
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
    generate_answers,
    hf_generate,
    hf_logits,
    media_prompts,
    prefill_then_decode,
    read_tensors,
    small_llm,
    two_rank_answers,
)
from safetensors.torch import load_file, save_file
from test_models_parity import Runner

from chassis import SamplingParams
from chassis.builtin_plugins.models.llava import LlavaForConditionalGeneration
from chassis.builtin_plugins.models.llava_images import LlavaForConditionalGenerationWithImages
from chassis.builtin_plugins.models.llava_processing import ClipPreprocessing, LlavaImageInputs
from chassis.core.model_loader import language_model_config, model_class
from chassis.core.multimodal import MultiModalFeature, make_feature

#: one checkpoint per tower setting: (tower, layout, LLaVA config overrides)
CHECKPOINTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "clip": ("clip", "hub", {}),
    # transformers 5's list of layers (concatenated) and the class row kept; its saved names
    "clip_layers": (
        "clip",
        "saved",
        {"vision_feature_layer": [-3, -1], "vision_feature_select_strategy": "full"},
    ),
    "siglip": ("siglip", "hub", {}),
}
#: image tokens of each checkpoint (CLIP's class row kept by "full")
TOKENS = {"clip": TOKENS_PER_IMAGE, "clip_layers": TOKENS_PER_IMAGE + 1, "siglip": 16}
ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: Compare <image>\nwith <image>\nplease. ASSISTANT:"
TEXT = "USER: Tell me a story. ASSISTANT:"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: save_tiny_llava(tmp_path_factory.mktemp(name), tower, layout=layout, **overrides)
        for name, (tower, layout, overrides) in CHECKPOINTS.items()
    }


@pytest.fixture(scope="module")
def hf_models(model_dirs: dict[str, Path]) -> dict[str, Any]:
    return {name: hf_model(d) for name, d in model_dirs.items()}


@pytest.fixture(scope="module")
def runners(model_dirs: dict[str, Path]) -> dict[str, Runner]:
    return {name: Runner(d) for name, d in model_dirs.items()}


@pytest.fixture(scope="module")
def images() -> dict[str, Any]:
    return {
        "tall": random_image(90, 60, seed=1),
        "wide": random_image(40, 100, seed=2),
        "square": random_image(56, 56, seed=3),
        "other": random_image(90, 60, seed=4),
    }


def tower_of(name: str) -> str:
    return CHECKPOINTS[name][0]


def features_of(
    inputs: dict[str, torch.Tensor], length: int = TOKENS_PER_IMAGE
) -> list[MultiModalFeature]:
    """One feature per image of HF's ``inputs`` (``length`` tokens each), as the front-end
    makes them."""
    ids = inputs["input_ids"][0].tolist()
    starts = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID and (i == 0 or ids[i - 1] != t)]
    pixels = inputs.get("pixel_values", torch.zeros(0))
    assert len(starts) == len(pixels)
    return [
        make_feature("image", start, length, {"pixel_values": image[None]})
        for start, image in zip(starts, pixels, strict=True)
    ]


# -- the image side ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tower_and_projector_match_get_image_features(
    model_dirs: dict[str, Path],
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    images: dict[str, Any],
    name: str,
) -> None:
    """Two images in one call, and each through ``embed_multimodal`` (as the runner calls
    it): HF's rows, 16 per image."""
    inputs = hf_inputs(model_dirs[name], TWO, [images["tall"], images["wide"]], tower_of(name))
    model = runners[name].model
    with torch.no_grad():
        expected = hf_models[name].get_image_features(pixel_values=inputs["pixel_values"])
        expected = torch.stack(list(expected.pooler_output))
        ours = model.image_features(inputs["pixel_values"])
        per_image = [
            model.embed_multimodal("image", f.tensors()) for f in features_of(inputs, TOKENS[name])
        ]
    assert ours.shape == expected.shape == (2, TOKENS[name], 64)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(per_image), expected, atol=1e-5, rtol=1e-5)


def test_only_the_layers_needed_are_built(runners: dict[str, Runner]) -> None:
    """CLIP's -2 of 3 layers runs 2 of them; [-3, -1] all 3; SigLIP's -1 of 2 both."""
    built = {name: len(r.model.vision_tower.encoder.layers) for name, r in runners.items()}
    assert built == {"clip": 2, "clip_layers": 3, "siglip": 2}
    assert runners["clip_layers"].model.multi_modal_projector.linear_1.in_features == 64


# -- the processor ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "processor",
    ["clip", "clip_small_crop", "llava_pad", "siglip"],
)
def test_pixels_match_transformers_image_processors(processor: str) -> None:
    """Our PIL/numpy preprocessing gives transformers' pixels (its PIL backends) for
    portrait, landscape, square, smaller-than-the-crop and transparent images."""
    import transformers as tf
    from PIL import Image

    if processor == "clip":
        hf = image_processor("clip")
    elif processor == "clip_small_crop":  # a crop larger than the resized image: zero padding
        hf = tf.CLIPImageProcessorPil(
            size={"shortest_edge": 40}, crop_size={"height": 56, "width": 48}
        )
    elif processor == "llava_pad":
        hf = tf.LlavaImageProcessorPil(
            do_pad=True, size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
        )
    else:
        hf = image_processor("siglip")
    config = json.loads(hf.to_json_string())
    ours = ClipPreprocessing.from_dict(config)
    rgba = Image.fromarray(np.random.default_rng(7).integers(0, 256, (30, 70, 4), dtype=np.uint8))
    samples = [random_image(90, 60, 1), random_image(40, 100, 2), random_image(56, 56, 3), rgba]
    samples.append(random_image(13, 21, 5))
    for image in samples:
        expected = hf(images=[image], return_tensors="np")["pixel_values"][0]
        got = ours(image)
        assert got.dtype == np.float32 and got.shape == expected.shape, image.size
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0, err_msg=str(image.size))


def test_prompts_expand_as_llava_processor(
    model_dirs: dict[str, Path], runners: dict[str, Runner], images: dict[str, Any]
) -> None:
    """One ``<image>`` per image becomes 16 placeholder tokens, where HF's processor puts
    them, with HF's pixels."""
    from chassis.core.tokenizer import load_tokenizer

    for name in ("clip", "siglip"):
        pictures = [images["tall"], images["wide"]]
        expected = hf_inputs(model_dirs[name], TWO, pictures, tower_of(name))
        processor = LlavaImageInputs.from_pretrained(model_dirs[name], runners[name].hf_config)
        ids = load_tokenizer(model_dirs[name])(TWO).input_ids
        assert ids.count(IMAGE_TOKEN_ID) == 2
        expanded, features = processor.process(ids, {"image": pictures})
        assert expanded == expected["input_ids"][0].tolist()
        for feature, pixels in zip(features, expected["pixel_values"], strict=True):
            assert feature.length == TOKENS_PER_IMAGE
            torch.testing.assert_close(feature.tensors()["pixel_values"][0], pixels)


# -- logits -----------------------------------------------------------------------------------


def llava_prefill_then_decode(
    runner: Runner, inputs: dict[str, torch.Tensor], length: int = TOKENS_PER_IMAGE
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`prefill_then_decode` on HF's ``inputs`` (``length`` tokens an image)."""
    return prefill_then_decode(runner, inputs["input_ids"][0].tolist(), features_of(inputs, length))


@pytest.mark.parametrize(
    ("name", "num_images"), [("clip", 1), ("clip", 2), ("clip_layers", 2), ("siglip", 1)]
)
def test_logits_with_images_match_transformers(
    model_dirs: dict[str, Path],
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    images: dict[str, Any],
    name: str,
    num_images: int,
) -> None:
    prompt, pictures = (
        (ONE, [images["tall"]]) if num_images == 1 else (TWO, [images["wide"], images["square"]])
    )
    inputs = hf_inputs(model_dirs[name], prompt, pictures, tower_of(name))
    features = features_of(inputs, TOKENS[name])
    assert_prefill_and_decode_match(runners[name], hf_models[name], inputs, features)


def test_another_image_changes_the_logits(
    model_dirs: dict[str, Path],
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    images: dict[str, Any],
) -> None:
    """The same prompt with another image of the same size: other logits after the image,
    HF's for it (the rows are used, so the parity above is not vacuous)."""
    logits = []
    for picture in (images["tall"], images["other"]):
        inputs = hf_inputs(model_dirs["clip"], ONE, [picture])
        ours, _, _ = llava_prefill_then_decode(runners["clip"], inputs)
        torch.testing.assert_close(ours, hf_logits(hf_models["clip"], inputs), atol=ATOL, rtol=ATOL)
        logits.append(ours)
    end = features_of(inputs)[0].end
    assert (logits[0][end:] - logits[1][end:]).abs().max() > 1e-2


# -- end to end through LLM -------------------------------------------------------------------


def hf_answer(
    hf: Any, model_dir: Path, prompt: str, pictures: list[Any], tower: str = "clip"
) -> Answer:
    """HF ``generate``'s greedy answer (EOS ignored) with each token's logprob."""
    return hf_generate(hf, hf_inputs(model_dir, prompt, pictures, tower))


def test_generate_and_chat_match_hf(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], images: dict[str, Any]
) -> None:
    """One image, two images and text in one batch; then steps of 16 tokens cutting through
    an image (4-token blocks) and the same image again from the prefix cache; then
    ``LLM.chat`` with an image part. Every answer is HF's."""
    model_dir, hf = model_dirs["clip"], hf_models["clip"]
    cases = {
        "one": (ONE, [images["tall"]]),
        "two": (TWO, [images["wide"], images["square"]]),
        "text": (TEXT, []),
    }
    batch = generate_answers(model_dir, media_prompts(cases.values()))
    for (what, (prompt, pictures)), answer in zip(cases.items(), batch, strict=True):
        answer.assert_matches(hf_answer(hf, model_dir, prompt, pictures), what)

    long_prompt = "USER: Look here: <image>\nWhat is in this picture? ASSISTANT:"
    expected = hf_answer(hf, model_dir, long_prompt, [images["tall"]])
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
        assert runner.mm.num_encoder_runs == 1  # once, though its tokens took two steps
        [(warm, warm_cached)] = answers_and_cached(llm.generate([request], PARAMS))
        [chatted] = answers(llm.chat(chat, PARAMS))
    finally:
        llm.shutdown()
    cold.assert_matches(expected, "chunked")
    warm.assert_matches(expected, "prefix-cached")
    assert cold_cached == 0 and warm_cached >= 8 + TOKENS_PER_IMAGE
    assert runner.mm.num_encoder_runs == 2  # the cached image needed none; chat's did
    chatted.assert_matches(hf_answer(hf, model_dir, ONE, [images["tall"]]), "chat")


def test_lora_adapter_with_images(
    model_dirs: dict[str, Path], images: dict[str, Any], tmp_path: Path
) -> None:
    """An adapter on the language model, named as trained on transformers 5's LLaVA
    (``model.language_model.layers.*``), with an image: HF's answer with the adapter merged
    into its weights; the base model's beside it in the same batch."""
    from chassis.core.lora.request import LoRARequest

    model_dir = model_dirs["clip"]
    hf = hf_model(model_dir)
    generator = torch.Generator().manual_seed(0)
    rank, alpha = 8, 16
    tensors = {}
    for layer in range(2):
        for module in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            name = f"model.language_model.layers.{layer}.{module}"
            linear = hf.get_submodule(name)
            a = torch.randn(rank, linear.in_features, generator=generator) * 0.2
            b = torch.randn(linear.out_features, rank, generator=generator) * 0.2
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
            with torch.no_grad():
                linear.weight += alpha / rank * (b @ a)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha}
    adapter_config["target_modules"] = ["q_proj", "v_proj", "down_proj"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(adapter_config))

    request = {"prompt": ONE, "multi_modal_data": {"image": [images["tall"]]}}
    llm = small_llm(model_dir, enable_lora=True, max_lora_rank=rank)
    try:
        lora = LoRARequest("adapter", 1, str(tmp_path))
        base, adapted = answers(llm.generate([request, request], PARAMS, lora_request=[None, lora]))
    finally:
        llm.shutdown()
    base.assert_matches(hf_answer(hf_model(model_dir), model_dir, ONE, [images["tall"]]), "base")
    merged = hf_answer(hf, model_dir, ONE, [images["tall"]])
    adapted.assert_matches(merged, "adapter")
    assert adapted.tokens != base.tokens


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_tensor_parallel_ranks_with_images(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], images: dict[str, Any]
) -> None:
    """Rank 1 gets the features over the wire and runs the whole tower itself (the text
    model is sharded): HF's answers, SigLIP's tower too."""
    request = {"prompt": TWO, "multi_modal_data": {"image": [images["wide"], images["tall"]]}}
    got = two_rank_answers(model_dirs["siglip"], [request])
    expected = hf_answer(
        hf_models["siglip"], model_dirs["siglip"], TWO, [images["wide"], images["tall"]], "siglip"
    )
    got[0].assert_matches(expected, "two ranks")


# -- what is read and built -------------------------------------------------------------------


def test_the_image_side_is_read_in_every_layout(
    model_dirs: dict[str, Path],
    runners: dict[str, Runner],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Hub names (``vision_tower.vision_model.*``) and transformers 5's saved ones
    (``vision_tower.*``): everything but the layers not built, ``post_layernorm`` and
    SigLIP's pooling head is read. transformers 5's in-memory names (``model.vision_tower.*``,
    ``model.multi_modal_projector.*``, ``model.language_model.*``) load the same parameters."""
    for name, skipped in (
        (
            "clip",
            ("vision_tower.vision_model.encoder.layers.2.", "vision_tower.vision_model.post_"),
        ),
        ("clip_layers", ("vision_tower.post_",)),
        ("siglip", ("vision_tower.vision_model.post_", "vision_tower.vision_model.head.")),
    ):
        in_file = set(load_file(model_dirs[name] / "model.safetensors"))
        unused = {n for n in in_file if n.startswith(skipped)}
        assert unused
        read, _ = read_tensors(model_dirs[name], monkeypatch)
        assert read == in_file - unused, name

    def in_memory(name: str) -> str:
        for prefix, ours in (
            ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head."),
            ("vision_tower.vision_model.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        ):
            if name.startswith(prefix):
                return ours + name[len(prefix) :]
        raise AssertionError(name)

    source = model_dirs["clip"]
    renamed = tmp_path / "in_memory"
    renamed.mkdir()
    for path in source.iterdir():
        if path.name != "model.safetensors":
            (renamed / path.name).write_bytes(path.read_bytes())
    tensors = load_file(source / "model.safetensors")
    save_file({in_memory(n): t for n, t in tensors.items()}, renamed / "model.safetensors")
    reloaded = dict(Runner(renamed).model.named_parameters())
    params = dict(runners["clip"].model.named_parameters())
    assert reloaded.keys() == params.keys()
    for param_name, param in params.items():
        assert torch.equal(reloaded[param_name], param), param_name


def test_the_tower_runs_in_the_model_dtype(
    model_dirs: dict[str, Path], runners: dict[str, Runner], images: dict[str, Any]
) -> None:
    """A bfloat16 model's image rows are bfloat16, near the float32 model's."""
    inputs = hf_inputs(model_dirs["clip"], ONE, [images["tall"]])
    (feature,) = features_of(inputs)
    with torch.no_grad():
        rows = Runner(model_dirs["clip"], torch.bfloat16).model.embed_multimodal(
            "image", feature.tensors()
        )
        reference = runners["clip"].model.embed_multimodal("image", feature.tensors())
    assert rows.dtype == torch.bfloat16
    torch.testing.assert_close(rows.float(), reference, atol=3e-2, rtol=3e-2)


def test_classes_and_lora_scope(runners: dict[str, Runner]) -> None:
    """LLaVA-1.5 takes images on its Llama decoder; adapters never reach the image side."""
    from chassis.builtin_plugins.models.llama import LlamaForCausalLM

    model = runners["clip"].model
    assert isinstance(model, LlavaForConditionalGenerationWithImages)
    assert isinstance(model, LlamaForCausalLM)
    assert type(model).supported_modalities == {"image"}
    modules = dict(model.named_modules())
    q_proj = "vision_tower.encoder.layers.0.self_attn.q_proj"
    assert model.lora_slices(q_proj, modules[q_proj]) == []
    linear = "multi_modal_projector.linear_1"
    assert model.lora_slices(linear, modules[linear]) == []
    assert model.lora_slices(
        "model.layers.0.self_attn.qkv_proj", modules["model.layers.0.self_attn.qkv_proj"]
    )


# -- refusals ---------------------------------------------------------------------------------


def test_other_towers_are_served_as_text_only() -> None:
    """A LLaVA config whose tower is neither CLIP's nor SigLIP's gets the text-only class
    (whose requests with images the front-end refuses); its text keeps working."""
    import transformers as tf

    config = tiny_config("clip")
    config.vision_config = tf.Dinov2Config(hidden_size=32, num_hidden_layers=1)
    config.architectures = ["LlavaForConditionalGeneration"]
    cls = model_class(language_model_config(config))
    assert issubclass(cls, LlavaForConditionalGeneration)
    assert not issubclass(cls, LlavaForConditionalGenerationWithImages)
    assert not cls.supported_modalities


def test_llava_next_without_image_processor_refuses_images(tmp_path: Path) -> None:
    """LLaVA-NeXT takes images (tests/test_llava_next_images.py), but a checkpoint without
    its image processor config refuses them with a clear ValueError; its text is served."""
    import shutil

    import transformers as tf

    from chassis import LLM
    from chassis.core.gguf_checkpoint import embedded_model_dir

    text = tiny_config("clip").text_config.to_dict()
    config = tf.LlavaNextConfig(
        text_config=text,
        vision_config=tiny_config("clip").vision_config.to_dict(),
        image_token_index=IMAGE_TOKEN_ID,
        image_grid_pinpoints=[[56, 56]],
    )
    torch.manual_seed(0)
    tf.LlavaNextForConditionalGeneration(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / name, tmp_path / name)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, num_kv_blocks=32)
    try:
        with pytest.raises(ValueError, match=r"no preprocessor_config\.json"):
            llm.generate(
                {"prompt": "Hi <image>", "multi_modal_data": {"image": random_image(56, 56)}}
            )
        [out] = llm.generate("Hi there", SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


def test_bad_inputs_are_clear_errors(
    model_dirs: dict[str, Path], runners: dict[str, Runner], tmp_path: Path
) -> None:
    model = runners["clip"].model
    pixels = torch.zeros(1, 3, 56, 56)
    with pytest.raises(ValueError, match="takes images, not 'video'"):
        model.embed_multimodal("video", {"pixel_values": pixels})
    with pytest.raises(ValueError, match="lack pixel_values"):
        model.embed_multimodal("image", {})
    with pytest.raises(ValueError, match="one image"):
        model.embed_multimodal("image", {"pixel_values": torch.zeros(2, 3, 56, 56)})
    with pytest.raises(ValueError, match=r"\[images, channels, 56, 56\]"):
        model.embed_multimodal("image", {"pixel_values": torch.zeros(1, 3, 42, 56)})

    hf_config = runners["clip"].hf_config
    processor = LlavaImageInputs.from_pretrained(model_dirs["clip"], hf_config)
    with pytest.raises(ValueError, match=r"PIL\.Image\.Image"):
        processor.process([IMAGE_TOKEN_ID], {"image": [np.zeros((56, 56, 3))]})
    with pytest.raises(ValueError, match="1 image placeholder"):
        processor.process([IMAGE_TOKEN_ID], {"image": [random_image(8, 8)] * 2})
    with pytest.raises(ValueError, match="aspect ratio is too extreme"):
        processor.process([IMAGE_TOKEN_ID], {"image": [random_image(1, 2_000_000)]})
    with pytest.raises(ValueError, match="mm_processor_kwargs are not supported"):
        processor.process([IMAGE_TOKEN_ID], {"image": [random_image(8, 8)]}, {"max_pixels": 9})

    # a preprocessor whose pixels are not the tower's square is refused when built
    for path in model_dirs["clip"].iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**config, "do_center_crop": False})
    )
    with pytest.raises(ValueError, match="images of varying sizes"):
        LlavaImageInputs.from_pretrained(tmp_path, hf_config)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**config, "crop_size": 42}))
    with pytest.raises(ValueError, match="makes 42x42 pixels"):
        LlavaImageInputs.from_pretrained(tmp_path, hf_config)
    (tmp_path / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match=r"no preprocessor_config\.json"):
        LlavaImageInputs.from_pretrained(tmp_path, hf_config)
