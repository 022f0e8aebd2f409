"""Gemma 3 (``Gemma3ForConditionalGeneration``) with images against HF transformers on a tiny
random checkpoint (tests/fixtures_gemma3.py: 2 text layers, one sliding with a window of 5;
SigLIP of 2 layers at 56 pixels, 16 image tokens).

Checked, float32: the tower and projector rows against HF's ``get_image_features`` (1e-5);
the expanded prompt and pixels against ``Gemma3Processor``'s (newline runs merged as its
tokenizer merges them); prefill logits with one and two images against HF's forward with
``token_type_ids`` (1e-4), and that they differ from a plain causal run (which is HF's
without ``token_type_ids``), so the bidirectional image attention is exercised; greedy tokens
and each token's logprob through ``LLM.generate`` against HF ``generate``, on ``cpu_paged``
and ``torch_paged``, and with a token budget whose naive chunk boundary falls inside an image
(the scheduler moves it to the image's start; the image's tokens are computed in one step);
the refusals (a block longer than ``--max-num-batched-tokens``, a backend without
``attend_limit``, pan-and-scan). The backends' ``attend_limit`` paths are checked against a
dense reference in tests/test_attend_limit.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_gemma3 import (
    BOI_ID,
    IMAGE_TOKEN_ID,
    TOKENS_PER_IMAGE,
    hf_inputs,
    hf_model,
    save_tiny_gemma3,
)
from fixtures_llava import random_image
from fixtures_models import allocate_block_tables, make_attention_metadata, new_kv_caches
from mm_hf_compare import Answer, answers, checkpoint_fixtures, hf_generate, small_llm
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.gemma3_images import Gemma3ForConditionalGenerationWithImages
from chassis.builtin_plugins.models.gemma3_processing import Gemma3ImageInputs
from chassis.core.attention import ForwardContext
from chassis.core.config import EngineConfig
from chassis.core.model_loader import build_model
from chassis.core.multimodal import MultiModalFeature, make_feature
from chassis.core.tokenizer import load_tokenizer

ONE = "<start_of_turn>user\n<start_of_image> What is in the picture?<end_of_turn>\n"
ONE += "<start_of_turn>model\n"
TWO = "<start_of_turn>user\nCompare<start_of_image><start_of_image> please<end_of_turn>\n"
TWO += "<start_of_turn>model\n"
TEXT = "<start_of_turn>user\nTell me a story.<end_of_turn>\n<start_of_turn>model\n"
NUM_TOKENS = 5
ATOL = 1e-4


model_dir, hf, runner = checkpoint_fixtures(save_tiny_gemma3, hf_model)


@pytest.fixture(scope="module")
def images() -> dict[str, Any]:
    return {
        "tall": random_image(90, 60, seed=1),
        "wide": random_image(40, 100, seed=2),
        "square": random_image(56, 56, seed=3),
    }


def features_of(inputs: dict[str, torch.Tensor]) -> list[MultiModalFeature]:
    """One feature per image of HF's ``inputs``, as the front-end makes them."""
    ids = inputs["input_ids"][0].tolist()
    starts = [i + 1 for i, t in enumerate(ids) if t == BOI_ID]
    assert all(ids[s] == IMAGE_TOKEN_ID for s in starts)
    return [
        make_feature("image", start, TOKENS_PER_IMAGE, {"pixel_values": image[None]})
        for start, image in zip(starts, inputs["pixel_values"], strict=True)
    ]


# -- the image side and the processor ---------------------------------------------------------


def test_tower_and_projector_match_get_image_features(
    model_dir: Path, hf: Any, runner: Runner, images: dict[str, Any]
) -> None:
    inputs = hf_inputs(model_dir, TWO, [images["tall"], images["wide"]])
    model = runner.model
    with torch.no_grad():
        expected = hf.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
        ours = model.image_features(inputs["pixel_values"])
        per_image = [model.embed_multimodal("image", f.tensors()) for f in features_of(inputs)]
    assert ours.shape == expected.shape == (2, TOKENS_PER_IMAGE, 64)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(per_image), expected, atol=1e-5, rtol=1e-5)


def test_prompts_and_pixels_match_gemma3_processor(
    model_dir: Path, runner: Runner, images: dict[str, Any]
) -> None:
    """``<start_of_image>`` becomes HF's framed image; ``"user\\n"`` before it and two
    adjacent images merge their newlines as HF's tokenizer does."""
    processor = Gemma3ImageInputs.from_pretrained(model_dir, runner.hf_config)
    tokenizer = load_tokenizer(model_dir)
    for prompt, pictures in ((ONE, [images["tall"]]), (TWO, [images["wide"], images["square"]])):
        expected = hf_inputs(model_dir, prompt, pictures)
        expanded, features = processor.process(tokenizer(prompt).input_ids, {"image": pictures})
        assert expanded == expected["input_ids"][0].tolist()
        types = np.zeros(len(expanded), dtype=np.int64)
        for feature, pixels in zip(features, expected["pixel_values"], strict=True):
            assert feature.length == TOKENS_PER_IMAGE
            types[feature.offset : feature.end] = 1
            torch.testing.assert_close(feature.tensors()["pixel_values"][0], pixels)
        assert types.tolist() == expected["token_type_ids"][0].tolist()


# -- logits -----------------------------------------------------------------------------------


def prefill(runner: Runner, inputs: dict[str, torch.Tensor], bidirectional: bool) -> torch.Tensor:
    """Our logits for the whole prompt in one step, image rows in place, with the image
    blocks' ``attend_limit`` (or plain causal attention)."""
    model = runner.model
    prompt = inputs["input_ids"][0]
    num_tokens = len(prompt)
    tables = allocate_block_tables([num_tokens], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
    kv = new_kv_caches(runner.hf_config, NUM_BLOCKS, BLOCK_SIZE)
    limit = torch.arange(num_tokens, dtype=torch.int32)
    with torch.no_grad():
        embeds = model.embed_input_ids(prompt)
        for feature in features_of(inputs):
            embeds[feature.offset : feature.end] = model.embed_multimodal(
                "image", feature.tensors()
            )
            limit[feature.offset : feature.end] = feature.end - 1
        meta = make_attention_metadata([num_tokens], [num_tokens], tables, BLOCK_SIZE)
        meta.attend_limit = limit if bidirectional else None
        hidden = model(prompt, torch.arange(num_tokens), ForwardContext(meta, kv), embeds)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("num_images", [1, 2])
def test_prefill_logits_match_transformers(
    model_dir: Path, hf: Any, runner: Runner, images: dict[str, Any], num_images: int
) -> None:
    prompt, pictures = (
        (ONE, [images["tall"]]) if num_images == 1 else (TWO, [images["wide"], images["square"]])
    )
    inputs = hf_inputs(model_dir, prompt, pictures)
    with torch.no_grad():
        expected = hf(**inputs).logits[0]
        hf_causal = hf(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]).logits[0]
    ours = prefill(runner, inputs, bidirectional=True)
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=ATOL)
    # the image blocks really attend both ways: a causal run is HF's without token_type_ids
    causal = prefill(runner, inputs, bidirectional=False)
    torch.testing.assert_close(causal, hf_causal, atol=ATOL, rtol=ATOL)
    first = features_of(inputs)[0].offset
    assert (causal[first:] - ours[first:]).abs().max() > 1e-2


# -- end to end through LLM -------------------------------------------------------------------


def hf_answer(hf: Any, model_dir: Path, prompt: str, pictures: list[Any]) -> Answer:
    """HF ``generate``'s greedy answer (EOS ignored; ``token_type_ids`` given) with each
    token's logprob."""
    return hf_generate(hf, hf_inputs(model_dir, prompt, pictures), NUM_TOKENS)


def answer_of(output: Any) -> Answer:
    assert output.outputs[0].error is None, output.outputs[0].error
    [answer] = answers([output])
    return answer


#: this file's answers are shorter than mm_hf_compare's
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)


def request(prompt: str, pictures: list[Any]) -> Any:
    return {"prompt": prompt, "multi_modal_data": {"image": pictures}} if pictures else prompt


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_paged"])
def test_generate_matches_hf(
    model_dir: Path, hf: Any, images: dict[str, Any], backend: str
) -> None:
    """One image, two images and text in one batch: HF's answers."""
    cases = {
        "one": (ONE, [images["tall"]]),
        "two": (TWO, [images["wide"], images["square"]]),
        "text": (TEXT, []),
    }
    llm = small_llm(model_dir, attention_backend=backend)
    try:
        outputs = llm.generate([request(p, pics) for p, pics in cases.values()], PARAMS)
    finally:
        llm.shutdown()
    for (what, (prompt, pictures)), output in zip(cases.items(), outputs, strict=True):
        answer_of(output).assert_matches(hf_answer(hf, model_dir, prompt, pictures), what)


def test_chunked_prefill_never_ends_inside_an_image(
    model_dir: Path, hf: Any, images: dict[str, Any]
) -> None:
    """A budget of 16 tokens: the first chunk would end inside the first image (its tokens
    are 4..19); it ends at the image's start instead, and each image is one step. HF's
    answers, cold and from the prefix cache (4-token blocks; the hit covers the images)."""
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=128,
        block_size=4,
        max_num_batched_tokens=16,
    )
    runner = llm.engine.executor.worker.runner
    steps: list[tuple[int, int]] = []  # (first position, tokens) of each prefill step
    original = runner.execute_model_async

    def spy(out: Any) -> Any:
        computed = {r.request_id: r.num_computed_tokens for r in out.new_requests}
        computed.update({r.request_id: r.num_computed_tokens for r in out.cached_requests})
        for request_id, count in out.num_scheduled_tokens.items():
            if count > 1:
                steps.append((computed[request_id], count))
        return original(out)

    runner.execute_model_async = spy
    pictures = [images["wide"], images["square"]]
    try:
        [cold] = llm.generate([request(TWO, pictures)], PARAMS)
        cold_steps = list(steps)
        [warm] = llm.generate([request(TWO, pictures)], PARAMS)
    finally:
        llm.shutdown()
    expected = hf_answer(hf, model_dir, TWO, pictures)
    answer_of(cold).assert_matches(expected, "chunked")
    answer_of(warm).assert_matches(expected, "prefix-cached")
    ids = hf_inputs(model_dir, TWO, pictures)["input_ids"][0].tolist()
    first = ids.index(IMAGE_TOKEN_ID)
    second = ids.index(IMAGE_TOKEN_ID, first + TOKENS_PER_IMAGE)
    assert cold_steps[:3] == [
        (0, first),
        (first, TOKENS_PER_IMAGE),
        (first + 16, second - first - 16),
    ]
    assert (second, TOKENS_PER_IMAGE) in cold_steps
    assert warm.num_cached_tokens > second + TOKENS_PER_IMAGE


# -- refusals ---------------------------------------------------------------------------------


def test_an_image_longer_than_the_token_budget_is_refused(
    model_dir: Path, images: dict[str, Any]
) -> None:
    """16 image tokens cannot be computed in steps of 8: the request fails alone, clearly;
    text requests are served."""
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        max_num_batched_tokens=8,
    )
    try:
        refused, served = llm.generate([request(ONE, [images["tall"]]), TEXT], PARAMS)
    finally:
        llm.shutdown()
    error = refused.outputs[0].error
    assert error is not None and error.client_error
    assert "--max-num-batched-tokens is 8" in error.message
    assert "16 placeholder tokens" in error.message
    assert len(served.outputs[0].token_ids) == NUM_TOKENS


def test_a_backend_without_attend_limit_is_refused(model_dir: Path, runner: Runner) -> None:
    class CausalOnly(TorchPagedAttention):
        supports_attend_limit = False

    config = EngineConfig(model=str(model_dir))
    with pytest.raises(ValueError, match="CausalOnly does not support attend_limit"):
        build_model(config, runner.hf_config, model_dir, CausalOnly, "cpu", torch.float32)


def test_classes_and_bad_inputs(model_dir: Path, runner: Runner) -> None:
    model = runner.model
    assert isinstance(model, Gemma3ForConditionalGenerationWithImages)
    assert type(model).bidirectional_image_blocks and type(model).supported_modalities == {"image"}
    modules = dict(model.named_modules())
    name = "vision_tower.encoder.encoder.layers.0.self_attn.q_proj"
    assert model.lora_slices(name, modules[name]) == []
    with pytest.raises(ValueError, match="takes images, not 'video'"):
        model.embed_multimodal("video", {"pixel_values": torch.zeros(1, 3, 56, 56)})
    with pytest.raises(ValueError, match=r"\[images, channels, 56, 56\]"):
        model.embed_multimodal("image", {"pixel_values": torch.zeros(1, 3, 28, 56)})
    processor = Gemma3ImageInputs.from_pretrained(model_dir, runner.hf_config)
    picture = [random_image(8, 8)]
    with pytest.raises(ValueError, match="do_pan_and_scan is not supported"):
        processor.process([BOI_ID], {"image": picture}, {"do_pan_and_scan": True})
    expanded, _ = processor.process([BOI_ID], {"image": picture}, {"do_pan_and_scan": False})
    assert expanded.count(IMAGE_TOKEN_ID) == TOKENS_PER_IMAGE
    with pytest.raises(ValueError, match="mm_processor_kwargs are not supported"):
        processor.process([BOI_ID], {"image": picture}, {"max_pixels": 9})
