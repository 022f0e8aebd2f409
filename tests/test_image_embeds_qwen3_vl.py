"""Image embeddings (``--enable-mm-embeds``) for Qwen3-VL on its tiny random float32
checkpoint (tests/fixtures_qwen3_vl.py): vLLM's grid dict whose rows carry the tower's
deepstack rows beside the merger's (``hidden * (1 + K)`` wide), two images of different
grids in one dict, answer as the images through ``LLM`` (greedy tokens, each token's logprob
to 1e-4) without running the tower; rows of the language model's width alone, a row count
against the grid and a tensor alone are refused; without the flag a refusal naming it; the
server's ``image_embeds`` part with rows of the wrong width is a 400.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import torch
from fixtures_llava import random_image
from mm_hf_compare import NUM_TOKENS
from test_image_embeds_run_models import ENGINE, refused, run_answers, tower_inputs

from chassis import LLM


def saved_b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


QWEN_PAD = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_TWO = f"<|im_start|>user\n{QWEN_PAD}{QWEN_PAD}Compare.<|im_end|>\n<|im_start|>assistant\n"


def test_qwen3_vl_grid_with_deepstack_rows(tmp_path: Path) -> None:
    """Both images' rows, each with its two deepstack sets beside it (``[tokens, 192]``),
    and their ``[2, 3]`` grid in one dict answer as the images; rows of the language
    model's width alone are refused naming the deepstack width; without the flag, a
    refusal naming it."""
    from fixtures_qwen3_vl import save_tiny_qwen3_vl

    model_dir = save_tiny_qwen3_vl(tmp_path / "qwen3_vl")
    images = [random_image(64, 128, seed=5), random_image(96, 64, seed=6)]
    llm = LLM(str(model_dir), **ENGINE, enable_mm_embeds=True)
    try:
        runner = llm.engine.executor.worker.runner
        rows, grids = [], []
        for image in images:
            _, inputs = tower_inputs(llm, image)
            with torch.no_grad():
                rows.append(runner.model.embed_multimodal("image", inputs).cpu())
            grids.append(inputs["image_grid_thw"].cpu().reshape(1, 3))
        embeds = {"image_embeds": torch.cat(rows), "image_grid_thw": torch.cat(grids)}
        assert embeds["image_embeds"].shape[-1] == 64 * 3
        assert embeds["image_embeds"].shape[0] == int(embeds["image_grid_thw"].prod(-1).sum()) // 4
        encoded = runner.mm.num_encoder_runs
        [with_rows] = run_answers(
            llm, [{"prompt": QWEN_TWO, "multi_modal_data": {"image": embeds}}]
        )
        assert runner.mm.num_encoder_runs == encoded
        [with_images] = run_answers(
            llm, [{"prompt": QWEN_TWO, "multi_modal_data": {"image": images}}]
        )
        narrow = {**embeds, "image_embeds": embeds["image_embeds"][:, :64]}
        refused(llm, QWEN_TWO, narrow, r"Qwen3VLForConditionalGeneration's image embedding width")
        refused(llm, QWEN_TWO, narrow, r"deepstack sets\) 192")
        short = {**embeds, "image_embeds": embeds["image_embeds"][1:]}
        refused(llm, QWEN_TWO, short, "rows but image_grid_thw")
        refused(llm, QWEN_TWO, embeds["image_embeds"], "tensor alone")
    finally:
        llm.shutdown()
    with_rows.assert_matches(with_images, "grid dict with deepstack rows")
    plain = LLM(str(model_dir), **ENGINE)
    try:
        refused(plain, QWEN_TWO, embeds, "--enable-mm-embeds")
    finally:
        plain.shutdown()
    _server_refuses_narrow_rows(model_dir, narrow)


def _server_refuses_narrow_rows(model_dir: Path, narrow: dict[str, torch.Tensor]) -> None:
    """The chat ``image_embeds`` part with rows of the wrong width: a 400 saying so."""
    from fastapi.testclient import TestClient

    from chassis.core.async_llm import AsyncLLM
    from chassis.core.config import EngineConfig
    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    part = {
        "type": "image_embeds",
        "image_embeds": {key: saved_b64(value) for key, value in narrow.items()},
    }
    body = {
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}],
        "max_tokens": NUM_TOKENS,
    }
    engine = AsyncLLM.from_engine_config(
        EngineConfig(model=str(model_dir), **ENGINE, enable_mm_embeds=True)
    )
    try:
        settings = ServerSettings(shutdown_engine_on_exit=False)
        with TestClient(build_app(engine, settings)) as client:
            response = client.post("/v1/chat/completions", json=body)
    finally:
        engine.shutdown_sync()
    assert response.status_code == 400, response.text
    assert "image embedding width" in response.json()["error"]["message"]
