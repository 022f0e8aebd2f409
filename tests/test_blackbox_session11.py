"""Regressions found by trying session 11's features end to end as a user.

- ``--ssl-certfile`` without ``--ssl-keyfile``, on a certificate file that holds no key:
  OpenSSL's "PEM lib" error said nothing about the key; the message now names
  ``--ssl-keyfile`` (tested in ``test_server_tls_uds.py``, with that file's certificates).
- ``vllm_xargs`` with an integer beyond 64 bits was a 500 (msgpack ``OverflowError`` on the
  way to the engine core); ``SamplingParams`` now refuses it as a 400-worthy ``ValueError``.
"""

from __future__ import annotations

import pytest

from chassis.core.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "extra", [{"no_repeat_ngram_size": 10**30}, {"k": [-(2**64)]}, {"k": {"n": 2**64}}]
)
def test_extra_args_beyond_64_bits_are_a_value_error(extra: dict) -> None:
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=extra)
    SamplingParams(extra_args={"no_repeat_ngram_size": 2, "k": [2**63 - 1, -(2**63)]})
