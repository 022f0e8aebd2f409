"""Regressions found by trying session 11's features end to end as a user.

- ``--ssl-certfile`` without ``--ssl-keyfile``, on a certificate file that holds no key:
  OpenSSL's "PEM lib" error said nothing about the key; the message now names
  ``--ssl-keyfile`` (a file holding both still works, as with uvicorn).
- ``vllm_xargs`` with an integer beyond 64 bits was a 500 (msgpack ``OverflowError`` on the
  way to the engine core); ``SamplingParams`` now refuses it as a 400-worthy ``ValueError``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from chassis.core.sampling_params import SamplingParams
from chassis.serve.settings import ServerSettings
from chassis.serve.tls import check_tls


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``cert.pem`` and ``key.pem`` (self-signed, CN=localhost), and ``both.pem`` = the two."""
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem",
         "-out", "cert.pem", "-days", "1", "-subj", "/CN=localhost"],
        cwd=d, check=True, capture_output=True,
    )  # fmt: skip
    (d / "both.pem").write_text((d / "cert.pem").read_text() + (d / "key.pem").read_text())
    return d


def test_certfile_without_keyfile_names_the_missing_key(self_signed: Path) -> None:
    with pytest.raises(ValueError, match=r"--ssl-certfile .*pass the key with --ssl-keyfile"):
        check_tls(ServerSettings(ssl_certfile=str(self_signed / "cert.pem")))
    # a certificate file that holds the key needs no --ssl-keyfile
    assert check_tls(ServerSettings(ssl_certfile=str(self_signed / "both.pem"))) is not None
    context = check_tls(
        ServerSettings(
            ssl_certfile=str(self_signed / "cert.pem"), ssl_keyfile=str(self_signed / "key.pem")
        )
    )
    assert context is not None


@pytest.mark.parametrize(
    "extra", [{"no_repeat_ngram_size": 10**30}, {"k": [-(2**64)]}, {"k": {"n": 2**64}}]
)
def test_extra_args_beyond_64_bits_are_a_value_error(extra: dict) -> None:
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=extra)
    SamplingParams(extra_args={"no_repeat_ngram_size": 2, "k": [2**63 - 1, -(2**63)]})
