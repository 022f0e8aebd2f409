"""A media URL -> its bytes, with vLLM's media connector rules (images and videos share it).

A URL is one of:

* ``data:<kind>/<type>;base64,<data>``: the bytes, base64-encoded (the media type must be of
  the kind asked for: ``image/...`` for an image, ``video/...`` for a video);
* ``http://`` / ``https://``: fetched, within the fetcher's timeout (each kind has its own
  variable: :mod:`chassis.core.image_loading`, :mod:`chassis.core.video_loading`); with
  ``--allowed-media-domains`` only from those hosts (another host is refused before any
  connection is made);
* ``file://<path>``: read only when the engine was given ``--allowed-local-media-path``
  (``allowed_local_media_path``) and the file (links resolved) lies under that folder.

Anything else (another scheme, bad base64, a failed fetch, a refused file) is a
``ValueError`` whose message names the URL (a data URL cut short) and says what to change.
"""

from __future__ import annotations

import base64
import binascii
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


def timeout_from_env(variable: str, default_s: float) -> float:
    """``$variable`` in seconds (``default_s`` when unset or empty); ``ValueError`` when it
    is not a number > 0."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default_s
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"${variable} must be a number of seconds > 0; got {text!r}")
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


def check_allowed_media_domains(domains: Any) -> frozenset[str] | None:
    """``--allowed-media-domains`` as the set of host names http(s) media URLs may name,
    lower-cased (``None``: any host, vLLM's default); ``ValueError`` unless it is a list of
    host names (no scheme, path or port)."""
    if domains is None:
        return None
    if isinstance(domains, str) or not isinstance(domains, list | tuple | set | frozenset):
        raise ValueError(f"--allowed-media-domains takes host names; got {domains!r}")
    hosts = set()
    for domain in domains:
        if not isinstance(domain, str) or not domain.strip():
            raise ValueError(f"--allowed-media-domains takes host names; got {domain!r}")
        host = domain.strip().lower()
        if any(c in host for c in "/:@ ?#"):
            raise ValueError(
                f"--allowed-media-domains takes host names such as 'example.com' (no scheme, "
                f"port or path); got {domain!r}"
            )
        hosts.add(host)
    return frozenset(hosts)


def short_url(url: str, limit: int = 80) -> str:
    """``url`` for an error message: a data URL's payload (maybe megabytes) cut short."""
    return url if len(url) <= limit else url[:limit] + "..."


@dataclass(frozen=True)
class FetchedMedia:
    """A URL's bytes, and how a decode error names where they came from."""

    data: bytes
    #: ``the data URL 'data:...'``, ``the image at 'http...'``, ``the file '/path'``
    where: str


class MediaFetcher:
    """Reads media URLs (module docstring) of one ``kind`` (``"image"`` or ``"video"``: what
    messages call it and the media type a data URL must have).

    ``allowed_folder``: the folder ``file://`` URLs may read from (``None``: none, vLLM's
    default; :func:`check_allowed_local_media_path`); ``timeout_s``: the http(s) fetch
    timeout, named in its error as ``$timeout_env``; ``allowed_domains``: the hosts http(s)
    URLs may name (``None``: any, vLLM's default; :func:`check_allowed_media_domains`).
    """

    def __init__(
        self,
        kind: str,
        allowed_folder: Path | None,
        timeout_s: float,
        timeout_env: str,
        *,
        allowed_domains: frozenset[str] | None = None,
    ) -> None:
        self.kind = kind
        self.allowed_folder = allowed_folder
        self.timeout_s = timeout_s
        self.timeout_env = timeout_env
        self.allowed_domains = allowed_domains

    def fetch(self, url: str) -> FetchedMedia:
        """The bytes of ``url``, a string (the caller checked its type)."""
        scheme = urlsplit(url).scheme.lower()
        if scheme == "data":
            return self._data_url(url)
        if scheme in ("http", "https"):
            return self._http_url(url)
        if scheme == "file":
            return self._file_url(url)
        raise ValueError(
            f"{self.kind} URL {short_url(url)!r}: unsupported scheme {scheme or '(none)'!r}; "
            f"use a data:{self.kind}/...;base64, URL, an http(s) URL, or a file:// URL under "
            "--allowed-local-media-path"
        )

    def _data_url(self, url: str) -> FetchedMedia:
        header, sep, payload = url.partition(",")
        media_type, _, encoding = header[len("data:") :].partition(";")
        if not sep or encoding.lower() != "base64":
            raise ValueError(
                f"{self.kind} URL {short_url(url)!r}: only base64 data URLs are supported "
                f"(data:{self.kind}/<type>;base64,<data>)"
            )
        if media_type and not media_type.lower().startswith(f"{self.kind}/"):
            raise ValueError(
                f"{self.kind} URL {short_url(url)!r}: the data URL's media type is "
                f"{media_type!r}, not {'an' if self.kind[0] in 'aeiou' else 'a'} "
                f"{self.kind}/ type"
            )
        try:
            data = base64.b64decode(payload.strip(), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(
                f"{self.kind} URL {short_url(url)!r}: invalid base64 data ({exc})"
            ) from None
        return FetchedMedia(data, f"the data URL {short_url(url)!r}")

    def _http_url(self, url: str) -> FetchedMedia:
        if self.allowed_domains is not None:
            host = (urlsplit(url).hostname or "").lower()
            if host not in self.allowed_domains:
                raise ValueError(
                    f"{self.kind} URL {short_url(url)!r}: the host {host or '(none)'!r} is not "
                    "one of --allowed-media-domains ("
                    f"{', '.join(sorted(self.allowed_domains)) or 'none'})"
                )
        request = urllib.request.Request(url, headers={"User-Agent": "chassis"})
        late = (
            f"{self.kind} URL {short_url(url)!r}: no answer within {self.timeout_s:g} s "
            f"(${self.timeout_env})"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                data = response.read()
        except urllib.error.HTTPError as exc:
            raise ValueError(
                f"{self.kind} URL {short_url(url)!r}: the fetch failed with HTTP {exc.code}"
            ) from None
        except TimeoutError:
            raise ValueError(late) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                raise ValueError(late) from None
            raise ValueError(
                f"{self.kind} URL {short_url(url)!r}: the fetch failed ({reason})"
            ) from None
        return FetchedMedia(data, f"the {self.kind} at {short_url(url)!r}")

    def _file_url(self, url: str) -> FetchedMedia:
        if self.allowed_folder is None:
            raise ValueError(
                f"{self.kind} URL {short_url(url)!r}: local files cannot be read: the server "
                "was not started with --allowed-local-media-path (allowed_local_media_path)"
            )
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(
                f"{self.kind} URL {short_url(url)!r}: a file URL must name a local path "
                "(file:///path), not a host"
            )
        path = Path(unquote(parts.path)).resolve()
        if not path.is_relative_to(self.allowed_folder):
            raise ValueError(
                f"{self.kind} URL {short_url(url)!r}: the file must lie under "
                f"--allowed-local-media-path ({self.allowed_folder})"
            )
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ValueError(
                f"{self.kind} URL {short_url(url)!r}: the file cannot be read ({exc.strerror})"
            ) from None
        return FetchedMedia(data, f"the file {str(path)!r}")
