"""The engine's media flags checked, and the media loaders they configure.

vLLM's ``--media-io-kwargs`` (how media are loaded, per modality), ``--allowed-media-domains``
(the hosts http(s) media URLs may name), ``--mm-processor-kwargs`` (the processor's defaults:
only its type is checked here; its keys are the model's, checked once the model's processor
exists: :class:`~chassis.core.multimodal_inputs.MultiModalInputs`) and
``--mm-processor-cache-gb``. ``--media-io-kwargs`` keys:

* ``"video"``: ``num_frames`` (the most frames kept, default 32; -1: all) and ``fps`` (the
  most frames kept per second of video), as vLLM's video loader takes them
  (:mod:`chassis.core.video_loading`);
* ``"image"``: ``rgba_background_color`` (``[r, g, b]``, 0-255: what transparent pixels are
  composed onto, white by default; vLLM's ``ImageMediaIO`` key).

Any other modality or key is a ``ValueError`` when the engine's config is made (start-up).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from chassis.core.audio_loading import AudioLoader
from chassis.core.image_loading import WHITE, ImageLoader
from chassis.core.media_fetching import check_allowed_media_domains
from chassis.core.video_loading import DEFAULT_NUM_FRAMES, VideoLoader, check_video_io_kwargs

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig

#: the ``--media-io-kwargs`` keys of images
IMAGE_IO_KWARGS = ("rgba_background_color",)


def check_media_options(config: EngineConfig) -> None:
    """``ValueError`` naming the flag for an invalid ``mm_processor_kwargs`` (not a dict),
    ``media_io_kwargs`` (module docstring), ``allowed_media_domains`` or
    ``mm_processor_cache_gb`` (a number >= 0)."""
    kwargs = config.mm_processor_kwargs
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(
            f"--mm-processor-kwargs must be a JSON object; got {type(kwargs).__name__} {kwargs!r}"
        )
    check_media_io_kwargs(config.media_io_kwargs)
    check_allowed_media_domains(config.allowed_media_domains)
    gb = config.mm_processor_cache_gb
    if isinstance(gb, bool) or not isinstance(gb, int | float) or not 0 <= gb < math.inf:
        raise ValueError(
            f"--mm-processor-cache-gb must be a number of GiB >= 0 (0: no cache); got {gb!r}"
        )


def check_media_io_kwargs(value: Any) -> None:
    """``ValueError`` unless ``value`` is ``None`` or ``--media-io-kwargs``' object of
    per-modality objects (module docstring)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(
            '--media-io-kwargs must be a JSON object like {"video": {"num_frames": 16}}; got '
            f"{value!r}"
        )
    unknown = sorted(set(value) - {"image", "video"})
    if unknown:
        raise ValueError(
            f"--media-io-kwargs: {', '.join(map(str, unknown))} not supported; it takes "
            '"image" ({"rgba_background_color": [r, g, b]}) and "video" ({"num_frames": N, '
            '"fps": F})'
        )
    if "video" in value:
        check_video_io_kwargs(value["video"])
    if "image" in value:
        _background_color(value["image"])


def _background_color(image_kwargs: Any) -> tuple[int, int, int]:
    """The ``rgba_background_color`` of ``--media-io-kwargs``' ``"image"`` object (white when
    unset); ``ValueError`` for another key or a colour that is not three integers 0-255."""
    if not isinstance(image_kwargs, dict):
        raise ValueError(f"--media-io-kwargs image must be a JSON object; got {image_kwargs!r}")
    unknown = sorted(set(image_kwargs) - set(IMAGE_IO_KWARGS))
    if unknown:
        raise ValueError(
            f"--media-io-kwargs image: {', '.join(unknown)} not supported; the key is "
            f"{', '.join(IMAGE_IO_KWARGS)}"
        )
    color = image_kwargs.get("rgba_background_color")
    if color is None:
        return WHITE
    if (
        not isinstance(color, list | tuple)
        or len(color) != 3
        or not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 255 for c in color)
    ):
        raise ValueError(
            "--media-io-kwargs image rgba_background_color must be [r, g, b], integers 0-255; "
            f"got {color!r}"
        )
    return (int(color[0]), int(color[1]), int(color[2]))


def media_loaders(config: Any) -> tuple[ImageLoader, VideoLoader, AudioLoader]:
    """The image, video and audio loaders of ``config`` (an :class:`EngineConfig`; a
    stand-in lacking the media fields gets vLLM's defaults): its local folder, allowed
    domains (all three) and ``--media-io-kwargs`` (images and videos; audio takes none), in
    :class:`~chassis.core.chat_media.ChatImages`' argument order. ``ValueError`` for a
    folder that does not exist."""
    domains = check_allowed_media_domains(getattr(config, "allowed_media_domains", None))
    io_kwargs = getattr(config, "media_io_kwargs", None) or {}
    image = ImageLoader(
        getattr(config, "allowed_local_media_path", "") or "",
        allowed_domains=domains,
        background_color=_background_color(io_kwargs.get("image", {})),
    )
    video_kwargs = io_kwargs.get("video", {})
    video = VideoLoader(
        image.allowed_folder,
        num_frames=video_kwargs.get("num_frames") or DEFAULT_NUM_FRAMES,
        fps=video_kwargs.get("fps"),
        allowed_domains=domains,
    )
    audio = AudioLoader(image.allowed_folder, allowed_domains=domains)
    return image, video, audio
