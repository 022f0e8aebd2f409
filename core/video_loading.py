"""Videos as chat requests send them -> sampled RGB frames and their timing (vLLM's
default video loader, decoding with PyAV).

A source is a URL string read as images are (:class:`~chassis.core.media_fetching.
MediaFetcher`: ``data:video/<type>;base64,<data>``, http(s), or ``file://`` under
``--allowed-local-media-path``), with its own fetch timeout, vLLM's
``$VLLM_VIDEO_FETCH_TIMEOUT`` (default 30 s: videos are larger than images).

The bytes are decoded with PyAV (``pip install av``, the ``video`` extra; without it a video
is a ``ValueError`` saying so). As vLLM's default loader does, at most ``num_frames`` (32;
``--media-io-kwargs '{"video": {"num_frames": N}}'``, -1: all) frames are kept, and with
``"fps": F`` at most ``duration * F`` (one at least), sampled uniformly over the whole video
(indices ``linspace(0, total - 1, count)`` truncated; every frame of a shorter video). The result
is vLLM's video item ``(frames, metadata)``: ``frames`` a ``[T, H, W, 3]`` ``uint8`` array,
``metadata`` transformers' ``VideoMetadata`` fields, ``total_num_frames``, ``fps`` (the
video's own rate), ``duration`` (seconds), ``frames_indices`` (the kept frames' indices) and
``video_backend`` ``"pyav"``; a model's processor reads the sampled rate from it
(:func:`chassis.core.multimodal_inputs.sampled_fps`).

Bytes that are no video PyAV reads, a video without a video stream or without a decodable
frame, and frames of more pixels than an image may have (the limit past which PIL refuses
an image as a decompression bomb) are ``ValueError``s naming the source.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from chassis.core.media_fetching import MediaFetcher, short_url, timeout_from_env

#: vLLM's variable and default for the seconds an http(s) video may take to fetch
FETCH_TIMEOUT_ENV = "VLLM_VIDEO_FETCH_TIMEOUT"
DEFAULT_FETCH_TIMEOUT_S = 30.0
#: vLLM's default number of frames its video loader keeps
DEFAULT_NUM_FRAMES = 32
#: what a video item's metadata says decoded it
VIDEO_BACKEND = "pyav"


def fetch_timeout() -> float:
    """``$VLLM_VIDEO_FETCH_TIMEOUT`` in seconds (default 30); ``ValueError`` when it is not a
    number > 0."""
    return timeout_from_env(FETCH_TIMEOUT_ENV, DEFAULT_FETCH_TIMEOUT_S)


#: the ``--media-io-kwargs`` keys of videos (vLLM's video loader's)
VIDEO_IO_KWARGS = ("num_frames", "fps")


def check_video_io_kwargs(kwargs: Any) -> None:
    """``ValueError`` unless ``kwargs`` (``--media-io-kwargs``' ``"video"`` object) holds only
    ``num_frames`` (an integer >= 1, or -1: every frame) and ``fps`` (a number > 0); a key
    set to ``None`` is the default."""
    if not isinstance(kwargs, dict):
        raise ValueError(f"--media-io-kwargs video must be a JSON object; got {kwargs!r}")
    unknown = sorted(set(kwargs) - set(VIDEO_IO_KWARGS))
    if unknown:
        raise ValueError(
            f"--media-io-kwargs video: {', '.join(unknown)} not supported; the keys are "
            f"{', '.join(VIDEO_IO_KWARGS)}"
        )
    num_frames, fps = kwargs.get("num_frames"), kwargs.get("fps")
    if num_frames is not None and (
        isinstance(num_frames, bool)
        or not isinstance(num_frames, int)
        or (num_frames != -1 and num_frames < 1)
    ):
        raise ValueError(
            f"--media-io-kwargs video num_frames must be an integer >= 1 (or -1: every "
            f"frame); got {num_frames!r}"
        )
    if fps is not None and (
        isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps < float("inf")
    ):
        raise ValueError(f"--media-io-kwargs video fps must be a number > 0; got {fps!r}")


def check_pyav() -> None:
    """``ValueError`` (a 400 at the server) when PyAV, the video decoder, is not installed."""
    try:
        import av  # noqa: F401
    except ImportError:
        raise ValueError(
            "video inputs need PyAV to decode them, and it is not installed: pip install av "
            "(or chassis-llm[video])"
        ) from None


def sample_frame_indices(
    total_num_frames: int,
    num_frames: int,
    fps: float | None = None,
    duration: float | None = None,
) -> list[int]:
    """The indices of the frames kept of a video of ``total_num_frames``: all of them when
    ``num_frames`` is ``-1`` or not under the total, else ``num_frames`` spread uniformly from
    the first to the last (vLLM's default loader: ``linspace`` truncated to integers). With
    ``fps`` (``--media-io-kwargs '{"video": {"fps": F}}'``) and the video's ``duration`` in
    seconds known, at most ``duration * fps`` frames (at least one) are kept, ``num_frames``
    still the most."""
    wanted = total_num_frames if num_frames == -1 else min(num_frames, total_num_frames)
    if fps and duration:
        wanted = min(wanted, max(1, int(duration * fps)))
    if wanted >= total_num_frames:
        return list(range(total_num_frames))
    return np.linspace(0, total_num_frames - 1, wanted, dtype=int).tolist()


def decode_video(
    data: bytes, where: str, num_frames: int = DEFAULT_NUM_FRAMES, fps: float | None = None
) -> tuple[np.ndarray, dict[str, Any]]:
    """The sampled frames of the video ``data`` and their metadata (module docstring);
    ``ValueError`` naming ``where`` (the source) for bytes PyAV cannot decode."""
    check_pyav()
    import av
    from PIL import Image

    try:
        total, video_fps, duration, size = _probe(data, where)
        # (the limit past which PIL refuses an image as a decompression bomb)
        limit = 2 * Image.MAX_IMAGE_PIXELS if Image.MAX_IMAGE_PIXELS else None
        if limit and size[0] * size[1] > limit:
            raise ValueError(
                f"{where}: the video's frames are too large to decode ({size[0]}x{size[1]} "
                f"pixels; an image may have at most {limit})"
            )
        wanted = sample_frame_indices(total, num_frames, fps, duration)
        frames, indices = _decode_frames(data, set(wanted), max(wanted))
    except av.FFmpegError as exc:  # (InvalidDataError and the others; their text is ffmpeg's)
        raise ValueError(f"{where} is not a video that can be read ({exc})") from None
    if not frames:
        raise ValueError(f"{where}: no frame of the video could be decoded")
    metadata = {
        "total_num_frames": total,
        "fps": video_fps,
        "duration": duration,
        "frames_indices": indices,
        "video_backend": VIDEO_BACKEND,
    }
    return np.stack(frames), metadata


def _probe(data: bytes, where: str) -> tuple[int, float | None, float | None, tuple[int, int]]:
    """The video's frame count, rate (``None``: unknown), duration in seconds (``None``:
    unknown) and frame size (width, height). The count is the container's, or, when it
    records none (Matroska, WebM), its video packets counted (no frame is decoded)."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video:
            raise ValueError(f"{where} holds no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else None
        size = (stream.codec_context.width, stream.codec_context.height)
        total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        if total <= 0:
            raise ValueError(f"{where}: the video has no frames")
        if fps:
            duration = total / fps
        else:  # (seconds from the container, as a last resort)
            duration = container.duration / av.time_base if container.duration else None
    return total, fps, duration, size


def _decode_frames(data: bytes, wanted: set[int], last: int) -> tuple[list[np.ndarray], list[int]]:
    """The frames at ``wanted`` indices (decode order) as RGB arrays, and their indices;
    decoding stops after frame ``last``. A video holding fewer frames than it claims gives
    the ones it has (as vLLM's loader, which then keeps fewer)."""
    import av

    frames: list[np.ndarray] = []
    indices: list[int] = []
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for index, frame in enumerate(container.decode(stream)):
            if index in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
                indices.append(index)
            if index >= last:
                break
    return frames, indices


class VideoLoader:
    """Loads video URLs (module docstring) for one engine's settings.

    ``allowed_folder``: the folder ``file://`` URLs may read from (``None``: none; the image
    loader's ``allowed_folder``); ``timeout_s``: the http(s) fetch timeout (``None``:
    :func:`fetch_timeout`); ``num_frames``: the most frames kept of a video (``-1``: all);
    ``fps``: the most frames kept per second of video (``None``: no such limit); both are
    ``--media-io-kwargs '{"video": {...}}'`` keys (:func:`check_video_io_kwargs`);
    ``allowed_domains``: the hosts http(s) URLs may name (``None``: any).
    """

    def __init__(
        self,
        allowed_folder: Path | None = None,
        timeout_s: float | None = None,
        num_frames: int = DEFAULT_NUM_FRAMES,
        *,
        fps: float | None = None,
        allowed_domains: frozenset[str] | None = None,
    ) -> None:
        check_video_io_kwargs({"num_frames": num_frames, "fps": fps})
        self.num_frames = num_frames
        self.fps = fps
        self.timeout_s = fetch_timeout() if timeout_s is None else timeout_s
        self._fetcher = MediaFetcher(
            "video",
            allowed_folder,
            self.timeout_s,
            FETCH_TIMEOUT_ENV,
            allowed_domains=allowed_domains,
        )

    def load(self, url: Any) -> tuple[np.ndarray, dict[str, Any]]:
        """vLLM's video item ``(frames, metadata)`` of ``url``, a URL string."""
        if not isinstance(url, str):
            raise ValueError(
                f"a video must be a URL string (data:, http(s):, file:); got {type(url).__name__}"
            )
        check_pyav()  # (before a fetch that could not be used)
        if url[:16].lower().startswith("data:video/jpeg"):
            raise ValueError(
                f"video URL {short_url(url)!r}: vLLM's comma-separated JPEG frames "
                "(data:video/jpeg) are not supported; send the video file's bytes (e.g. "
                "data:video/mp4;base64,...)"
            )
        fetched = self._fetcher.fetch(url)
        return decode_video(fetched.data, fetched.where, self.num_frames, self.fps)
