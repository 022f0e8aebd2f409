"""Image embeddings in place of images (vLLM's ``image_embeds``, ``--enable-mm-embeds``) on tiny
random float32 checkpoints (tests/fixtures_llava.py, tests/fixtures_qwen2_vl.py).

Checked: LLaVA-1.5 with the rows HF's ``get_image_features`` gives (``[rows, hidden]`` and
``[images, rows, hidden]``) answers as with the images themselves and as HF ``generate``
(greedy tokens; each token's logprob to 1e-4), runs no vision tower, and hits the prefix
cache keyed by the rows, also on two tensor-parallel ranks with chunks cutting through the
rows; LLaVA-NeXT and InternVL with their own ``embed_multimodal`` rows answer as with the
image; Qwen2-VL with vLLM's ``{"image_embeds", "image_grid_thw"}`` dict
(two images in one dict: the rows split by the grid, M-RoPE positions from it) answers as
with the images; the chat ``image_embeds`` part through the server app (base64 of a
``torch.save``'d tensor) with the flag answers as the ``image_url`` part, and without it is a
400 naming the flag; and the refusals (no flag offline, wrong width, dtype kind, row count
against the grid, a tensor alone for Qwen2-VL, a model that takes none (Mistral 3), bad
base64, a pickle that is not a tensor).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_llava import hf_inputs, hf_model, random_image, save_tiny_llava
from fixtures_qwen2_vl import hf_inputs as qwen_hf_inputs
from fixtures_qwen2_vl import save_tiny_qwen2_vl
from mm_hf_compare import (
    NUM_TOKENS,
    PARAMS,
    Answer,
    answers,
    answers_and_cached,
    hf_generate,
    image_url_part,
    png_data_url,
    two_rank_answers,
)

from chassis import LLM
from chassis.core.multimodal_embeds import (
    PrecomputedItem,
    load_embeds,
    precomputed_items,
)

LLAVA_PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"
LLAVA_TWO = "USER: <image> and <image>\nCompare them. ASSISTANT:"
QWEN_PAD = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_TWO = f"<|im_start|>user\n{QWEN_PAD}{QWEN_PAD}Compare.<|im_end|>\n<|im_start|>assistant\n"


def pooled(features: Any) -> torch.Tensor:
    """``get_image_features``' rows of every image, concatenated ``[rows, hidden]``."""
    rows = features if isinstance(features, torch.Tensor | list | tuple) else features.pooler_output
    if isinstance(rows, list | tuple):
        rows = torch.cat([r.reshape(-1, r.shape[-1]) for r in rows])
    return rows.reshape(-1, rows.shape[-1]).detach()


def saved_b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The checkpoint, HF's model, two images and HF's rows for each."""
    model_dir = save_tiny_llava(tmp_path_factory.mktemp("llava"))
    hf = hf_model(model_dir)
    images = [random_image(60, 50, seed=1), random_image(40, 70, seed=2)]
    with torch.no_grad():
        pixels = hf_inputs(model_dir, LLAVA_TWO, images)["pixel_values"]
        rows = pooled(hf.get_image_features(pixel_values=pixels)).reshape(2, -1, 64)
    return {"dir": model_dir, "hf": hf, "images": images, "rows": rows}


def hf_answer(llava: dict[str, Any], prompt: str, images: list[Any]) -> Answer:
    """HF ``generate``'s greedy answer on the images with each token's logprob."""
    return hf_generate(llava["hf"], hf_inputs(llava["dir"], prompt, images))


def test_llava_embeddings_answer_as_the_images(llava: dict[str, Any]) -> None:
    """Rows ``[16, 64]`` for one image, ``[2, 16, 64]`` for two and a list mixing an image
    and rows: each answer is the images' and HF's; the rows never reach the tower, and the
    same rows again hit the prefix cache through the image, other rows do not."""
    images, rows = llava["images"], llava["rows"]
    llm = LLM(
        str(llava["dir"]),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=64,
        block_size=4,
        enable_mm_embeds=True,
    )
    runner = llm.engine.executor.worker.runner

    def run(prompt: str, data: Any) -> tuple[Answer, int]:
        request = {"prompt": prompt, "multi_modal_data": data}
        [(answer, cached)] = answers_and_cached(llm.generate([request], PARAMS))
        return answer, cached

    try:
        one_image, _ = run(LLAVA_PROMPT, {"image": images[0]})
        encoded = runner.mm.num_encoder_runs
        one_rows, one_rows_cached = run(LLAVA_PROMPT, {"image": rows[0]})
        again, again_cached = run(LLAVA_PROMPT, {"image": rows[0].clone()})
        _, other_cached = run(LLAVA_PROMPT, {"image": rows[1]})
        two_rows, _ = run(LLAVA_TWO, {"image": rows})
        mixed, _ = run(LLAVA_TWO, {"image": [images[0], rows[1]]})
        assert runner.mm.num_encoder_runs == encoded + 1  # the mixed prompt's image only
        two_images, _ = run(LLAVA_TWO, {"image": images})
    finally:
        llm.shutdown()
    expected = hf_answer(llava, LLAVA_PROMPT, images[:1])
    one_image.assert_matches(expected, "image")
    one_rows.assert_matches(expected, "rows")
    again.assert_matches(expected, "rows again")
    assert one_rows_cached == 0 and again_cached >= 16  # keyed by the rows' hash
    assert other_cached < 8  # the text before the image only (another image's rows)
    expected_two = hf_answer(llava, LLAVA_TWO, images)
    for answer, what in ((two_rows, "[2, 16, 64]"), (mixed, "mixed"), (two_images, "images")):
        answer.assert_matches(expected_two, what)


def test_llava_rows_on_two_ranks_in_chunks(llava: dict[str, Any]) -> None:
    """Two tensor-parallel ranks (rank 1 gets the rows over the wire) and steps of 8 tokens
    cutting through the rows (the encoder-output cache across steps): HF's answer."""
    request = {"prompt": LLAVA_TWO, "multi_modal_data": {"image": llava["rows"]}}
    [answer] = two_rank_answers(
        llava["dir"],
        [request],
        max_model_len=128,
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=8,
        enable_mm_embeds=True,
    )
    answer.assert_matches(hf_answer(llava, LLAVA_TWO, llava["images"]), "two ranks, chunks")


def test_llava_refusals(llava: dict[str, Any]) -> None:
    """Without the flag (offline too, as vLLM), and each bad tensor: a ValueError saying
    what is wrong; the engine serves the next request."""
    rows = llava["rows"][0]
    llm = LLM(str(llava["dir"]), dtype="float32", max_model_len=128, num_kv_blocks=32)
    try:
        with pytest.raises(ValueError, match="--enable-mm-embeds"):
            llm.generate({"prompt": LLAVA_PROMPT, "multi_modal_data": {"image": rows}}, PARAMS)
    finally:
        llm.shutdown()
    llm = LLM(
        str(llava["dir"]),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=32,
        enable_mm_embeds=True,
    )
    cases = [
        ({"image": rows[:, :32]}, "hidden size 64"),
        ({"image": rows.to(torch.int64)}, "floating-point"),
        ({"image": rows.reshape(1, 1, 16, 64)}, "expected"),
        ({"image": {"image_embeds": rows}}, "as a tensor"),
        ({"image": rows[:0]}, "no rows"),
        ({"image": rows * float("nan")}, "non-finite"),
        ({"image": llava["rows"]}, "1 image placeholder"),  # two images, one placeholder
        ({"video": rows}, "takes image inputs, not video"),
    ]
    try:
        for data, match in cases:
            with pytest.raises(ValueError, match=match):
                llm.generate({"prompt": LLAVA_PROMPT, "multi_modal_data": data}, PARAMS)
        [answer] = answers(
            llm.generate({"prompt": LLAVA_PROMPT, "multi_modal_data": {"image": rows}}, PARAMS)
        )
    finally:
        llm.shutdown()
    assert answer.tokens == hf_answer(llava, LLAVA_PROMPT, llava["images"][:1]).tokens


def test_qwen2_vl_grid_dict_answers_as_the_images(tmp_path: Path) -> None:
    """vLLM's dict form, both images' rows in one dict with a ``[2, 3]`` grid (different
    sizes: the rows split by the grid, the M-RoPE positions from it): the images' answer;
    then the refusals particular to the grid."""
    import transformers as tf

    model_dir = save_tiny_qwen2_vl(tmp_path / "qwen2_vl")
    images = [random_image(56, 112, seed=3), random_image(84, 56, seed=4)]
    hf = tf.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = qwen_hf_inputs(model_dir, QWEN_TWO.replace(QWEN_PAD, "<|image_pad|>"), images)
    grid = inputs["image_grid_thw"]
    with torch.no_grad():
        rows = pooled(hf.model.get_image_features(inputs["pixel_values"], grid))
    assert rows.shape == (int(grid.prod(-1).sum()) // 4, 64)
    llm = LLM(
        str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64, enable_mm_embeds=True
    )

    def run(data: Any) -> Answer:
        [answer] = answers(llm.generate([{"prompt": QWEN_TWO, "multi_modal_data": data}], PARAMS))
        return answer

    try:
        with_images = run({"image": images})
        with_rows = run({"image": {"image_embeds": rows, "image_grid_thw": grid}})
        as_lists = run({"image": {"image_embeds": rows, "image_grid_thw": grid.tolist()}})
        first = int(grid[0].prod()) // 4
        part = {"image_embeds": {"image_embeds": rows[:first], "image_grid_thw": grid[:1]}}
        chats = [
            [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
            for image in (
                part | {"type": "image_embeds"},
                {"type": "image_pil", "image_pil": images[0]},
            )
        ]
        chatted, chatted_image = answers(llm.chat(chats, PARAMS))
        cases = [
            ({"image_embeds": rows[1:], "image_grid_thw": grid}, "rows but image_grid_thw"),
            ({"image_embeds": rows, "image_grid_thw": grid[:, :2]}, "integers"),
            ({"image_embeds": rows, "image_grid_thw": grid.float()}, "integers"),
            ({"image_embeds": rows, "image_grid_thw": grid + 1}, "multiples"),
            ({"image_embeds": rows}, "keys"),
            (rows, "tensor alone"),
        ]
        for data, match in cases:
            with pytest.raises(ValueError, match=match):
                run({"image": data})
    finally:
        llm.shutdown()
    with_rows.assert_matches(with_images, "dict")
    as_lists.assert_matches(with_images, "grid as a list")
    chatted.assert_matches(chatted_image, "LLM.chat image_embeds part")


@pytest.mark.parametrize("family", ["llava_next", "internvl"])
def test_other_row_models_answer_as_the_images(family: str, tmp_path: Path) -> None:
    """LLaVA-NeXT and InternVL (InternVL's processor frames each run with ``<img>`` tokens)
    with the rows their own ``embed_multimodal`` gives for an image: the image's answer."""
    if family == "llava_next":
        from fixtures_llava_next import save_tiny_llava_next as save
    else:
        from fixtures_internvl import save_tiny_internvl as save
    model_dir = save(tmp_path / family)
    image = random_image(84, 42, seed=5)
    llm = LLM(
        str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64, enable_mm_embeds=True
    )
    try:
        processor = llm.input_processor.multimodal.processor()
        prompt = f"USER: {processor.prompt_placeholder('image')}\nWhat is this? ASSISTANT:"
        runner = llm.engine.executor.worker.runner
        _, tensors = processor.process_item("image", image, {})
        with torch.no_grad():
            inputs = {name: t.to(runner.mm.device) for name, t in tensors.items()}
            rows = runner.model.embed_multimodal("image", inputs).cpu()
        with_image, with_rows = answers(
            llm.generate(
                [
                    {"prompt": prompt, "multi_modal_data": {"image": image}},
                    {"prompt": prompt, "multi_modal_data": {"image": rows}},
                ],
                PARAMS,
            )
        )
    finally:
        llm.shutdown()
    with_rows.assert_matches(with_image, family)


class _Config:
    hidden_size = 64


def test_models_without_embeddings_are_named() -> None:
    """A model without a form, with its reason (Mistral 3); images pass untouched."""
    from chassis.builtin_plugins.models.mistral3_images import (
        Mistral3ForConditionalGenerationWithImages,
    )

    rows = torch.zeros(4, 64)
    mistral = Mistral3ForConditionalGenerationWithImages
    with pytest.raises(ValueError, match=r"'m' \(Mistral3.*\) does not take image embeddings"):
        precomputed_items([rows], mistral, _Config(), "m")
    image = random_image(8, 8)
    kept = precomputed_items([image], mistral, None, "m")
    assert kept == [image]


def test_load_embeds() -> None:
    """Base64 of torch.save'd tensors, and dicts of them, load; anything else is refused."""
    rows = torch.randn(3, 8)
    assert torch.equal(load_embeds(saved_b64(rows)), rows)
    grid = torch.tensor([[1, 2, 2]])
    loaded = load_embeds({"image_embeds": saved_b64(rows), "image_grid_thw": saved_b64(grid)})
    assert torch.equal(loaded["image_embeds"], rows) and torch.equal(loaded["image_grid_thw"], grid)
    buffer = io.BytesIO()
    torch.save({"not": "a tensor"}, buffer)
    for value, match in (
        ("@@", "base64"),
        (base64.b64encode(b"junk").decode(), "torch.save"),
        (base64.b64encode(buffer.getvalue()).decode(), "not a tensor"),
        (None, "needs"),
        (3, "needs"),
    ):
        with pytest.raises(ValueError, match=match):
            load_embeds(value)
    assert isinstance(PrecomputedItem(1, {}), PrecomputedItem)


def test_chat_part_through_the_server(llava: dict[str, Any]) -> None:
    """``{"type": "image_embeds", "image_embeds": <base64>}`` answers as the image_url part
    of the same image; a bad payload and, on an engine without the flag, any such part are
    400s naming the part (the flag)."""
    from fastapi.testclient import TestClient

    from chassis.core.async_llm import AsyncLLM
    from chassis.core.config import EngineConfig
    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    image, rows = llava["images"][0], llava["rows"][0]
    image_part = image_url_part(png_data_url(image))
    embeds_part = {"type": "image_embeds", "image_embeds": saved_b64(rows)}

    def chat(client: TestClient, part: dict[str, Any]) -> Any:
        body = {
            "messages": [
                {"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}
            ],
            "max_tokens": NUM_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        return client.post("/v1/chat/completions", json=body)

    settings = ServerSettings(shutdown_engine_on_exit=False)
    for flag in (True, False):
        engine = AsyncLLM.from_engine_config(
            EngineConfig(
                model=str(llava["dir"]),
                dtype="float32",
                max_model_len=128,
                num_kv_blocks=32,
                enable_mm_embeds=flag,
            )
        )
        try:
            with TestClient(build_app(engine, settings)) as client:
                if flag:
                    expected = chat(client, image_part)
                    answer = chat(client, embeds_part)
                    assert answer.status_code == 200, answer.text
                    ids = answer.json()["choices"][0]["token_ids"]
                    assert ids == expected.json()["choices"][0]["token_ids"]
                    refused = chat(client, {"type": "image_embeds", "image_embeds": "@@"})
                    match = "messages[0].content[0]: image_embeds is not valid base64"
                else:
                    refused = chat(client, embeds_part)
                    match = "messages[0].content[0]: image embeddings are taken only when"
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert match in error["message"] and error["param"] == "messages.0.content"
                if not flag:
                    assert "--enable-mm-embeds" in error["message"]
        finally:
            engine.shutdown_sync()
