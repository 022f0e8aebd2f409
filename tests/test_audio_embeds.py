"""Audio embeddings (vLLM's ``audio_embeds``, ``--enable-mm-embeds``) for Qwen2-Audio on its
tiny random float32 checkpoint (tests/fixtures_qwen2_audio.py).

Checked: the rows the model's own tower and projector give for a clip, sent in its place
(``[rows, hidden]``; two clips of different lengths as a list; a clip beside rows), answer
as the clips through ``LLM`` (greedy tokens, each token's logprob to 1e-4), in 16-token
chunks cutting through the rows, without running the tower; the rows again hit the prefix
cache; wrong shapes are ``ValueError``s; the server's chat ``audio_embeds`` part (base64 of a
``torch.save``'d tensor) answers as the ``input_audio`` part of the clip, and a bad one is a
400; without the flag, offline and at the server, a refusal naming it.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_qwen2_audio import SAMPLING_RATE, random_clip, save_tiny_qwen2_audio, wav_bytes
from mm_hf_compare import CHUNKED, PARAMS, Answer, answers_and_cached

from chassis import LLM

PLACEHOLDER = "<|audio_bos|><|AUDIO|><|audio_eos|>"
ONE = f"<|im_start|>user\nAudio 1: {PLACEHOLDER}\nWhat is that sound?<|im_end|>\n"
TWO = f"<|im_start|>user\nFirst {PLACEHOLDER} then {PLACEHOLDER} compare.<|im_end|>\n"
ENGINE: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 128}


def saved_b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def pcm16(clip: np.ndarray) -> np.ndarray:
    """``clip`` as a 16-bit wav holds it (what the server decodes)."""
    return (np.round(np.clip(clip, -1, 1) * 32767).astype(np.int16) / 32768).astype(np.float32)


def clip_rows(llm: LLM, clip: np.ndarray) -> torch.Tensor:
    """The engine's model's rows of ``clip`` (its tower and projector)."""
    processor = llm.input_processor.multimodal.processor()
    runner = llm.engine.executor.worker.runner
    _, tensors = processor.process_item("audio", (clip, SAMPLING_RATE), {})
    with torch.no_grad():
        inputs = {name: t.to(runner.mm.device) for name, t in tensors.items()}
        return runner.model.embed_multimodal("audio", inputs).cpu()


CLIPS = [random_clip(1.3, seed=1), random_clip(0.7, seed=2)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio"))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Any:
    """The offline engine with the flag: steps of 16 tokens, 4-token blocks."""
    engine = LLM(str(model_dir), **ENGINE, **CHUNKED, enable_mm_embeds=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def rows(llm: LLM) -> list[torch.Tensor]:
    """The model's rows of each of :data:`CLIPS`, then of the second as a 16-bit wav."""
    return [clip_rows(llm, clip) for clip in (*CLIPS, pcm16(CLIPS[1]))]


def test_rows_answer_as_the_clips(llm: LLM, rows: list[torch.Tensor]) -> None:
    """``[rows, hidden]`` for one clip, a list of two clips' rows (32 and 17 rows), and a
    clip beside rows: the clips' answers, in 16-token chunks; the tower runs only for the
    clips; the same rows again hit the prefix cache, other rows do not; bad tensors are
    refused saying why."""
    clips = CLIPS
    runner = llm.engine.executor.worker.runner

    def run(prompt: str, audio: Any) -> tuple[Answer, int]:
        request = {"prompt": prompt, "multi_modal_data": {"audio": audio}}
        [(answer, cached)] = answers_and_cached(llm.generate([request], PARAMS))
        return answer, cached

    assert [r.shape for r in rows] == [(32, 64), (17, 64), (17, 64)]
    one_clip, _ = run(ONE, (clips[0], SAMPLING_RATE))
    two_clips, _ = run(TWO, [(clip, SAMPLING_RATE) for clip in clips])
    encoded = runner.mm.num_encoder_runs
    one_rows, first_cached = run(ONE, rows[0])
    again, again_cached = run(ONE, rows[0].clone())
    _, other_cached = run(ONE, rows[0] * 1.01)
    two_rows, _ = run(TWO, rows[:2])
    stacked, _ = run(TWO, torch.stack([rows[0], rows[0]]))
    mixed, _ = run(TWO, [rows[0], (clips[1], SAMPLING_RATE)])
    assert runner.mm.num_encoder_runs == encoded + 1  # the mixed prompt's clip only
    two_same, _ = run(TWO, [(clips[0], SAMPLING_RATE)] * 2)
    for audio, match in (
        (rows[0][:, :32], "audio embeddings has shape .*hidden size 64"),
        (rows[0].to(torch.int64), "floating-point"),
        (torch.zeros(751, 64), "751 rows; a clip has at most 750"),
        (rows[0][None, None], "expected"),
        ({"audio_embeds": rows[0]}, "as a tensor"),
        (torch.stack([rows[0]] * 2), "1 audio placeholder"),
    ):
        with pytest.raises(ValueError, match=match):
            run(ONE, audio)
    one_rows.assert_matches(one_clip, "rows")
    again.assert_matches(one_clip, "rows again")
    # keyed by the rows' hash: only the text before the clip, then past its 32 rows
    assert other_cached == first_cached < 16 and again_cached >= first_cached + 32
    two_rows.assert_matches(two_clips, "two clips' rows")
    mixed.assert_matches(two_clips, "a clip and rows")
    stacked.assert_matches(two_same, "[2, 32, 64]")


def test_chat_audio_embeds_part(model_dir: Path, rows: list[torch.Tensor]) -> None:
    """The server's ``{"type": "audio_embeds", "audio_embeds": <base64>}`` answers as the
    ``input_audio`` part of the clip; a bad payload is a 400 naming the part; without the
    flag such a part is a 400 naming it, and so is a tensor offline."""
    from fastapi.testclient import TestClient

    from chassis.core.async_llm import AsyncLLM
    from chassis.core.config import EngineConfig
    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    wav = wav_bytes(CLIPS[1])
    embeds_part = {"type": "audio_embeds", "audio_embeds": saved_b64(rows[2])}
    audio_part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"},
    }

    def chat(client: TestClient, part: dict[str, Any]) -> Any:
        content = [part, {"type": "text", "text": "What is that sound?"}]
        body = {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        return client.post("/v1/chat/completions", json=body)

    settings = ServerSettings(shutdown_engine_on_exit=False)
    for flag in (True, False):
        engine = AsyncLLM.from_engine_config(
            EngineConfig(model=str(model_dir), **ENGINE, enable_mm_embeds=flag)
        )
        try:
            with TestClient(build_app(engine, settings)) as client:
                if flag:
                    expected = chat(client, audio_part)
                    answer = chat(client, embeds_part)
                    assert answer.status_code == 200, answer.text
                    ids = answer.json()["choices"][0]["token_ids"]
                    assert ids == expected.json()["choices"][0]["token_ids"]
                    refused = chat(client, {"type": "audio_embeds", "audio_embeds": "@@"})
                    match = "messages[0].content[0]: audio_embeds is not valid base64"
                else:
                    refused = chat(client, embeds_part)
                    match = "messages[0].content[0]: audio embeddings are taken only when"
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert match in error["message"] and error["param"] == "messages.0.content"
                if not flag:
                    assert "--enable-mm-embeds" in error["message"]
                    with pytest.raises(ValueError, match="--enable-mm-embeds"):
                        engine.input_processor.multimodal.expand([1, 49152, 2], {"audio": rows[2]})
        finally:
            engine.shutdown_sync()
