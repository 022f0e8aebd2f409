"""How a pooling route sends its vectors: vLLM's ``embed_dtype``, ``endianness`` and
``encoding_format`` (``"float"``, ``"base64"``, ``"bytes"`` or ``"bytes_only"``).

* ``float``: each vector as a JSON list of its float32 values (``embed_dtype`` and
  ``endianness`` do not apply, as in vLLM);
* ``base64``: each vector's values cast to ``embed_dtype`` (``float32``, ``float16``,
  ``bfloat16``, ``fp8_e4m3``, ``fp8_e5m2``: round to nearest even, as torch casts), their
  bytes in ``endianness`` order (``native``: the server's), base64-encoded;
* ``bytes``: the same bytes, every vector's one after the other, as the whole body
  (``application/octet-stream``), with a ``metadata`` header holding the JSON a client needs
  to cut it up: ``{"id", "created", "model", "data": [{"index", "embed_dtype",
  "endianness", "start", "end", "shape"}], "usage"}`` (vLLM's shape). ``endianness`` there is
  the request's value as sent, ``"native"`` included (vLLM does not resolve it either): a
  client that does not share the server's byte order asks for ``big`` or ``little``;
* ``bytes_only``: the same body without the ``metadata`` header (vLLM's, for batches whose
  metadata would outgrow a client's header limit): the vectors come in input order, each
  ``embed_dtype``'s size times the vector's length bytes long (the embedding size, or
  ``dimensions``; on ``/pooling`` a classifier's number of labels), so a client that knows
  both cuts the body itself; the usage is not sent.

A vector holding a finite value beyond ``embed_dtype``'s largest finite one cannot be encoded
(float16 would make it infinite, fp8_e4m3 would clamp it): :func:`encode_vector` raises
``ValueError`` naming the type instead of sending a changed vector.
"""

from __future__ import annotations

import json
import sys
from typing import Literal

import numpy as np
import torch

EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
#: the formats whose answer is the raw bytes (``application/octet-stream``), not JSON
BINARY_FORMATS = ("bytes", "bytes_only")

#: ``embed_dtype`` -> the torch type the values are cast to
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

#: an integer type of each width: the cast values are reinterpreted as these to reach numpy
#: (which has no bfloat16 or fp8) and to swap their bytes
_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def encode_vector(values: list[float], embed_dtype: str, endianness: str) -> bytes:
    """``values`` cast to ``embed_dtype``, as bytes in ``endianness`` order. Raises
    ``ValueError`` when a finite value is beyond the type's range."""
    dtype = TORCH_DTYPES[embed_dtype]
    vector = torch.tensor(values, dtype=torch.float32)
    limit = torch.finfo(dtype).max
    if bool((torch.isfinite(vector) & (vector.abs() > limit)).any()):
        raise ValueError(
            f"the embedding has values beyond {embed_dtype}'s range (largest {limit:g}): it "
            "cannot be encoded with this embed_dtype; ask for float32 (or normalized vectors)"
        )
    cast = vector.to(dtype)
    array = cast.view(_BITS_DTYPES[cast.element_size()]).numpy()
    if endianness != "native" and endianness != sys.byteorder:
        array = array.byteswap()
    return array.tobytes()


def decode_vector(data: bytes, embed_dtype: str, endianness: str) -> torch.Tensor:
    """The inverse of :func:`encode_vector`: the values, in ``embed_dtype`` (for clients and
    tests)."""
    dtype = TORCH_DTYPES[embed_dtype]
    width = torch.empty(0, dtype=dtype).element_size()
    bits = _BITS_DTYPES[width]
    array = np.frombuffer(data, dtype=torch.empty(0, dtype=bits).numpy().dtype)
    if endianness != "native" and endianness != sys.byteorder:
        array = array.byteswap()
    return torch.from_numpy(array.copy()).view(dtype)


def bytes_body(
    vectors: list[list[float]],
    embed_dtype: str,
    endianness: str,
    *,
    request_id: str,
    created: int,
    model: str,
    num_prompt_tokens: int,
) -> tuple[bytes, str]:
    """The ``bytes`` answer: the body and its ``metadata`` header (JSON)."""
    chunks: list[bytes] = []
    items: list[dict[str, object]] = []
    offset = 0
    for index, vector in enumerate(vectors):
        chunk = encode_vector(vector, embed_dtype, endianness)
        items.append(
            {
                "index": index,
                "embed_dtype": embed_dtype,
                "endianness": endianness,
                "start": offset,
                "end": offset + len(chunk),
                "shape": [len(vector)],
            }
        )
        chunks.append(chunk)
        offset += len(chunk)
    metadata = {
        "id": request_id,
        "created": created,
        "model": model,
        "data": items,
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }
    return b"".join(chunks), json.dumps(metadata)
