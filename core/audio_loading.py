"""Audio as chat requests send it -> vLLM's audio item ``(waveform, sample_rate)``, decoding
with PyAV.

Two sources: an ``audio_url`` part's URL, read as images and videos are
(:class:`~chassis.core.media_fetching.MediaFetcher`: ``data:audio/<type>;base64,<data>``,
http(s) within vLLM's ``$VLLM_AUDIO_FETCH_TIMEOUT`` (default 10 s) from the hosts
``--allowed-media-domains`` allows, or ``file://`` under ``--allowed-local-media-path``);
and an ``input_audio`` part's (OpenAI's) base64 ``data`` with its ``format``, ``"wav"`` or
``"mp3"``.

The bytes are decoded with PyAV (``pip install av``: the ``audio`` and ``video`` extras;
without it an audio is a ``ValueError`` saying so): the first audio stream, its channels
averaged into one (as librosa's ``to_mono``, which vLLM's loader uses), float32 samples at
the stream's own rate. The model's processor resamples to its rate
(:mod:`chassis.core.audio_resampling`). Bytes PyAV cannot read, and a file without an audio
stream or without samples, are ``ValueError``s naming the source.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

import numpy as np

from chassis.core.media_fetching import MediaFetcher, timeout_from_env

#: vLLM's variable and default for the seconds an http(s) audio may take to fetch
FETCH_TIMEOUT_ENV = "VLLM_AUDIO_FETCH_TIMEOUT"
DEFAULT_FETCH_TIMEOUT_S = 10.0
#: the ``input_audio`` formats taken (OpenAI's)
INPUT_AUDIO_FORMATS = ("wav", "mp3")


def check_pyav_for_audio() -> None:
    """``ValueError`` (a 400 at the server) when PyAV, the audio decoder, is not installed."""
    try:
        import av  # noqa: F401
    except ImportError:
        raise ValueError(
            "audio inputs need PyAV to decode them, and it is not installed: pip install av "
            "(or chassis-llm[audio])"
        ) from None


def decode_audio(data: bytes, where: str) -> tuple[np.ndarray, int]:
    """The mono float32 samples of the audio file ``data`` and its sample rate (module
    docstring); ``ValueError`` naming ``where`` for bytes that hold no readable audio."""
    check_pyav_for_audio()
    import av

    chunks: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise ValueError(f"{where} holds no audio stream")
            stream = container.streams.audio[0]
            rate = int(stream.codec_context.sample_rate or stream.rate or 0)
            if rate <= 0:
                raise ValueError(f"{where}: the audio stream has no sample rate")
            # planar float32 in the stream's own layout: [channels, samples] per frame
            planar = av.AudioResampler(format="fltp", layout=stream.layout, rate=rate)
            for frame in container.decode(stream):
                chunks.extend(out.to_ndarray().mean(axis=0) for out in planar.resample(frame))
            # (what the resampler still holds)
            chunks.extend(out.to_ndarray().mean(axis=0) for out in planar.resample(None))
    except av.FFmpegError as exc:  # (InvalidDataError and the others; their text is ffmpeg's)
        raise ValueError(f"{where} is not an audio file that can be read ({exc})") from None
    waveform = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    if waveform.size == 0:
        raise ValueError(f"{where}: the audio has no samples")
    return waveform.astype(np.float32, copy=False), rate


class AudioLoader:
    """Loads chat audio parts (module docstring) for one engine's settings.

    ``allowed_folder``: the folder ``file://`` URLs may read from (``None``: none);
    ``timeout_s``: the http(s) fetch timeout (``None``: ``$VLLM_AUDIO_FETCH_TIMEOUT``, 10 s);
    ``allowed_domains``: the hosts http(s) URLs may name (``None``: any;
    ``--allowed-media-domains``).
    """

    def __init__(
        self,
        allowed_folder: Path | None = None,
        timeout_s: float | None = None,
        *,
        allowed_domains: frozenset[str] | None = None,
    ) -> None:
        if timeout_s is None:
            timeout_s = timeout_from_env(FETCH_TIMEOUT_ENV, DEFAULT_FETCH_TIMEOUT_S)
        self._fetcher = MediaFetcher(
            "audio",
            allowed_folder,
            timeout_s,
            FETCH_TIMEOUT_ENV,
            allowed_domains=allowed_domains,
        )

    def load_url(self, url: Any) -> tuple[np.ndarray, int]:
        """The audio item of ``url``, a URL string."""
        if not isinstance(url, str) or not url:
            raise ValueError(
                "an audio_url part needs a URL string (data:audio/...;base64, http(s), file:)"
            )
        check_pyav_for_audio()  # (before a fetch that could not be used)
        fetched = self._fetcher.fetch(url)
        return decode_audio(fetched.data, fetched.where)

    def load_input_audio(self, data: Any, audio_format: Any) -> tuple[np.ndarray, int]:
        """The audio item of an ``input_audio`` part's base64 ``data`` in ``audio_format``."""
        if audio_format not in INPUT_AUDIO_FORMATS:
            raise ValueError(
                f"input_audio format must be one of {', '.join(INPUT_AUDIO_FORMATS)}; got "
                f"{audio_format!r}"
            )
        if not isinstance(data, str) or not data:
            raise ValueError("input_audio needs its audio file's bytes as base64 in 'data'")
        check_pyav_for_audio()
        try:
            raw = base64.b64decode(data.strip(), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"input_audio data is not valid base64 ({exc})") from None
        return decode_audio(raw, f"the input_audio ({audio_format})")
