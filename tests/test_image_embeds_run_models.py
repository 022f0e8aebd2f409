"""Image embeddings (``--enable-mm-embeds``) for Aya Vision and Gemma 3 on tiny random
float32 checkpoints (tests/fixtures_aya_vision.py, fixtures_gemma3.py; Qwen3-VL:
tests/test_image_embeds_qwen3_vl.py).

Checked per model, through ``LLM``: the rows the model's own tower and projector give for an
image answer as the image itself (greedy tokens, each token's logprob to 1e-4) without
running the tower; wrong shapes are ``ValueError``s saying what is wrong; an engine without
the flag refuses them naming it. Aya Vision: the run written from the rows' tile count (a
multi-tile image), chunks cutting through the run, the prefix cache keyed by the rows.
Gemma 3: ``mm_tokens_per_image`` rows only. Mistral 3 and Idefics3 refuse embeddings with
their reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_llava import random_image
from mm_hf_compare import PARAMS, Answer, answers, answers_and_cached

from chassis import LLM

ENGINE: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 256}


def run_answers(llm: LLM, requests: list[dict[str, Any]]) -> list[Answer]:
    return answers(llm.generate(requests, PARAMS))


def refused(llm: LLM, prompt: str, data: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": data}}, PARAMS)


def tower_inputs(llm: LLM, image: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """The engine's model and the processor's tensors of ``image``, on the model's device."""
    processor = llm.input_processor.multimodal.processor()
    runner = llm.engine.executor.worker.runner
    _, tensors = processor.process_item("image", image, {})
    return runner, {name: t.to(runner.mm.device) for name, t in tensors.items()}


def test_aya_vision_tile_rows(tmp_path: Path) -> None:
    """A 3-tile image (2 grid tiles and the thumbnail) and a 1-tile one: their tiles' rows
    answer as the images, the tower runs only for the images, the rows again hit the prefix
    cache through the run; in 8-token chunks too. Bad counts and widths are refused."""
    from fixtures_aya_vision import TOKENS_PER_TILE, save_tiny_aya_vision

    model_dir = save_tiny_aya_vision(tmp_path / "aya")
    prompt = "<|im_start|>user\n<|IMG_PATCH|>What is this?<|im_end|>\n<|im_start|>assistant\n"
    wide, square = random_image(60, 130, seed=1), random_image(56, 56, seed=2)
    llm = LLM(str(model_dir), **ENGINE, block_size=4, enable_mm_embeds=True)
    try:
        runner, inputs = tower_inputs(llm, wide)
        with torch.no_grad():
            tiles = runner.model.image_features(inputs["pixel_values"])
        assert tiles.shape == (3, TOKENS_PER_TILE, 64)
        wide_rows = tiles.reshape(-1, 64).cpu()
        _, inputs = tower_inputs(llm, square)
        with torch.no_grad():
            square_rows = runner.model.image_features(inputs["pixel_values"]).reshape(-1, 64)
        square_rows = square_rows.cpu()

        def run(data: Any) -> tuple[Answer, int]:
            request = {"prompt": prompt, "multi_modal_data": {"image": data}}
            [(answer, cached)] = answers_and_cached(llm.generate([request], PARAMS))
            return answer, cached

        with_wide, _ = run(wide)
        with_square, _ = run(square)
        encoded = runner.mm.num_encoder_runs
        rows_wide, first_cached = run(wide_rows)
        rows_again, again_cached = run(wide_rows.clone())
        _, other_cached = run(wide_rows * 1.01)
        rows_square, _ = run(square_rows)
        assert runner.mm.num_encoder_runs == encoded  # no tower for rows
        for data, match in (
            (wide_rows[:-1], r"11 rows; an image's rows are its tiles' \(4 rows a tile"),
            (torch.zeros(8 * TOKENS_PER_TILE, 64), "1 to 7 tiles"),
            (wide_rows[:, :32], "hidden size 64"),
            (wide_rows.reshape(1, 1, -1, 64), "expected"),
        ):
            refused(llm, prompt, data, match)
    finally:
        llm.shutdown()
    rows_wide.assert_matches(with_wide, "3 tiles")
    rows_again.assert_matches(with_wide, "3 tiles again")
    rows_square.assert_matches(with_square, "1 tile")
    # keyed by the rows' hash: the same rows hit the cache past the run (41 prompt tokens:
    # 3 before the run, its 28, 10 after), other rows only up to the run
    assert first_cached == 0 and again_cached >= 32 and other_cached < 4
    chunked = LLM(
        str(model_dir), **ENGINE, block_size=4, max_num_batched_tokens=8, enable_mm_embeds=True
    )
    try:
        [in_chunks] = run_answers(
            chunked, [{"prompt": prompt, "multi_modal_data": {"image": wide_rows}}]
        )
    finally:
        chunked.shutdown()
    in_chunks.assert_matches(with_wide, "3 tiles in 8-token chunks")
    plain = LLM(str(model_dir), **ENGINE)
    try:
        refused(plain, prompt, square_rows, "--enable-mm-embeds")
    finally:
        plain.shutdown()


def test_gemma3_rows(tmp_path: Path) -> None:
    """Two images' rows as ``[2, 16, 64]`` answer as the images (inside Gemma's framing,
    attention bidirectional within each image); other row counts are refused; without the
    flag, a refusal naming it."""
    from fixtures_gemma3 import TOKENS_PER_IMAGE, save_tiny_gemma3

    model_dir = save_tiny_gemma3(tmp_path / "gemma3")
    prompt = (
        "<start_of_turn>user\nCompare <start_of_image> with <start_of_image><end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    images = [random_image(60, 50, seed=3), random_image(40, 70, seed=4)]
    llm = LLM(str(model_dir), **ENGINE, enable_mm_embeds=True)
    try:
        runner = llm.engine.executor.worker.runner
        rows = []
        for image in images:
            _, inputs = tower_inputs(llm, image)
            with torch.no_grad():
                rows.append(runner.model.embed_multimodal("image", inputs).cpu())
        stacked = torch.stack(rows)
        assert stacked.shape == (2, TOKENS_PER_IMAGE, 64)
        encoded = runner.mm.num_encoder_runs
        with_rows, mixed = run_answers(
            llm,
            [
                {"prompt": prompt, "multi_modal_data": {"image": stacked}},
                {"prompt": prompt, "multi_modal_data": {"image": [images[0], rows[1]]}},
            ],
        )
        assert runner.mm.num_encoder_runs == encoded + 1  # the mixed request's image
        [with_images] = run_answers(
            llm, [{"prompt": prompt, "multi_modal_data": {"image": images}}]
        )
        one = prompt.replace("with <start_of_image>", "")
        refused(llm, one, rows[0][:-1], r"15 rows; an image has 16 \(the config's mm_tokens")
        refused(llm, one, torch.cat(rows), "32 rows; an image has 16")
        refused(llm, one, rows[0].to(torch.int32), "floating-point")
    finally:
        llm.shutdown()
    with_rows.assert_matches(with_images, "[2, 16, 64]")
    mixed.assert_matches(with_images, "an image and rows")
    plain = LLM(str(model_dir), **ENGINE)
    try:
        refused(plain, one, rows[0], "--enable-mm-embeds")
    finally:
        plain.shutdown()


@pytest.mark.parametrize(
    ("module", "name", "reason"),
    [
        ("mistral3_images", "Mistral3ForConditionalGenerationWithImages", r"\[IMG_BREAK\]"),
        ("idefics3_images", "Idefics3ForConditionalGenerationWithImages", "tile grid"),
    ],
)
def test_models_refusing_embeddings_say_why(module: str, name: str, reason: str) -> None:
    """Mistral 3 and Idefics3 / SmolVLM refuse embeddings naming the model and the reason."""
    import importlib

    from chassis.core.multimodal_embeds import precomputed_items

    cls = getattr(importlib.import_module(f"chassis.builtin_plugins.models.{module}"), name)

    class Config:
        hidden_size = 64

    with pytest.raises(ValueError, match=rf"'m' \({name}\) does not take image.*{reason}"):
        precomputed_items([torch.zeros(4, 64)], cls, Config(), "m")
