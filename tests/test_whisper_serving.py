"""``/v1/audio/transcriptions`` and ``/v1/audio/translations`` over a live ``chassis serve`` of
the tiny random Whisper checkpoint (tests/fixtures_whisper.py), with the official ``openai``
client: the text equals ``LLM.generate``'s for the same audio and decoder prompt (json, text
and streamed answers; a 40 s file in two 30 s windows; ``language``, ``prompt``;
translations, from English and from German); and the refusals (no file, a format not served,
an unknown language or model, a bad temperature or stream flag, a completion without audio,
a chat, a server whose model cannot transcribe). One server serves the module; the offline
engine's texts are computed while it starts.
"""

from __future__ import annotations

import io
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from fixtures_whisper import SAMPLING_RATE, random_clip, save_tiny_whisper
from server_process import ServerProcess, running_server

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
SHORT, LONG = random_clip(3.0, seed=1), random_clip(40.0, seed=2)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict]]:
    """One server for the module, and ``LLM.generate``'s texts for its checks, computed
    once by an offline engine while the server starts."""
    model_dir = save_tiny_whisper(tmp_path_factory.mktemp("whisper"))
    log_dir = tmp_path_factory.mktemp("serve")
    # (the pool exits first: a failed offline run still waits for the server, then stops it)
    with ExitStack() as stack, ThreadPoolExecutor(1) as pool:
        starting = pool.submit(
            stack.enter_context, running_server(model_dir, log_dir, max_model_len=MAX_MODEL_LEN)
        )
        llm = LLM(str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
        try:
            expected = {
                "short": llm_text(llm, TRANSCRIBE, SHORT),
                "long": llm_text(llm, TRANSCRIBE, LONG),
                "de": llm_text(llm, TRANSCRIBE.replace("<|en|>", "<|de|>"), SHORT),
                "prompt": llm_text(llm, "<|startofprev|> hello there" + TRANSCRIBE, SHORT),
                "translate": llm_text(llm, TRANSCRIBE.replace("transcribe", "translate"), SHORT),
                "translate_de": llm_text(
                    llm,
                    TRANSCRIBE.replace("transcribe", "translate").replace("<|en|>", "<|de|>"),
                    SHORT,
                ),
            }
        finally:
            llm.shutdown()
        assert expected["short"] and expected["short"] != expected["de"]
        assert expected["translate"] != expected["translate_de"]
        yield starting.result(), expected


def transcribe(server: ServerProcess, clip: np.ndarray, **kwargs: Any) -> Any:
    file = ("clip.wav", wav_bytes(clip), "audio/wav")
    kwargs.setdefault("model", "tiny")
    return server.client().audio.transcriptions.create(file=file, **kwargs)


def test_json_and_text_answers_match_llm_generate(served: tuple[ServerProcess, dict]) -> None:
    server, expected = served
    assert transcribe(server, SHORT).text == expected["short"]
    # 40 s: two 30 s windows, their texts joined
    assert transcribe(server, LONG, response_format="json").text == expected["long"]
    assert transcribe(server, SHORT, response_format="text") == expected["short"]


def test_language_prompt_and_translations(served: tuple[ServerProcess, dict]) -> None:
    server, expected = served
    assert transcribe(server, SHORT, language="de").text == expected["de"]
    assert transcribe(server, SHORT, language=" DE ").text == expected["de"]
    assert transcribe(server, SHORT, prompt="hello there").text == expected["prompt"]
    translations = server.client().audio.translations
    file = ("clip.wav", wav_bytes(SHORT), "audio/wav")
    assert translations.create(model="tiny", file=file).text == expected["translate"]
    # the audio's language is the source language's token, as vLLM's translations
    translated = translations.create(model="tiny", file=file, extra_body={"language": "de"})
    assert translated.text == expected["translate_de"]


def test_streamed_answer(served: tuple[ServerProcess, dict]) -> None:
    server, expected = served
    events = list(transcribe(server, LONG, stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert "".join(deltas) == expected["long"] and len(deltas) > 1
    assert events[-1].type == "transcript.text.done"
    assert events[-1].text == expected["long"]


def test_refusals(served: tuple[ServerProcess, dict]) -> None:
    server, _ = served
    for kwargs, status, match in (
        ({"response_format": "verbose_json"}, 400, "response_format 'verbose_json'"),
        ({"language": "xx"}, 400, "language 'xx'"),
        ({"model": "other"}, 404, "does not exist"),
        ({"temperature": 3}, 400, "temperature must be a number from 0 to 2"),
    ):
        with pytest.raises(openai.APIStatusError) as refused:
            transcribe(server, SHORT, **kwargs)
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
    bad_stream = httpx.post(
        server.base + "/v1/audio/transcriptions",
        data={"stream": "maybe"},
        files={"file": ("clip.wav", wav_bytes(SHORT))},
        headers=server.headers,
    )
    assert bad_stream.status_code == 400 and "stream" in bad_stream.text
    # the other routes: a completion without its clip, a chat (no chat template)
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="needs its audio clip"):
        client.completions.create(model="tiny", prompt=TRANSCRIBE, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )


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
