"""Image embeddings (``--enable-mm-embeds``) for Llama 4 on the tiny random float32 checkpoint
of tests/test_llama4_images.py: the ``"tiles"`` form, an image's tiles' rows with HF's
``aspect_ratios`` (the run's tile separators need the grid).

Checked through ``LLM``, as for Aya Vision and Gemma 3 (tests/test_image_embeds_run_models.py):
the rows the model's own tower and projector give answer as the images themselves (greedy
tokens, each token's logprob to 1e-4) without running the tower: a multi-tile image with its
grid, two images of different grids in one dict, a one-tile image as a tensor alone; the
same rows hit the prefix cache through the run; wrong counts, grids and shapes are
``ValueError``s saying what is wrong; an engine without the flag refuses them naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from mm_hf_compare import PARAMS, Answer, answers_and_cached
from test_llama4_images import ONE, TWO, image, save_tiny_llama4_images

from chassis import LLM

ENGINE: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 256}


def refused(llm: LLM, prompt: str, data: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": data}}, PARAMS)


def test_llama4_tile_rows_with_their_grid(tmp_path: Path) -> None:
    model_dir = save_tiny_llama4_images(tmp_path / "llama4")
    wide, square = image("wide"), image("square")
    llm = LLM(str(model_dir), **ENGINE, block_size=4, enable_mm_embeds=True)
    try:
        processor = llm.input_processor.multimodal.processor()
        runner = llm.engine.executor.worker.runner

        def tile_rows(picture: Any) -> torch.Tensor:
            _, tensors = processor.process_item("image", picture, {})
            pixels = tensors["pixel_values"].to(runner.mm.device)
            with torch.no_grad():
                return runner.model.image_features(pixels).reshape(-1, 64).cpu()

        wide_grid = list(processor.tiles.grid(wide.height, wide.width))
        assert wide_grid[0] * wide_grid[1] > 1  # several tiles, then the global one
        wide_rows, square_rows = tile_rows(wide), tile_rows(square)
        assert len(wide_rows) == (wide_grid[0] * wide_grid[1] + 1) * processor.tokens_per_tile
        assert len(square_rows) == processor.tokens_per_tile

        def run(prompt: str, data: Any) -> tuple[Answer, int]:
            request = {"prompt": prompt, "multi_modal_data": {"image": data}}
            [(answer, cached)] = answers_and_cached(llm.generate([request], PARAMS))
            return answer, cached

        with_wide, _ = run(ONE, wide)
        with_square, _ = run(ONE, square)
        with_both, _ = run(TWO, [wide, square])
        encoded = runner.mm.num_encoder_runs
        wide_dict = {"image_embeds": wide_rows, "aspect_ratios": [wide_grid]}
        rows_wide, first_cached = run(ONE, wide_dict)
        rows_again, again_cached = run(ONE, {**wide_dict, "image_embeds": wide_rows.clone()})
        _, other_cached = run(ONE, {**wide_dict, "image_embeds": wide_rows * 1.01})
        rows_square, _ = run(ONE, square_rows)
        both = {
            "image_embeds": torch.cat([wide_rows, square_rows]),
            "aspect_ratios": torch.tensor([wide_grid, [1, 1]]),
        }
        rows_both, _ = run(TWO, both)
        assert runner.mm.num_encoder_runs == encoded  # no tower for rows
        per_tile = processor.tokens_per_tile
        for prompt, data, match in (
            (ONE, wide_rows, "no aspect_ratios: one tile takes 4"),
            (ONE, {**wide_dict, "aspect_ratios": [[1, 1]]}, "aspect_ratios 1x1 takes 4"),
            (ONE, {**wide_dict, "image_embeds": wide_rows[:-1]}, "not a multiple"),
            (
                ONE,
                {"image_embeds": torch.zeros(8 * per_tile, 64), "aspect_ratios": [[1, 7]]},
                "at most 6",
            ),
            (ONE, {**wide_dict, "aspect_ratios": [[0, 2]]}, ">= 1"),
            (ONE, {**wide_dict, "aspect_ratios": [1.0, 2.0]}, "must be integers"),
            (ONE, {"image_embeds": wide_rows}, "aspect_ratios"),
            (ONE, {**wide_dict, "image_embeds": wide_rows[:, :32]}, "hidden size 64"),
        ):
            refused(llm, prompt, data, match)
    finally:
        llm.shutdown()
    rows_wide.assert_matches(with_wide, "a multi-tile image's rows with its grid")
    rows_again.assert_matches(with_wide, "the same rows again")
    rows_square.assert_matches(with_square, "one tile's rows alone")
    rows_both.assert_matches(with_both, "two images in one dict")
    # keyed by the rows' hash: the same rows hit the cache past the run, other rows only
    # up to it (the run starts at the prompt's 4th token)
    assert first_cached == 0 and again_cached >= len(wide_rows) and other_cached < 4
    plain = LLM(str(model_dir), **ENGINE)
    try:
        refused(plain, ONE, square_rows, "--enable-mm-embeds")
    finally:
        plain.shutdown()


def test_the_tiles_form_splits_rows_by_the_grids() -> None:
    """One dict of two images: the rows split by their tiles (a grid of several plus its
    global tile, or one), each item with its own ``aspect_ratios``."""
    from chassis.builtin_plugins.models.llama4_images import (
        Llama4ForConditionalGenerationWithImages,
    )
    from chassis.core.multimodal_embeds import PrecomputedItem, precomputed_items

    class Config:
        hidden_size = 64

    rows = torch.zeros(12, 64)
    [a, b] = precomputed_items(
        [{"image_embeds": rows, "aspect_ratios": [[1, 2], [1, 1]]}],
        Llama4ForConditionalGenerationWithImages,
        Config(),
        "m",
    )
    assert isinstance(a, PrecomputedItem) and isinstance(b, PrecomputedItem)
    assert (a.length, b.length) == (9, 3)  # 3 tiles (2 and the global) and 1, 3 rows a tile
    assert a.tensors["aspect_ratios"].tolist() == [[1, 2]]
