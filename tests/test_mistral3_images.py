"""Mistral 3 (``Mistral3ForConditionalGeneration``) with images against HF transformers on
tiny random checkpoints (tests/fixtures_mistral3.py: Mistral text, 2 layers of hidden 64; a
2-layer Pixtral tower of patch 4, merge 2: one image token per 8x8 pixels, images of at most
48 pixels a side).

Checked, float32: the tower and projector rows against HF's ``get_image_features`` (two images
of different sizes in one call, and each through ``embed_multimodal``, whose break and end
rows are the token embeddings) to 1e-5; the expanded prompt (``[IMG]`` rows, ``[IMG_BREAK]``,
``[IMG_END]``) and the pixels against transformers' ``PixtralProcessor`` (PIL backend);
prefill and decode logits with one and two images against HF's forward to 1e-4 (also over
Ministral 3's text model with an earlier feature layer); greedy tokens and each token's
logprob through ``LLM.generate`` and ``LLM.chat`` against HF ``generate``, with chunked prefill
through an image; that another image changes the logits; which tensors are read in both
layouts; LoRA's scope; the text-only fallback and the errors for bad inputs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_mistral3 import (
    BREAK_TOKEN_ID,
    END_TOKEN_ID,
    IMAGE_TOKEN_ID,
    hf_inputs,
    hf_model,
    image_processor,
    random_image,
    save_tiny_mistral3,
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

from chassis.builtin_plugins.models.mistral3 import Mistral3ForConditionalGeneration
from chassis.builtin_plugins.models.mistral3_images import (
    Mistral3ForConditionalGenerationWithImages,
)
from chassis.builtin_plugins.models.mistral3_processing import (
    Mistral3ImageInputs,
    PixtralPreprocessing,
)
from chassis.core.model_loader import language_model_config, model_class
from chassis.core.multimodal import MultiModalFeature, make_feature

#: checkpoint name -> (text model, Mistral 3 config overrides)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("mistral", {}),
    # Ministral 3's query scaling, and the tower's first layer only (hidden state 1 of 2)
    "ministral3": ("ministral3", {"vision_feature_layer": -2}),
}
ONE = "[INST][IMG]What is in the picture?[/INST]"
TWO = "[INST]Compare [IMG] with [IMG] please.[/INST]"
TEXT = "[INST]Tell me a story.[/INST]"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: save_tiny_mistral3(tmp_path_factory.mktemp(name), text=text, **overrides)
        for name, (text, overrides) in CHECKPOINTS.items()
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
        "tall": random_image(90, 60, seed=1),  # scaled to 48x32: 6x4 tokens
        "wide": random_image(20, 44, seed=2),  # not scaled, rounded up to 24x48: 3x6
        "square": random_image(40, 40, seed=3),  # 5x5
        "other": random_image(90, 60, seed=4),
    }


def features_of(inputs: dict[str, torch.Tensor]) -> list[MultiModalFeature]:
    """One feature per image of HF's ``inputs`` (its token run, from the first ``[IMG]`` to
    its ``[IMG_END]``; its pixels without the batch padding), as the front-end makes them."""
    ids = inputs["input_ids"][0].tolist()
    features = []
    start = None
    sizes = inputs.get("image_sizes", torch.zeros(0, 2, dtype=torch.int64)).tolist()
    for i, token in enumerate(ids):
        if token == IMAGE_TOKEN_ID and start is None:
            start = i
        elif token == END_TOKEN_ID:
            assert start is not None
            height, width = sizes[len(features)]
            pixels = inputs["pixel_values"][len(features), :, :height, :width]
            run = torch.tensor(ids[start : i + 1])
            tensors = {"pixel_values": pixels[None], "placeholder_ids": run}
            features.append(make_feature("image", start, len(run), tensors))
            start = None
    assert len(features) == len(sizes)
    return features


# -- the image side ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tower_and_projector_match_get_image_features(
    model_dirs: dict[str, Path],
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    images: dict[str, Any],
    name: str,
) -> None:
    """Two images of different sizes in one HF call (padded, block-diagonal attention):
    HF's rows for each; through ``embed_multimodal`` (as the runner calls it) they sit at
    the ``[IMG]`` tokens, the break and end tokens' rows being their token embeddings."""
    inputs = hf_inputs(model_dirs[name], TWO, [images["tall"], images["wide"]])
    model = runners[name].model
    features = features_of(inputs)
    with torch.no_grad():
        expected = hf_models[name].get_image_features(
            pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"]
        )
        expected = list(expected.pooler_output)
        ours = model.image_features([f.tensors()["pixel_values"][0] for f in features])
        rows = [model.embed_multimodal("image", f.tensors()) for f in features]
    assert [tuple(e.shape) for e in expected] == [(24, 64), (18, 64)]
    for got, want, feature, run_rows in zip(ours, expected, features, rows, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        run = feature.tensors()["placeholder_ids"]
        assert run_rows.shape == (feature.length, 64)
        torch.testing.assert_close(run_rows[run == IMAGE_TOKEN_ID], want, atol=1e-5, rtol=1e-5)
        text = run != IMAGE_TOKEN_ID
        assert torch.equal(run_rows[text], model.embed_input_ids(run[text]))


def test_only_the_layers_needed_are_built(runners: dict[str, Runner]) -> None:
    """-1 runs both tower layers; -2 (hidden state 1) only the first."""
    built = {name: len(r.model.vision_tower.transformer.layers) for name, r in runners.items()}
    assert built == {"mistral": 2, "ministral3": 1}


# -- the processor ----------------------------------------------------------------------------


def test_prompts_expand_as_pixtral_processor(
    model_dirs: dict[str, Path], runners: dict[str, Runner], images: dict[str, Any]
) -> None:
    """One ``[IMG]`` per image becomes its rows of ``[IMG]`` tokens, each row closed by
    ``[IMG_BREAK]`` and the last by ``[IMG_END]``, where HF's processor puts them, with HF's
    pixels; each feature covers its image's whole run."""
    from chassis.core.tokenizer import load_tokenizer

    pictures = [images["tall"], images["wide"]]
    expected = hf_inputs(model_dirs["mistral"], TWO, pictures)
    processor = Mistral3ImageInputs.from_pretrained(
        model_dirs["mistral"], runners["mistral"].hf_config
    )
    assert (processor.image_token_id, processor.break_token_id, processor.end_token_id) == (
        IMAGE_TOKEN_ID,
        BREAK_TOKEN_ID,
        END_TOKEN_ID,
    )
    ids = load_tokenizer(model_dirs["mistral"])(TWO).input_ids
    assert ids.count(IMAGE_TOKEN_ID) == 2
    expanded, features = processor.process(ids, {"image": pictures})
    assert expanded == expected["input_ids"][0].tolist()
    assert [f.length for f in features] == [6 * 5, 3 * 7]
    sizes = expected["image_sizes"].tolist()
    for feature, pixels, (height, width) in zip(
        features, expected["pixel_values"], sizes, strict=True
    ):
        assert expanded[feature.offset] == IMAGE_TOKEN_ID
        assert expanded[feature.end - 1] == END_TOKEN_ID
        assert (
            feature.tensors()["placeholder_ids"].tolist() == expanded[feature.offset : feature.end]
        )
        torch.testing.assert_close(feature.tensors()["pixel_values"][0], pixels[:, :height, :width])


def test_pixels_match_transformers_image_processor() -> None:
    """Our PIL/numpy preprocessing gives transformers' Pixtral pixels (its PIL backend, patch
    8 as ``PixtralProcessor`` passes it) for portrait, landscape, small, thin and transparent
    images, and a ``height`` x ``width`` size."""
    import transformers as tf
    from PIL import Image

    rgba = Image.fromarray(np.random.default_rng(7).integers(0, 256, (30, 70, 4), dtype=np.uint8))
    samples = [random_image(90, 60, 1), random_image(40, 100, 2), random_image(13, 21, 5)]
    samples += [random_image(6, 200, 6), rgba]
    for hf in (
        image_processor(),
        tf.PixtralImageProcessorPil(size={"height": 40, "width": 64}),
    ):
        ours = PixtralPreprocessing.from_dict(json.loads(hf.to_json_string()), 8)
        for image in samples:
            expected = hf(images=[image], patch_size=8, return_tensors="np")["pixel_values"][0]
            got = ours(image)
            assert got.dtype == np.float32 and got.shape == expected.shape, image.size
            np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0, err_msg=str(image.size))


# -- logits -----------------------------------------------------------------------------------


def mistral_prefill_then_decode(
    runner: Runner, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`prefill_then_decode` on HF's ``inputs``, each image's run in place."""
    return prefill_then_decode(runner, inputs["input_ids"][0].tolist(), features_of(inputs))


@pytest.mark.parametrize(
    ("name", "num_images"), [("mistral", 1), ("mistral", 2), ("ministral3", 2)]
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
    inputs = hf_inputs(model_dirs[name], prompt, pictures)
    assert_prefill_and_decode_match(runners[name], hf_models[name], inputs, features_of(inputs))


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
        inputs = hf_inputs(model_dirs["mistral"], ONE, [picture])
        ours, _, _ = mistral_prefill_then_decode(runners["mistral"], inputs)
        torch.testing.assert_close(
            ours, hf_logits(hf_models["mistral"], inputs), atol=ATOL, rtol=ATOL
        )
        logits.append(ours)
    (feature,) = features_of(inputs)
    assert (logits[0][feature.offset :] - logits[1][feature.offset :]).abs().max() > 1e-2


# -- end to end through LLM -------------------------------------------------------------------


def hf_answer(hf: Any, model_dir: Path, prompt: str, pictures: list[Any]) -> Answer:
    """HF ``generate``'s greedy answer (EOS ignored) with each token's logprob."""
    return hf_generate(hf, hf_inputs(model_dir, prompt, pictures))


def test_generate_and_chat_match_hf(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], images: dict[str, Any]
) -> None:
    """One image, two images and text in one batch; then steps of 16 tokens cutting through
    an image's run (4-token blocks) and the same image again from the prefix cache; then
    ``LLM.chat`` with an image part. Every answer is HF's."""
    model_dir, hf = model_dirs["mistral"], hf_models["mistral"]
    cases = {
        "one": (ONE, [images["tall"]]),
        "two": (TWO, [images["wide"], images["square"]]),
        "text": (TEXT, []),
    }
    prompts = media_prompts(cases.values())
    expected_tokens = [hf_answer(hf, model_dir, p, pics) for p, pics in cases.values()]
    llm = small_llm(model_dir, **CHUNKED)
    runner = llm.engine.executor.worker.runner
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": images["tall"]},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ]
    request = {"prompt": ONE, "multi_modal_data": {"image": [images["tall"]]}}
    try:
        batch = answers(llm.generate(prompts, PARAMS))
        runs = runner.mm.num_encoder_runs
        [(warm, warm_cached)] = answers_and_cached(llm.generate([request], PARAMS))
        assert runner.mm.num_encoder_runs == runs  # the cached image needed no encoding
        [chatted] = answers(llm.chat(chat, PARAMS))
    finally:
        llm.shutdown()
    # each image once, though the 30-token run of the first took several 16-token steps
    assert runs == 3
    for (what, _), answer, expected in zip(cases.items(), batch, expected_tokens, strict=True):
        answer.assert_matches(expected, what)
    warm.assert_matches(expected_tokens[0], "prefix-cached")
    assert warm_cached >= 30
    chatted.assert_matches(expected_tokens[0], "chat")


def test_lora_adapter_with_images(
    model_dirs: dict[str, Path], images: dict[str, Any], tmp_path: Path
) -> None:
    """An adapter on the language model, named as trained on transformers 5's Mistral 3
    (``model.language_model.layers.*``), with an image: HF's answer with the adapter merged
    into its weights; the base model's beside it in the same batch."""
    from chassis.core.lora.request import LoRARequest

    model_dir = model_dirs["mistral"]
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
    adapted.assert_matches(hf_answer(hf, model_dir, ONE, [images["tall"]]), "adapter")
    assert adapted.tokens != base.tokens


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_tensor_parallel_ranks_with_images(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], images: dict[str, Any]
) -> None:
    """Rank 1 gets the features over the wire and runs the whole tower itself (the text
    model, Ministral 3's, is sharded): HF's answer."""
    pictures = [images["wide"], images["tall"]]
    request = {"prompt": TWO, "multi_modal_data": {"image": pictures}}
    [got] = two_rank_answers(model_dirs["ministral3"], [request])
    expected = hf_answer(hf_models["ministral3"], model_dirs["ministral3"], TWO, pictures)
    got.assert_matches(expected, "two ranks")


# -- weights, classes ------------------------------------------------------------------------


def test_the_image_side_is_read_in_both_layouts(
    model_dirs: dict[str, Path],
    runners: dict[str, Runner],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The saved names (``vision_tower.*``, ``multi_modal_projector.*``): every tensor is
    read but the tower layers not built. transformers 5's in-memory names
    (``model.vision_tower.*``, ``model.multi_modal_projector.*``,
    ``model.language_model.*``) load the same parameters."""
    for name, skipped in (("mistral", ()), ("ministral3", ("vision_tower.transformer.layers.1.",))):
        in_file = set(load_file(model_dirs[name] / "model.safetensors"))
        unused = {n for n in in_file if skipped and n.startswith(skipped)}
        assert bool(unused) is bool(skipped)
        read, _ = read_tensors(model_dirs[name], monkeypatch)
        assert read == in_file - unused, name

    def in_memory(name: str) -> str:
        for prefix, ours in (
            ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head."),
            ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        ):
            if name.startswith(prefix):
                return ours + name[len(prefix) :]
        raise AssertionError(name)

    source = model_dirs["mistral"]
    renamed = tmp_path / "in_memory"
    renamed.mkdir()
    for path in source.iterdir():
        if path.name != "model.safetensors":
            (renamed / path.name).write_bytes(path.read_bytes())
    tensors = load_file(source / "model.safetensors")
    save_file({in_memory(n): t for n, t in tensors.items()}, renamed / "model.safetensors")
    reloaded = dict(Runner(renamed).model.named_parameters())
    params = dict(runners["mistral"].model.named_parameters())
    assert reloaded.keys() == params.keys()
    for param_name, param in params.items():
        assert torch.equal(reloaded[param_name], param), param_name


def test_the_tower_runs_in_the_model_dtype(
    model_dirs: dict[str, Path], runners: dict[str, Runner], images: dict[str, Any]
) -> None:
    """A bfloat16 model's rows are bfloat16, near the float32 model's."""
    inputs = hf_inputs(model_dirs["mistral"], ONE, [images["tall"]])
    (feature,) = features_of(inputs)
    with torch.no_grad():
        rows = Runner(model_dirs["mistral"], torch.bfloat16).model.embed_multimodal(
            "image", feature.tensors()
        )
        reference = runners["mistral"].model.embed_multimodal("image", feature.tensors())
    assert rows.dtype == torch.bfloat16
    torch.testing.assert_close(rows.float(), reference, atol=5e-2, rtol=5e-2)


def test_classes_and_lora_scope(runners: dict[str, Runner]) -> None:
    """Mistral 3 takes images on its Mistral / Ministral 3 decoder; adapters never reach the
    image side."""
    from chassis.builtin_plugins.models.ministral3 import Llama4ScaledAttention

    model = runners["mistral"].model
    assert isinstance(model, Mistral3ForConditionalGenerationWithImages)
    assert type(model).supported_modalities == {"image"}
    ministral = runners["ministral3"].model
    assert isinstance(ministral.model.layers[0].self_attn, Llama4ScaledAttention)
    modules = dict(model.named_modules())
    for name in (
        "vision_tower.transformer.layers.0.attention.q_proj",
        "multi_modal_projector.linear_1",
        "multi_modal_projector.patch_merger.merging_layer",
    ):
        assert model.lora_slices(name, modules[name]) == []
    assert model.lora_slices(
        "model.layers.0.self_attn.qkv_proj", modules["model.layers.0.self_attn.qkv_proj"]
    )


def test_unsupported_image_sides_are_served_as_text_only() -> None:
    """A list of feature layers (HF's projector cannot run one either) or another tower: the
    text-only class, which takes no images."""
    import transformers as tf

    for config in (tiny_config(vision_feature_layer=[-2, -1]), tiny_config()):
        config.architectures = ["Mistral3ForConditionalGeneration"]
        if not isinstance(config.vision_feature_layer, list):
            config.vision_config = tf.SiglipVisionConfig(hidden_size=32, num_hidden_layers=1)
        cls = model_class(language_model_config(config))
        assert cls is Mistral3ForConditionalGeneration
        assert not cls.supported_modalities
    config = tiny_config()
    config.architectures = ["Mistral3ForConditionalGeneration"]
    assert model_class(language_model_config(config)) is Mistral3ForConditionalGenerationWithImages


# -- refusals ---------------------------------------------------------------------------------


def test_bad_inputs_are_clear_errors(
    model_dirs: dict[str, Path], runners: dict[str, Runner], tmp_path: Path
) -> None:
    model = runners["mistral"].model
    pixels = torch.zeros(1, 3, 16, 16)
    run = torch.tensor([IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, BREAK_TOKEN_ID] * 2)
    run[-1] = END_TOKEN_ID
    with torch.no_grad():
        assert model.embed_multimodal(
            "image", {"pixel_values": pixels, "placeholder_ids": run}
        ).shape == (6, 64)
        with pytest.raises(ValueError, match="takes images, not 'video'"):
            model.embed_multimodal("video", {"pixel_values": pixels, "placeholder_ids": run})
        with pytest.raises(ValueError, match="need pixel_values and placeholder_ids"):
            model.embed_multimodal("image", {"pixel_values": pixels})
        with pytest.raises(ValueError, match="one image"):
            model.embed_multimodal(
                "image", {"pixel_values": torch.zeros(2, 3, 16, 16), "placeholder_ids": run}
            )
        with pytest.raises(ValueError, match="multiples of 8"):
            model.embed_multimodal(
                "image", {"pixel_values": torch.zeros(1, 3, 12, 16), "placeholder_ids": run}
            )
        with pytest.raises(ValueError, match="gives 6 rows, but its placeholder run holds 4"):
            model.embed_multimodal(
                "image", {"pixel_values": torch.zeros(1, 3, 16, 24), "placeholder_ids": run}
            )

    hf_config = runners["mistral"].hf_config
    processor = Mistral3ImageInputs.from_pretrained(model_dirs["mistral"], hf_config)
    with pytest.raises(ValueError, match=r"PIL\.Image\.Image"):
        processor.process([IMAGE_TOKEN_ID], {"image": [np.zeros((16, 16, 3))]})
    with pytest.raises(ValueError, match="1 image placeholder"):
        processor.process([IMAGE_TOKEN_ID], {"image": [random_image(8, 8)] * 2})
    with pytest.raises(ValueError, match="aspect ratio is too extreme"):
        processor.process([IMAGE_TOKEN_ID], {"image": [random_image(1, 500)]})
    with pytest.raises(ValueError, match="mm_processor_kwargs are not supported"):
        processor.process([IMAGE_TOKEN_ID], {"image": [random_image(8, 8)]}, {"max_pixels": 9})

    # a checkpoint without the image processor config, or whose tokenizer lacks the tokens
    for path in model_dirs["mistral"].iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_end_token": "[NOPE]"}))
    with pytest.raises(ValueError, match=r"no '\[NOPE\]' token"):
        Mistral3ImageInputs.from_pretrained(tmp_path, hf_config)
    config = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**config, "do_center_crop": True})
    )
    with pytest.raises(ValueError, match="do_center_crop is not supported"):
        Mistral3ImageInputs.from_pretrained(tmp_path, hf_config)
    (tmp_path / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match=r"no preprocessor_config\.json"):
        Mistral3ImageInputs.from_pretrained(tmp_path, hf_config)
