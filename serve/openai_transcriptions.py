"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: OpenAI's speech-to-text
API, served by an encoder-decoder speech model (Whisper).

The request is a multipart form (OpenAI's fields):

- ``file`` (required): the audio file, any format PyAV decodes (wav, mp3, flac, ogg, ...:
  :func:`chassis.core.audio_loading.decode_audio`), averaged to mono and resampled to the
  feature extractor's rate (16 kHz);
- ``model``: the served model's name (or an alias); another name is a 404;
- ``language``: ISO 639-1 code of the audio's language, whose ``<|xx|>`` token starts the
  decoder prompt; unset means ``en`` (as vLLM: no language detection); a code the tokenizer
  has no token for is a 400. Translations take it too (the source language, as vLLM and
  Whisper's own decoding do) and always translate into English (the ``<|translate|>`` task);
- ``prompt``: text the model takes as the previous window's (``<|startofprev|>`` + text,
  before ``<|startoftranscript|>``);
- ``response_format``: ``json`` (default: ``{"text": ..., "usage": {"type": "duration",
  "seconds": ...}}``) or ``text`` (the text alone, ``text/plain``); ``verbose_json``,
  ``srt`` and ``vtt`` are 400s;
- ``temperature`` (default 0: greedy); ``stream`` (``true``: Server-Sent Events, OpenAI's
  ``{"type": "transcript.text.delta", "delta": ...}`` per piece of text, then
  ``{"type": "transcript.text.done", "text": ...}``, then ``data: [DONE]``).

Audio longer than the model's 30 s window is cut into consecutive 30 s windows (at fixed
boundaries, not at silences as vLLM looks for), each one engine request (they run batched);
the texts are joined in order. Each window's decoder prompt is ``[<|startofprev|> prompt]
<|startoftranscript|><|xx|><|transcribe|>|<|translate|><|notimestamps|>`` and it may
generate up to ``max_model_len`` minus that prompt's tokens, ending at end-of-text.

A model that cannot transcribe (not an encoder-decoder with audio) is a 400 naming it. The
form is parsed with Starlette (``python-multipart``, a dependency; imported only here, on
the first request: without it the route answers 500 saying what to install).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from chassis.serve import errors
from chassis.serve.state import ServerState
from chassis.serve.streaming import (
    SSE_DONE,
    ClientDisconnected,
    ClosingStreamingResponse,
    cancel_on_disconnect,
    sse,
)

router = APIRouter()

#: the response formats answered (OpenAI's others are refused)
RESPONSE_FORMATS = ("json", "text")
DEFAULT_LANGUAGE = "en"


@dataclass(frozen=True)
class SpeechModel:
    """What the route needs of the served model: its clip rate and window length."""

    sampling_rate: int
    window_samples: int


def _speech_model(state: ServerState) -> SpeechModel:
    """The served model's :class:`SpeechModel`, asked of the engine's multimodal front-end
    (its processor: built once, the one the engine's requests use); ``APIError`` 400 when it
    cannot transcribe."""
    chat_images = state.renderer.chat_images
    multimodal = None if chat_images is None else chat_images.multimodal
    try:
        speech = multimodal is not None and multimodal.is_encoder_decoder()
    except Exception:  # (a config that cannot be read or mapped: no speech model)
        speech = False
    if not speech:
        raise errors.bad_request(
            f"the model {state.model_name!r} cannot transcribe audio: /v1/audio/transcriptions "
            "and /v1/audio/translations need an encoder-decoder speech model "
            "(WhisperForConditionalGeneration)",
            param="model",
        )
    assert multimodal is not None
    processor: Any = multimodal.processor()
    return SpeechModel(int(processor.sampling_rate), int(processor.window_samples))


async def speech_model(request: Request, state: ServerState) -> SpeechModel:
    """:func:`_speech_model`, computed once per app (in a worker thread)."""
    cached = getattr(request.app.state, "speech_model", None)
    if cached is None:
        cached = await asyncio.to_thread(_speech_model, state)
        request.app.state.speech_model = cached
    return cached


async def _form(request: Request) -> Any:
    if importlib.util.find_spec("python_multipart") is None:
        raise errors.APIError(
            500,
            "the audio routes parse multipart forms with python-multipart, which is not "
            "installed on this server: pip install python-multipart",
        )
    try:
        return await request.form()
    except StarletteHTTPException:  # (the body bound's 413, raised while the body is read)
        raise
    except Exception as exc:  # (a body that is not a multipart form)
        raise errors.bad_request(f"the body is not a readable multipart form: {exc}") from exc


def _field(form: Any, name: str) -> str | None:
    value = form.get(name)
    if value is None or isinstance(value, str):
        return value
    raise errors.bad_request(f"{name} must be a form field, not a file", param=name)


def _temperature(form: Any) -> float:
    text = _field(form, "temperature")
    if text is None or text == "":
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 2.0 or not math.isfinite(value):
        raise errors.bad_request(
            f"temperature must be a number from 0 to 2; got {text!r}", param="temperature"
        )
    return value


def _flag(form: Any, name: str) -> bool:
    text = (_field(form, name) or "false").strip().lower()
    if text not in ("true", "false", "1", "0"):
        raise errors.bad_request(f"{name} must be true or false; got {text!r}", param=name)
    return text in ("true", "1")


def _decoder_prompt(state: ServerState, language: str, task: str, prompt: str | None) -> list[int]:
    """The decoder prompt's ids (module docstring); 400 for a language without a token."""
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise errors.bad_request("the audio routes need the server's tokenizer")
    vocab = tokenizer.get_vocab()
    token = f"<|{language}|>"
    if token not in vocab:
        raise errors.bad_request(
            f"language {language!r} is not one the model knows (no {token} token)",
            param="language",
        )
    ids = []
    if prompt:  # (previous text without its marker would read as the transcript's start)
        if "<|startofprev|>" not in vocab:
            raise errors.bad_request(
                "the model's tokenizer has no <|startofprev|> token: prompt is not supported",
                param="prompt",
            )
        ids = [vocab["<|startofprev|>"]]
        ids += tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
    for special in ("<|startoftranscript|>", token, f"<|{task}|>", "<|notimestamps|>"):
        if special not in vocab:
            raise errors.bad_request(f"the model's tokenizer has no {special} token")
        ids.append(vocab[special])
    return ids


def _windows(data: bytes, model: SpeechModel) -> tuple[list[np.ndarray], float]:
    """The file's samples at the model's rate, cut into windows, and its duration (s)."""
    from chassis.core.audio_loading import decode_audio
    from chassis.core.audio_resampling import audio_waveform

    samples, rate = decode_audio(data, "the uploaded file")
    waveform = audio_waveform((samples, rate), model.sampling_rate)
    step = model.window_samples
    windows = [waveform[start : start + step] for start in range(0, len(waveform), step)]
    return windows, len(samples) / rate


async def _transcribe(request: Request, task: str) -> Response:
    from chassis.core.sampling_params import SamplingParams

    state: ServerState = request.app.state.chassis
    state.check_accepting()
    form = await _form(request)
    state.check_model(_field(form, "model") or None)  # (OpenAI's answer does not repeat it)
    response_format = _field(form, "response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise errors.bad_request(
            f"response_format {response_format!r} is not supported; supported: "
            f"{', '.join(RESPONSE_FORMATS)}",
            param="response_format",
        )
    temperature = _temperature(form)
    stream = _flag(form, "stream")
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise errors.bad_request("file (the audio file) is required", param="file")
    model = await speech_model(request, state)
    language = (_field(form, "language") or "").strip().lower() or DEFAULT_LANGUAGE
    prompt_ids = _decoder_prompt(state, language, task, _field(form, "prompt"))
    data = await upload.read()
    try:
        windows, duration = await asyncio.to_thread(_windows, data, model)
    except ValueError as exc:
        raise errors.bad_request(str(exc), param="file") from exc
    max_len = state.max_model_len or 0
    if max_len <= len(prompt_ids):
        raise errors.bad_request(
            f"the decoder prompt takes {len(prompt_ids)} tokens, the whole context "
            f"(--max-model-len {max_len}): shorten the prompt",
            param="prompt",
        )
    params = SamplingParams(temperature=temperature, max_tokens=max_len - len(prompt_ids))
    request_id = f"trsc-{uuid.uuid4().hex}"

    async def open_streams() -> list[AsyncIterator[Any]]:
        opened: list[AsyncIterator[Any]] = []
        try:
            for i, window in enumerate(windows):
                opened.append(
                    await state.open_stream(
                        list(prompt_ids),
                        params,
                        f"{request_id}-{i}",
                        multi_modal_data={"audio": (window, model.sampling_rate)},
                    )
                )
        except BaseException:
            for s in opened:
                await s.aclose()  # type: ignore[attr-defined]
            raise
        return opened

    try:
        streams = await cancel_on_disconnect(request, open_streams())
        if stream:
            return ClosingStreamingResponse(
                _events(streams),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        text = await cancel_on_disconnect(request, _collect(streams))
    except ClientDisconnected:
        return Response(status_code=499)
    except errors.APIError:
        raise
    except Exception as exc:
        raise errors.to_api_error(exc) from exc
    if response_format == "text":
        return PlainTextResponse(text)
    return JSONResponse(
        {"text": text, "usage": {"type": "duration", "seconds": math.ceil(duration)}}
    )


async def _window_texts(stream: AsyncIterator[Any]) -> AsyncIterator[str]:
    """The text pieces of one window's request, in order."""
    try:
        async for output in stream:
            piece = output.outputs[0].text if output.outputs else ""
            if piece:
                yield piece
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def _collect(streams: list[AsyncIterator[Any]]) -> str:
    texts = []
    for stream in streams:
        texts.append("".join([piece async for piece in _window_texts(stream)]))
    return "".join(texts)


async def _events(streams: list[AsyncIterator[Any]]) -> AsyncIterator[str]:
    texts: list[str] = []
    try:
        for stream in streams:
            async for piece in _window_texts(stream):
                texts.append(piece)
                yield sse(json.dumps({"type": "transcript.text.delta", "delta": piece}))
    except Exception as exc:
        yield sse(errors.stream_error_json(exc))
    else:
        yield sse(json.dumps({"type": "transcript.text.done", "text": "".join(texts)}))
    finally:
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE


@router.post("/v1/audio/transcriptions")
async def create_transcription(request: Request) -> Response:
    """OpenAI's transcriptions API (module docstring)."""
    return await _transcribe(request, "transcribe")


@router.post("/v1/audio/translations")
async def create_translation(request: Request) -> Response:
    """OpenAI's translations API: into English (module docstring)."""
    return await _transcribe(request, "translate")
