"""``/v1/audio/transcriptions`` and ``/v1/audio/translations`` over a live ``chassis serve`` of
the tiny random Whisper checkpoint (tests/fixtures_whisper.py), with the official ``openai``
client: the text equals ``LLM.generate``'s for the same audio and decoder prompt (json, text
and streamed answers; a 40 s file in two 30 s windows; ``language``, ``prompt``; a
translation); and the refusals (no file, a format not served, an unknown language or model,
a server whose model cannot transcribe).
"""

from __future__ import annotations

import io
import wave
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from fixtures_whisper import SAMPLING_RATE, random_clip, save_tiny_whisper
from server_process import running_server

from chassis import LLM, SamplingParams

MAX_MODEL_LEN = 32
WINDOW = 30 * SAMPLING_RATE


def wav_bytes(clip: np.ndarray) -> bytes:
    """``clip`` as a 16-bit mono wav file at 16 kHz."""
    pcm = np.clip(np.round(clip * 32767), -32768, 32767).astype(np.int16)
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(SAMPLING_RATE)
        wav.writeframes(pcm.tobytes())
    return out.getvalue()


def as_decoded(clip: np.ndarray) -> np.ndarray:
    """The samples the server decodes from :func:`wav_bytes` of ``clip``."""
    pcm = np.clip(np.round(clip * 32767), -32768, 32767).astype(np.int16)
    return (pcm / 32768).astype(np.float32)


def llm_text(llm: LLM, prompt: str, clip: np.ndarray) -> str:
    """What ``LLM.generate`` writes for the decoded ``clip``, window by window."""
    samples = as_decoded(clip)
    windows = [samples[i : i + WINDOW] for i in range(0, len(samples), WINDOW)]
    ids = llm.get_tokenizer().encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - len(ids))
    outputs = llm.generate(
        [
            {"prompt_token_ids": ids, "multi_modal_data": {"audio": (w, SAMPLING_RATE)}}
            for w in windows
        ],
        params,
    )
    return "".join(out.outputs[0].text for out in outputs)


TRANSCRIBE = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def test_transcriptions_match_llm_generate(tmp_path: Path) -> None:
    model_dir = save_tiny_whisper(tmp_path / "whisper")
    short, long = random_clip(3.0, seed=1), random_clip(40.0, seed=2)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
    try:
        expected = {
            "short": llm_text(llm, TRANSCRIBE, short),
            "long": llm_text(llm, TRANSCRIBE, long),
            "de": llm_text(llm, TRANSCRIBE.replace("<|en|>", "<|de|>"), short),
            "prompt": llm_text(llm, "<|startofprev|> hello there" + TRANSCRIBE, short),
            "translate": llm_text(llm, TRANSCRIBE.replace("transcribe", "translate"), short),
        }
    finally:
        llm.shutdown()
    assert expected["short"] and expected["short"] != expected["de"]

    with running_server(model_dir, tmp_path, max_model_len=MAX_MODEL_LEN) as server:
        client = server.client()
        audio = client.audio

        def transcribe(clip: np.ndarray, model: str = "tiny", **kwargs: object) -> object:
            file = ("clip.wav", wav_bytes(clip), "audio/wav")
            return audio.transcriptions.create(model=model, file=file, **kwargs)

        assert transcribe(short).text == expected["short"]
        assert transcribe(long, response_format="json").text == expected["long"]
        assert transcribe(short, response_format="text") == expected["short"]
        assert transcribe(short, language="de").text == expected["de"]
        assert transcribe(short, prompt="hello there").text == expected["prompt"]
        file = ("clip.wav", wav_bytes(short), "audio/wav")
        translated = audio.translations.create(model="tiny", file=file)
        assert translated.text == expected["translate"]
        events = list(transcribe(long, stream=True))
        deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
        assert "".join(deltas) == expected["long"] and len(deltas) > 1
        assert events[-1].type == "transcript.text.done"
        assert events[-1].text == expected["long"]

        for kwargs, status, match in (
            ({"response_format": "verbose_json"}, 400, "response_format 'verbose_json'"),
            ({"language": "xx"}, 400, "language 'xx'"),
            ({"model": "other"}, 404, "does not exist"),
        ):
            with pytest.raises(openai.APIStatusError) as refused:
                transcribe(short, **kwargs)  # type: ignore[arg-type]
            assert refused.value.status_code == status and match in str(refused.value)
        missing = httpx.post(
            server.base + "/v1/audio/transcriptions",
            data={"model": "tiny"},
            files={"other": ("x.txt", b"x")},
            headers=server.headers,
        )
        assert missing.status_code == 400 and "file" in missing.json()["error"]["message"]
        junk = httpx.post(
            server.base + "/v1/audio/transcriptions",
            files={"file": ("x.wav", b"not audio")},
            headers=server.headers,
        )
        assert junk.status_code == 400, junk.text


def test_a_model_that_cannot_transcribe_is_a_400() -> None:
    from fake_engine import FakeAsyncLLM

    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    with TestClient(build_app(FakeAsyncLLM(), ServerSettings())) as client:
        answer = client.post(
            "/v1/audio/transcriptions", files={"file": ("a.wav", wav_bytes(random_clip(1.0)))}
        )
    assert answer.status_code == 400, answer.text
    assert "'fake-model' cannot transcribe audio" in answer.json()["error"]["message"]
