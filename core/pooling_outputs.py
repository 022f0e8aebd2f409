"""What ``LLM.embed`` and ``AsyncLLM.encode`` return: vLLM's embedding outputs, in shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from chassis.core.outputs import RequestMetrics
    from chassis.core.request import RequestError

#: how the engine core sends a pooled vector: raw little-endian float32 bytes
POOLED_DTYPE = np.dtype("<f4")


@dataclass
class EmbeddingOutput:
    """One request's vector (after pooling, optional truncation and normalization)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """The vector's length (vLLM's name)."""
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The result of one pooling request, as vLLM's ``EmbeddingRequestOutput``.

    ``finished`` is ``True`` once the vector is there; an engine that refused the request
    leaves ``outputs.embedding`` empty and ``finish_reason`` ``"abort"``, with ``error``
    saying why when the engine core refused it (its LoRA adapter cannot be loaded, say).
    """

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0
    finish_reason: str = "stop"
    #: why the engine core refused the request (``EngineCoreOutput.error``), if it did
    error: RequestError | None = None
    #: arrival, first scheduling and finish times (``time.time()``), when known
    metrics: RequestMetrics | None = None


def decode_pooled(data: bytes) -> list[float]:
    """A vector the engine core sent (:data:`POOLED_DTYPE` bytes) as Python floats."""
    return np.frombuffer(data, dtype=POOLED_DTYPE).tolist()


def encode_pooled(embedding: list[float]) -> bytes:
    """``embedding`` as :data:`POOLED_DTYPE` bytes (what OpenAI's ``base64`` format holds);
    exact for vectors that came from :func:`decode_pooled`."""
    return np.asarray(embedding, dtype=POOLED_DTYPE).tobytes()
