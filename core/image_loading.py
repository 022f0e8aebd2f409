"""Images as requests send them -> RGB ``PIL.Image.Image`` (vLLM's media connector rules).

A source is a ``PIL.Image.Image`` or a URL string:

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

import base64
import binascii
import io
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:
    from PIL.Image import Image

#: vLLM's variable and default for the seconds an http(s) image may take to fetch
FETCH_TIMEOUT_ENV = "VLLM_IMAGE_FETCH_TIMEOUT"
DEFAULT_FETCH_TIMEOUT_S = 5.0


def fetch_timeout() -> float:
    """``$VLLM_IMAGE_FETCH_TIMEOUT`` in seconds (default 5); ``ValueError`` when it is not a
    number > 0."""
    text = os.environ.get(FETCH_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_FETCH_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"${FETCH_TIMEOUT_ENV} must be a number of seconds > 0; got {text!r}")
    return value


def check_allowed_local_media_path(path: str) -> Path | None:
    """``--allowed-local-media-path`` resolved (``None`` for ``""``: no local files);
    ``ValueError`` unless it is an existing folder."""
    if not path:
        return None
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise ValueError(
            f"--allowed-local-media-path {path!r} is not an existing folder; give the folder "
            "whose files requests may name as file:// URLs"
        )
    return folder


def to_rgb(image: Image) -> Image:
    """``image`` in RGB mode; transparency is composed onto white (as transformers'
    ``convert_rgb`` and vLLM do), so a transparent pixel reads as white, not black."""
    from PIL import Image as PILImage

    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def decode_image(data: bytes, where: str) -> Image:
    """Decoded image bytes in RGB; ``ValueError`` naming ``where`` (the source) when they
    are not an image PIL reads, or decode to more pixels than PIL's bomb limit."""
    from PIL import Image as PILImage

    try:
        # (not closed: close() would free the decoded pixels; the bytes are in memory)
        opened = PILImage.open(io.BytesIO(data))
        opened.load()
        return to_rgb(opened)
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
    :func:`fetch_timeout`).
    """

    def __init__(self, allowed_local_media_path: str = "", timeout_s: float | None = None):
        self.allowed_folder = check_allowed_local_media_path(allowed_local_media_path)
        self.timeout_s = fetch_timeout() if timeout_s is None else timeout_s

    def load(self, source: Any) -> Image:
        """The RGB image of ``source``: a ``PIL.Image.Image`` or a URL string."""
        from PIL import Image as PILImage

        if isinstance(source, PILImage.Image):
            try:
                source.load()
                return to_rgb(source)
            except OSError as exc:  # a lazily opened file that turns out broken
                raise ValueError(f"the image cannot be read ({exc})") from None
        if not isinstance(source, str):
            raise ValueError(
                "an image must be a PIL.Image.Image or a URL string (data:, http(s):, file:); "
                f"got {type(source).__name__}"
            )
        scheme = urlsplit(source).scheme.lower()
        if scheme == "data":
            return self._data_url(source)
        if scheme in ("http", "https"):
            return self._http_url(source)
        if scheme == "file":
            return self._file_url(source)
        raise ValueError(
            f"image URL {_short(source)!r}: unsupported scheme {scheme or '(none)'!r}; use a "
            "data:image/...;base64, URL, an http(s) URL, or a file:// URL under "
            "--allowed-local-media-path"
        )

    def _data_url(self, url: str) -> Image:
        header, sep, payload = url.partition(",")
        media_type, _, encoding = header[len("data:") :].partition(";")
        if not sep or encoding.lower() != "base64":
            raise ValueError(
                f"image URL {_short(url)!r}: only base64 data URLs are supported "
                "(data:image/<type>;base64,<data>)"
            )
        if media_type and not media_type.lower().startswith("image/"):
            raise ValueError(
                f"image URL {_short(url)!r}: the data URL's media type is {media_type!r}, "
                "not an image/ type"
            )
        try:
            data = base64.b64decode(payload.strip(), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"image URL {_short(url)!r}: invalid base64 data ({exc})") from None
        return decode_image(data, f"the data URL {_short(url)!r}")

    def _http_url(self, url: str) -> Image:
        request = urllib.request.Request(url, headers={"User-Agent": "chassis"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                data = response.read()
        except urllib.error.HTTPError as exc:
            raise ValueError(
                f"image URL {_short(url)!r}: the fetch failed with HTTP {exc.code}"
            ) from None
        except TimeoutError:
            raise ValueError(
                f"image URL {_short(url)!r}: no answer within {self.timeout_s:g} s "
                f"(${FETCH_TIMEOUT_ENV})"
            ) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                raise ValueError(
                    f"image URL {_short(url)!r}: no answer within {self.timeout_s:g} s "
                    f"(${FETCH_TIMEOUT_ENV})"
                ) from None
            raise ValueError(f"image URL {_short(url)!r}: the fetch failed ({reason})") from None
        return decode_image(data, f"the image at {_short(url)!r}")

    def _file_url(self, url: str) -> Image:
        if self.allowed_folder is None:
            raise ValueError(
                f"image URL {_short(url)!r}: local files cannot be read: the server was not "
                "started with --allowed-local-media-path (allowed_local_media_path)"
            )
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(
                f"image URL {_short(url)!r}: a file URL must name a local path "
                "(file:///path), not a host"
            )
        path = Path(unquote(parts.path)).resolve()
        if not path.is_relative_to(self.allowed_folder):
            raise ValueError(
                f"image URL {_short(url)!r}: the file must lie under --allowed-local-media-path "
                f"({self.allowed_folder})"
            )
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ValueError(
                f"image URL {_short(url)!r}: the file cannot be read ({exc.strerror})"
            ) from None
        return decode_image(data, f"the file {str(path)!r}")


def _short(url: str, limit: int = 80) -> str:
    """``url`` for an error message: a data URL's payload (maybe megabytes) cut short."""
    return url if len(url) <= limit else url[:limit] + "..."
