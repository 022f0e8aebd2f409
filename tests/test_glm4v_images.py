"""GLM-4.1V and GLM-4.5V with images against HF transformers on tiny random checkpoints.

tests/fixtures_glm4v.py writes each checkpoint (2 text layers, GLM-4.5V's second a mixture
of experts; a 2-block vision tower with a 4x4 learned position table that larger images
resample; GLM's image processor config). Checked here, float32: the tower's rows equal HF's
``get_image_features`` (one image, two of different sizes in one call); the front-end's
prompt expansion and pixels equal HF's processor's (its ``replace_image_token`` and image
processor; the whole ``Glm4vProcessor`` needs torchvision for its video side);
``mrope_positions`` equals HF's ``get_rope_index`` for 0, 1 and 2 images; GLM-4.1V's
sectioned M-RoPE with interleaved pairs equals HF's rotation; a prefill with images and
the decode step after it give HF's logits, and another image changes them; through ``LLM``
(both classes): greedy tokens and each token's logprob equal HF ``generate``'s for a batch
of one image, two images and text, with chunked prefill cutting through an image, and for
``LLM.chat`` with an ``image_url`` part; every checkpoint tensor is read; a bfloat16 tower;
bad inputs are clear errors.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_glm4v import IMAGE, PLACEHOLDER, hf_inputs, save_tiny_glm4v
from fixtures_qwen2_vl import random_image
from mm_hf_compare import (
    PARAMS,
    Answer,
    answers,
    arch_checkpoint_fixtures,
    hf_generate,
    image_url_chat,
    png_data_url,
    read_tensors,
)
from safetensors.torch import load_file
from test_models_parity import Runner
from test_multimodal_engine import generate, vl_llm
from test_qwen2_vl_images import (
    assert_logits_match,
    chassis_prefill_then_decode,
    features_of,
    hf_logits_with_images,
)

from chassis.core.layers.mrope import MRotaryEmbedding
from chassis.core.layers.rotary import rope_parameters
from chassis.core.tokenizer import load_tokenizer

ARCHS = ("glm4v", "glm4v_moe")
IMAGE_TOKEN_ID = 49156  # <|image|> in the tiny checkpoints' tokenizer
#: prompts with 0, 1 and 2 images and the images' (height, width) in pixels (patch 14,
#: merge 2: 56x84 is a 4x6 patch grid, 6 tokens; 112x112 is 8x8, 16 tokens)
PROMPTS = {
    0: ("<|im_start|>user\nNo picture here, just text.<|im_end|>\n", []),
    1: (
        f"<|im_start|>user\n{PLACEHOLDER}What is in it?<|im_end|>\n<|im_start|>assistant\n",
        [(56, 84)],
    ),
    2: (f"Compare {PLACEHOLDER} with {PLACEHOLDER} please.", [(112, 112), (84, 56)]),
}


model_dirs, hf_models, runners = arch_checkpoint_fixtures(save_tiny_glm4v, ARCHS)


def images_of(sizes: list[tuple[int, int]], seed: int = 0) -> list[Any]:
    return [random_image(h, w, seed + i) for i, (h, w) in enumerate(sizes)]


def chat_prompt(text: str, num_images: int, before: str = "") -> str:
    images = PLACEHOLDER * num_images
    return f"<|im_start|>user\n{before}{images}{text}<|im_end|>\n<|im_start|>assistant\n"


def hf_answer(model_dir: Path, prompt: str, images: list[Any], model: Any) -> Answer:
    """HF ``generate``'s greedy answer (float32; EOS ignored) with each token's logprob."""
    return hf_generate(model, hf_inputs(model_dir, prompt, images))


# -- the vision tower -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "sizes", [[(56, 56)], [(112, 112)], [(56, 84), (112, 84)]], ids=["56", "112", "two_images"]
)
def test_vision_tower_matches_get_image_features(
    model_dirs: dict[str, Path],
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    arch: str,
    sizes: list[tuple[int, int]],
) -> None:
    """Our tower's rows equal HF's ``get_image_features`` (1e-5): the 56-pixel image samples
    the position table at its own grid, the others resample it; one call per image
    (``embed_multimodal``, as the runner calls it) gives the same rows as one for all."""
    images = images_of(sizes, seed=len(sizes))
    inputs = hf_inputs(model_dirs[arch], " ".join([IMAGE] * len(images)), images)
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    with torch.no_grad():
        expected = torch.cat(hf_models[arch].model.get_image_features(pixels, grid).pooler_output)
        ours = runners[arch].model.visual(pixels, grid)
        per_image = [
            runners[arch].model.embed_multimodal("image", f.tensors())
            for f in features_of(inputs, IMAGE_TOKEN_ID)
        ]
    assert ours.shape == expected.shape == (int(grid.prod(-1).sum()) // 4, 64)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(per_image), expected, atol=1e-5, rtol=1e-5)


def test_the_position_table_is_resampled(
    model_dirs: dict[str, Path], runners: dict[str, Runner]
) -> None:
    """At the table's own grid (4x4 patches) the bicubic sample is the table itself; at
    8x8 it is not (so the interpolation is exercised, not skipped)."""
    from chassis.builtin_plugins.models.qwen2_vl_vision import patch_positions

    embeddings = runners["glm4v"].model.visual.embeddings
    table = embeddings.position_embedding.weight

    def added(side: int) -> tuple[torch.Tensor, torch.Tensor]:
        grid = [(1, side, side)]
        positions = patch_positions(grid, 2)
        with torch.no_grad():
            rows = embeddings(torch.zeros(side * side, table.shape[1]), positions, grid)
        return rows, positions

    rows, positions = added(4)
    at_table = table[positions[:, 0] * 4 + positions[:, 1]]
    torch.testing.assert_close(rows, at_table, atol=1e-5, rtol=1e-5)
    rows, positions = added(8)
    assert not torch.allclose(rows[:16], at_table, atol=1e-3)


# -- the front-end -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_images", [1, 2])
def test_prompt_expansion_and_pixels_match_hf_processor(
    model_dirs: dict[str, Path], runners: dict[str, Runner], num_images: int
) -> None:
    """The front-end expands each ``<|image|>`` as HF's ``Glm4vProcessor.replace_image_token``
    does (``t*h*w / 4`` tokens between ``<|begin_of_image|>`` and ``<|end_of_image|>``), and
    its pixels and grids are HF's image processor's, exactly."""
    import transformers as tf

    model_dir = model_dirs["glm4v"]
    prompt, sizes = PROMPTS[num_images]
    images = images_of(sizes, seed=3)
    model = runners["glm4v"].model
    processor = type(model).multimodal_processor(str(model_dir), runners["glm4v"].hf_config)
    assert processor.prompt_placeholder("image") == PLACEHOLDER
    tokenizer = load_tokenizer(model_dir)
    ids, features = processor.process(tokenizer(prompt).input_ids, {"image": images})

    image_processor = tf.AutoImageProcessor.from_pretrained(model_dir)
    hf_images = image_processor(images=images, return_tensors="pt")
    hf_processor = SimpleNamespace(image_processor=image_processor, image_token=IMAGE)
    pieces = prompt.split(IMAGE)
    expanded = pieces[0] + "".join(
        tf.Glm4vProcessor.replace_image_token(hf_processor, hf_images, i) + rest
        for i, rest in enumerate(pieces[1:])
    )
    assert ids == tokenizer(expanded).input_ids
    first_patch = 0
    for feature, grid in zip(features, hf_images["image_grid_thw"], strict=True):
        patches = int(grid.prod())
        tensors = feature.tensors()
        assert torch.equal(tensors["image_grid_thw"].view(3), grid)
        assert torch.equal(
            tensors["pixel_values"], hf_images["pixel_values"][first_patch : first_patch + patches]
        )
        assert ids[feature.offset : feature.end] == [IMAGE_TOKEN_ID] * feature.length
        assert feature.length == patches // 4
        first_patch += patches


# -- M-RoPE ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_mrope_positions_match_get_rope_index(
    model_dirs: dict[str, Path],
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    arch: str,
    num_images: int,
) -> None:
    prompt, sizes = PROMPTS[num_images]
    inputs = hf_inputs(model_dirs[arch], prompt, images_of(sizes))
    ids = inputs["input_ids"]
    expected, expected_delta = hf_models[arch].model.get_rope_index(
        ids,
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
    )
    positions, delta = runners[arch].model.mrope_positions(
        ids[0].tolist(), features_of(inputs, IMAGE_TOKEN_ID)
    )
    assert positions.dtype == np.int64 and positions.shape == (3, ids.shape[1])
    np.testing.assert_array_equal(positions, expected[:, 0].numpy())
    assert delta == int(expected_delta)
    if num_images:
        assert delta < 0 and not (positions[0] == positions[1]).all()


def test_interleaved_sectioned_mrope_matches_transformers() -> None:
    """GLM-4.1V's rotation of ``[3, T]`` positions (sections of frequencies, each duplicated
    in place, pairs ``(2i, 2i + 1)`` rotated, half the head) equals HF's rotary module and
    ``apply_rotary_pos_emb``; equal components as the 1-D path, exactly."""
    import transformers as tf
    from transformers.models.glm4v import modeling_glm4v as hf_mod

    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [8, 12, 12],
        "partial_rotary_factor": 0.5,
    }
    config = tf.Glm4vTextConfig(
        hidden_size=512, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope
    )
    params = {**rope_parameters(config), "interleaved": True}
    ours = MRotaryEmbedding(128, 4096, params)
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 128), torch.randn(7, 2, 128)
    positions = torch.tensor(
        [[0, 5, 5, 5, 9, 10, 4000], [0, 5, 6, 6, 9, 10, 4000], [0, 5, 5, 6, 9, 10, 4000]]
    )
    cos, sin = hf_mod.Glm4vTextRotaryEmbedding(config)(q, positions.view(3, 1, -1))
    hf_q, hf_k = hf_mod.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    our_q, our_k = ours(positions, q.clone(), k.clone())
    torch.testing.assert_close(our_q, hf_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(our_k, hf_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    three_q, three_k = ours(positions[0].expand(3, -1), q.clone(), k.clone())
    one_q, one_k = ours(positions[0], q.clone(), k.clone())
    assert torch.equal(three_q, one_q) and torch.equal(three_k, one_k)


# -- logits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_with_images_match_transformers(
    model_dirs: dict[str, Path],
    hf_models: dict[str, Any],
    runners: dict[str, Runner],
    arch: str,
    num_images: int,
) -> None:
    """Prefill (positions ``[3, P]``, image rows in place) and the decode step after it
    (position ``P + delta``) give HF's logits (1e-4)."""
    prompt, sizes = PROMPTS[num_images]
    inputs = hf_inputs(model_dirs[arch], prompt, images_of(sizes))
    hf = hf_models[arch]
    assert_logits_match(runners[arch], hf, inputs, IMAGE_TOKEN_ID)


def test_an_image_changes_the_logits(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], runners: dict[str, Runner]
) -> None:
    """Another image of the same size (same tokens and positions) gives other logits after
    it, HF's for that image: the rows are used."""
    prompt, sizes = PROMPTS[1]
    logits = []
    for seed in (0, 10):
        inputs = hf_inputs(model_dirs["glm4v"], prompt, images_of(sizes, seed))
        ours, _, _ = chassis_prefill_then_decode(runners["glm4v"], inputs, IMAGE_TOKEN_ID)
        expected = hf_logits_with_images(hf_models["glm4v"], inputs)
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
        logits.append(ours)
    end = features_of(inputs, IMAGE_TOKEN_ID)[0].end
    assert (logits[0][end:] - logits[1][end:]).abs().max() > 1e-2


# -- through the engine -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_images_match_hf_through_llm(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], arch: str
) -> None:
    """One image, two images, and a text prompt in one ``LLM.generate`` batch: HF
    ``generate``'s greedy tokens and their logprobs (1e-4) each."""
    model_dir = model_dirs[arch]
    cases = {
        "one": (chat_prompt("Describe it.", 1), images_of([(112, 112)], seed=1)),
        "two": (chat_prompt("Compare them.", 2), images_of([(56, 84), (84, 56)], seed=2)),
        "text": (chat_prompt("Tell me a story.", 0), []),
    }
    llm = vl_llm(model_dir)
    try:
        got = generate(llm, list(cases.values()))
    finally:
        llm.shutdown()
    for (name, (prompt, case_images)), result in zip(cases.items(), got, strict=True):
        expected = hf_answer(model_dir, prompt, case_images, hf_models[arch])
        result.answer.assert_matches(expected, name)


def test_chunked_prefill_through_an_image(
    model_dirs: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    """Steps of 8 tokens cut the 16-token image in three: HF's answer, as unchunked; the
    image is encoded once."""
    model_dir = model_dirs["glm4v"]
    prompt = chat_prompt("What is in this picture?", 1, before="Look here:")
    images = images_of([(112, 112)], seed=5)
    llm = vl_llm(model_dir, block_size=4, max_num_batched_tokens=8)
    runner = llm.engine.executor.worker.runner
    try:
        [chunked] = generate(llm, [(prompt, images)])
        assert runner.mm.num_encoder_runs == 1
    finally:
        llm.shutdown()
    image_start = chunked.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert image_start % 8 != 0 and chunked.prompt_token_ids.count(IMAGE_TOKEN_ID) == 16
    llm = vl_llm(model_dir)
    try:
        [whole] = generate(llm, [(prompt, images)])
    finally:
        llm.shutdown()
    assert chunked.answer.tokens == whole.answer.tokens
    np.testing.assert_allclose(chunked.answer.logprobs, whole.answer.logprobs, atol=1e-5)
    chunked.answer.assert_matches(
        hf_answer(model_dir, prompt, images, hf_models["glm4v"]), "chunked"
    )


def test_chat_with_an_image_url_part(
    model_dirs: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    """``LLM.chat`` with an ``image_url`` part (a PNG data URL): the chat template's prompt
    (GLM's image placeholder), HF's answer."""
    model_dir = model_dirs["glm4v_moe"]
    [image] = images_of([(84, 56)], seed=7)
    llm = vl_llm(model_dir)
    try:
        [output] = llm.chat(image_url_chat(png_data_url(image), "Hm?"), PARAMS)
    finally:
        llm.shutdown()
    prompt = chat_prompt("Hm?", 1)
    assert output.prompt == prompt
    expected = hf_answer(model_dir, prompt, [image], hf_models["glm4v_moe"])
    [chatted] = answers([output])
    chatted.assert_matches(expected, "chat")


# -- weights and bad input ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_every_checkpoint_tensor_is_read(
    model_dirs: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = model_dirs[arch]
    tensors = set(load_file(model_dir / "model.safetensors"))
    assert any(name.startswith("model.visual.") for name in tensors)
    read, _ = read_tensors(model_dir, monkeypatch)
    assert read == tensors


def test_bad_image_inputs_are_clear_errors(
    model_dirs: dict[str, Path], runners: dict[str, Runner]
) -> None:
    model = runners["glm4v"].model
    inputs = hf_inputs(model_dirs["glm4v"], IMAGE, images_of([(56, 56)]))
    (feature,) = features_of(inputs, IMAGE_TOKEN_ID)
    tensors = feature.tensors()
    with pytest.raises(ValueError, match="takes images and videos, not 'audio'"):
        model.embed_multimodal("audio", tensors)
    with pytest.raises(ValueError, match="video inputs lack pixel_values_videos"):
        model.embed_multimodal("video", tensors)
    with pytest.raises(ValueError, match="lack image_grid_thw"):
        model.embed_multimodal("image", {"pixel_values": tensors["pixel_values"]})
    with pytest.raises(ValueError, match="pixel_values has 15 patches"):
        model.embed_multimodal("image", {**tensors, "pixel_values": tensors["pixel_values"][1:]})
    with pytest.raises(ValueError, match=r"must be \[patches, 1176\]"):
        model.embed_multimodal("image", {**tensors, "pixel_values": tensors["pixel_values"][:, 1:]})
    processor = type(model).multimodal_processor(
        str(model_dirs["glm4v"]), runners["glm4v"].hf_config
    )
    with pytest.raises(ValueError, match="placeholder"):
        processor.process([1, 2, 3], {"image": images_of([(56, 56)])})


def test_the_tower_runs_in_the_model_dtype(
    model_dirs: dict[str, Path], runners: dict[str, Runner]
) -> None:
    """A bfloat16 model's image rows are bfloat16, near the float32 model's."""
    model_dir = model_dirs["glm4v"]
    inputs = hf_inputs(model_dir, IMAGE, images_of([(112, 84)]))
    (feature,) = features_of(inputs, IMAGE_TOKEN_ID)
    with torch.no_grad():
        rows = Runner(model_dir, torch.bfloat16).model.embed_multimodal("image", feature.tensors())
        reference = runners["glm4v"].model.embed_multimodal("image", feature.tensors())
    assert rows.dtype == torch.bfloat16
    torch.testing.assert_close(rows.float(), reference, atol=2e-3, rtol=5e-2)
