"""HTTPS for ``chassis serve``: the TLS settings are checked before the model loads.

uvicorn builds its own :class:`ssl.SSLContext` from the same files when it starts serving,
which is after the engine start-up (minutes for a large model); :func:`check_tls` builds one
first, so a missing file, a key that does not match its certificate, an encrypted key without
its password (or with a wrong one) or an unreadable CA bundle fails at once with the flag named.
An encrypted key is never prompted for on the terminal (OpenSSL's default): the password
comes from ``--ssl-keyfile-password`` or start-up fails.
"""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chassis.serve.settings import ServerSettings


def check_tls(settings: ServerSettings) -> ssl.SSLContext | None:
    """The server-side context ``settings`` describe (``None`` for plain HTTP).

    :raises ValueError: a certificate, key or CA file cannot be read or does not fit, or the
        key is encrypted and ``ssl_keyfile_password`` is missing or wrong.
    """
    if settings.ssl_certfile is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(
            settings.ssl_certfile,
            settings.ssl_keyfile,
            password=settings.ssl_keyfile_password or _no_password,
        )
    except _EncryptedKey:
        raise ValueError(
            f"--ssl-keyfile {settings.ssl_keyfile or settings.ssl_certfile!r}: the private key "
            "is encrypted; give its password with --ssl-keyfile-password"
        ) from None
    except (OSError, ssl.SSLError) as exc:
        if settings.ssl_keyfile is None:
            # without a key file the key must be in the certificate file; OpenSSL's own
            # error for a missing key ("PEM lib") does not say so
            raise ValueError(
                f"--ssl-certfile {settings.ssl_certfile!r}: cannot load the certificate and "
                f"its private key ({exc}); pass the key with --ssl-keyfile, or put it in the "
                "certificate file"
            ) from None
        raise ValueError(
            f"--ssl-certfile {settings.ssl_certfile!r} / --ssl-keyfile "
            f"{settings.ssl_keyfile!r}: cannot load the certificate and its key ({exc})"
            + ("; is --ssl-keyfile-password right?" if settings.ssl_keyfile_password else "")
        ) from None
    if settings.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(settings.ssl_ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"--ssl-ca-certs {settings.ssl_ca_certs!r}: cannot load the CA certificates ({exc})"
            ) from None
    context.verify_mode = ssl.VerifyMode(settings.ssl_cert_reqs)
    return context


class _EncryptedKey(Exception):
    """The key file asked for a password and none was given."""


def _no_password() -> str:
    # called by OpenSSL only for an encrypted key; instead of its terminal prompt, fail
    raise _EncryptedKey
