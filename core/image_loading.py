"""Images as requests send them -> RGB ``PIL.Image.Image`` (vLLM's media connector rules).

A source is a ``PIL.Image.Image`` or a URL string, read by
:class:`~chassis.core.media_fetching.MediaFetcher` (shared with videos):

* ``data:image/<type>;base64,<data>``: the image's bytes, base64-encoded;
* ``http://`` / ``https://``: fetched, with a timeout of ``$VLLM_IMAGE_FETCH_TIMEOUT``
  seconds (vLLM's variable; default 5);
* ``file://<path>``: read only when the engine was given ``--allowed-local-media-path``
  (``allowed_local_media_path``) and the file (links resolved) lies under that folder.

Every image comes back decoded and converted to RGB; a transparent one is put on white, as
transformers' and vLLM's conversions do. Anything else (another scheme, bad base64, bytes
that are no image, a failed fetch, a refused file) is a ``ValueError`` whose message a
client can act on.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from chassis.core.media_fetching import (
    MediaFetcher,
    check_allowed_local_media_path,
    timeout_from_env,
)

if TYPE_CHECKING:
    from PIL.Image import Image

#: vLLM's variable and default for the seconds an http(s) image may take to fetch
FETCH_TIMEOUT_ENV = "VLLM_IMAGE_FETCH_TIMEOUT"
DEFAULT_FETCH_TIMEOUT_S = 5.0


def fetch_timeout() -> float:
    """``$VLLM_IMAGE_FETCH_TIMEOUT`` in seconds (default 5); ``ValueError`` when it is not a
    number > 0."""
    return timeout_from_env(FETCH_TIMEOUT_ENV, DEFAULT_FETCH_TIMEOUT_S)


#: the colour transparent pixels are composed onto (vLLM's ``rgba_background_color``)
WHITE = (255, 255, 255)


def to_rgb(image: Image, background_color: tuple[int, int, int] = WHITE) -> Image:
    """``image`` in RGB mode; transparency is composed onto ``background_color`` (white by
    default, as transformers' ``convert_rgb`` and vLLM do), so a transparent pixel reads as
    white, not black."""
    from PIL import Image as PILImage

    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = PILImage.new("RGBA", rgba.size, (*background_color, 255))
        return PILImage.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def decode_image(data: bytes, where: str, background_color: tuple[int, int, int] = WHITE) -> Image:
    """Decoded image bytes in RGB (transparency on ``background_color``); ``ValueError``
    naming ``where`` (the source) when they are not an image PIL reads, or decode to more
    pixels than PIL's bomb limit."""
    from PIL import Image as PILImage

    try:
        # (not closed: close() would free the decoded pixels; the bytes are in memory)
        opened = PILImage.open(io.BytesIO(data))
        opened.load()
        return to_rgb(opened, background_color)
    except PILImage.DecompressionBombError as exc:
        raise ValueError(f"{where}: the image is too large to decode: {exc}") from None
    except PILImage.UnidentifiedImageError:  # (its message names an in-memory object)
        raise ValueError(
            f"{where} is not an image that can be read (not a format Pillow recognizes)"
        ) from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"{where} is not an image that can be read ({exc})") from None


class ImageLoader:
    """Loads image sources (module docstring) for one engine's settings.

    ``allowed_local_media_path``: the folder ``file://`` URLs may read from (``""``: none,
    vLLM's default); ``timeout_s``: the http(s) fetch timeout (``None``:
    :func:`fetch_timeout`); ``allowed_domains``: the hosts http(s) URLs may name (``None``:
    any; ``--allowed-media-domains``); ``background_color``: what transparent pixels are
    composed onto (``--media-io-kwargs '{"image": {"rgba_background_color": [r, g, b]}}'``).
    """

    def __init__(
        self,
        allowed_local_media_path: str = "",
        timeout_s: float | None = None,
        *,
        allowed_domains: frozenset[str] | None = None,
        background_color: tuple[int, int, int] = WHITE,
    ):
        self.allowed_folder = check_allowed_local_media_path(allowed_local_media_path)
        self.allowed_domains = allowed_domains
        self.background_color = background_color
        self.timeout_s = fetch_timeout() if timeout_s is None else timeout_s
        self._fetcher = MediaFetcher(
            "image",
            self.allowed_folder,
            self.timeout_s,
            FETCH_TIMEOUT_ENV,
            allowed_domains=allowed_domains,
        )

    def load(self, source: Any) -> Image:
        """The RGB image of ``source``: a ``PIL.Image.Image`` or a URL string."""
        from PIL import Image as PILImage

        if isinstance(source, PILImage.Image):
            try:
                source.load()
                return to_rgb(source, self.background_color)
            except OSError as exc:  # a lazily opened file that turns out broken
                raise ValueError(f"the image cannot be read ({exc})") from None
        if not isinstance(source, str):
            raise ValueError(
                "an image must be a PIL.Image.Image or a URL string (data:, http(s):, file:); "
                f"got {type(source).__name__}"
            )
        fetched = self._fetcher.fetch(source)
        return decode_image(fetched.data, fetched.where, self.background_color)
