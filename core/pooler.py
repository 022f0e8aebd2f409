"""Pooling in the model runner: a prompt's final hidden states -> one vector, on the device.

A pooling request is prefill only. Its prompt may be computed over several steps (chunked
prefill), so the runner keeps, per request, what the earlier chunks contributed: the running
sum of the hidden states (``MEAN``, ``MEAN_SQRT_LEN``; position-weighted for
``WEIGHTED_MEAN``), their running elementwise max
(``MAX``) or the first token's state (``CLS``); ``LAST`` needs only the chunk that ends the
prompt. When a request's last chunk is computed its vector is finished, in
sentence-transformers' order: the checkpoint's ``Dense`` and ``LayerNorm`` modules
(:class:`~chassis.core.pooling_dense.DenseChain`), then :func:`finish_vector` (Matryoshka
truncation, then L2 normalization), and copied to the host as float32 bytes
(:data:`~chassis.core.pooling_outputs.POOLED_DTYPE`).

:func:`pool_reference` and :func:`finish_vector` are the obviously-correct versions of one
whole sequence that tests compare the batched path (:class:`Pooler`) with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from chassis.core.pooling_dense import DenseChain
from chassis.core.pooling_outputs import POOLED_DTYPE

if TYPE_CHECKING:
    from chassis.core.pooling_config import PoolerConfig
    from chassis.core.pooling_params import PoolingParams
    from chassis.core.scheduler_interface import SchedulerOutput


def pool_reference(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """``[num_tokens, hidden]`` states of one whole prompt -> its ``[hidden]`` float32
    vector: the last token's (``LAST``), the mean (``MEAN``), the first token's (``CLS``),
    the elementwise max (``MAX``), the sum over the square root of the token count
    (``MEAN_SQRT_LEN``, sentence-transformers' ``mean_sqrt_len_tokens``) or the mean
    weighted by position, token ``i`` (from 0) by ``i + 1`` (``WEIGHTED_MEAN``,
    sentence-transformers' ``weightedmean_tokens``)."""
    hidden = hidden.float()
    if pooling_type == "LAST":
        return hidden[-1]
    if pooling_type == "MEAN":
        return hidden.mean(dim=0)
    if pooling_type == "CLS":
        return hidden[0]
    if pooling_type == "MAX":
        return hidden.max(dim=0).values
    if pooling_type == "MEAN_SQRT_LEN":
        return hidden.sum(dim=0) / math.sqrt(hidden.shape[0])
    if pooling_type == "WEIGHTED_MEAN":
        weights = torch.arange(1, hidden.shape[0] + 1, dtype=torch.float32, device=hidden.device)
        return (hidden * weights[:, None]).sum(dim=0) / weights.sum()
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def finish_vector(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Keep the first ``dimensions`` values (all when ``None``), then L2-normalize if asked
    (truncate first: a Matryoshka prefix is normalized on its own, as vLLM does)."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    return F.normalize(vector, p=2, dim=-1) if normalize else vector


@dataclass
class _PoolingRequest:
    """The runner's state of one pooling request between its chunks."""

    params: PoolingParams
    num_prompt_tokens: int
    #: what the chunks so far contributed: their (weighted) sum (``MEAN``,
    #: ``MEAN_SQRT_LEN``, ``WEIGHTED_MEAN``), their
    #: elementwise max (``MAX``), the first token's state (``CLS``); ``None`` before the
    #: first chunk or for ``LAST``
    partial: torch.Tensor | None = None


class Pooler:
    """The pooling requests in one runner's batch, and the step that pools them.

    Every request of a pooling engine is a pooling request; ``config`` is the engine's. Its
    ``Dense`` and ``LayerNorm`` modules' weights are loaded on ``device`` here.
    """

    def __init__(self, config: PoolerConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self._requests: dict[str, _PoolingRequest] = {}
        #: the checkpoint's Dense and LayerNorm modules, run on each finished vector; None
        #: without any
        self.dense = DenseChain(config.dense, device) if config.dense else None

    def update(self, out: SchedulerOutput) -> None:
        """Apply a plan's diff: forget finished (or preempted) requests, start new ones.

        Raises ``RuntimeError`` for a new request that starts past token 0 when the pooler
        needs every token (prefix caching must be off for ``MEAN`` and ``CLS``).
        """
        for request_id in out.finished_request_ids:
            self._requests.pop(request_id, None)
        for new in out.new_requests:
            if self.config.needs_every_token and new.num_computed_tokens:
                raise RuntimeError(
                    f"pooling request {new.request_id!r} starts at token "
                    f"{new.num_computed_tokens}, but {self.config.pooling_type} pooling needs "
                    "every token's hidden state: prefix caching must be off"
                )
            if new.pooling_params is None:
                raise RuntimeError(
                    f"request {new.request_id!r} reached a pooling runner without "
                    "pooling_params (this engine runs pooling requests only)"
                )
            self._requests[new.request_id] = _PoolingRequest(
                new.pooling_params, len(new.prompt_token_ids) + len(new.output_token_ids)
            )

    def pool(
        self,
        hidden: torch.Tensor,
        request_ids: list[str],
        starts: np.ndarray,
        num_scheduled: np.ndarray,
        query_start_loc: np.ndarray,
    ) -> dict[str, bytes]:
        """Pool one step's ``hidden`` states ``[num_tokens, hidden]``, laid out as the step's
        requests ``request_ids`` (request ``i`` computed positions ``starts[i]`` to
        ``starts[i] + num_scheduled[i]``, at rows ``query_start_loc[i]`` onwards).

        Returns request id -> its finished vector (float32 bytes) for each request whose
        prompt this step completes; the others keep their partial state. One device-to-host
        copy per step that finishes a request.
        """
        requests = [self._requests[r] for r in request_ids]
        prompt_lens = np.fromiter((r.num_prompt_tokens for r in requests), np.int64, len(requests))
        done = np.nonzero(starts + num_scheduled >= prompt_lens)[0]
        kind = self.config.pooling_type
        if kind == "LAST":
            if not len(done):
                return {}
            vectors = hidden[self._index(query_start_loc[1:][done] - 1)].float()
        elif kind == "CLS":
            vectors = self._cls_step(hidden, requests, starts, query_start_loc, done)
        else:
            vectors = self._reduce_step(
                hidden, requests, starts, num_scheduled, query_start_loc, done, prompt_lens
            )
        if vectors is None:
            return {}
        if self.dense is not None:
            vectors = self.dense(vectors)
        return self._finish([request_ids[i] for i in done], [requests[i] for i in done], vectors)

    def _index(self, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(self.device)

    def _reduce_step(
        self,
        hidden: torch.Tensor,
        requests: list[_PoolingRequest],
        starts: np.ndarray,
        num_scheduled: np.ndarray,
        query_start_loc: np.ndarray,
        done: np.ndarray,
        prompt_lens: np.ndarray,
    ) -> torch.Tensor | None:
        """``MEAN``, ``MEAN_SQRT_LEN``, ``WEIGHTED_MEAN`` (a running sum, of the states times
        their position + 1 for the last) and ``MAX`` (a running max)."""
        # One segment reduction for the whole step (float32, as the reference's).
        kind = self.config.pooling_type
        is_max = kind == "MAX"
        segment = self._index(np.repeat(np.arange(len(requests)), num_scheduled))
        shape = (len(requests), hidden.shape[-1])
        if is_max:
            reduced = torch.full(shape, -math.inf, dtype=torch.float32, device=hidden.device)
            index = segment[:, None].expand(-1, hidden.shape[-1])
            reduced.scatter_reduce_(0, index, hidden.float(), "amax")
        else:
            states = hidden.float()
            if kind == "WEIGHTED_MEAN":  # token i of the prompt (from 0) weighs i + 1
                offsets = np.arange(int(num_scheduled.sum())) - np.repeat(
                    query_start_loc[:-1], num_scheduled
                )
                weights = (np.repeat(starts, num_scheduled) + offsets + 1).astype(np.float32)
                states = states * torch.from_numpy(weights).to(states.device)[:, None]
            reduced = torch.zeros(shape, dtype=torch.float32, device=hidden.device)
            reduced.index_add_(0, segment, states)
        is_done = np.zeros(len(requests), dtype=bool)
        is_done[done] = True
        for i, request in enumerate(requests):
            if request.partial is not None:  # an earlier chunk of this prompt
                if is_max:
                    reduced[i] = torch.maximum(reduced[i], request.partial)
                else:
                    reduced[i] += request.partial
            if not is_done[i]:
                request.partial = reduced[i].clone()
        if not len(done):
            return None
        finished = reduced[self._index(done)]
        if is_max:
            return finished
        lens = torch.from_numpy(prompt_lens[done].astype(np.float32)).to(hidden.device)
        if kind == "MEAN_SQRT_LEN":
            lens = lens.sqrt()
        elif kind == "WEIGHTED_MEAN":  # the weights' sum, 1 + 2 + ... + n
            lens = lens * (lens + 1) / 2
        return finished / lens[:, None]

    def _cls_step(
        self,
        hidden: torch.Tensor,
        requests: list[_PoolingRequest],
        starts: np.ndarray,
        query_start_loc: np.ndarray,
        done: np.ndarray,
    ) -> torch.Tensor | None:
        first = np.nonzero(starts == 0)[0]  # requests whose chunk holds their first token
        if len(first):
            firsts = hidden[self._index(query_start_loc[:-1][first])].float()
            for j, i in enumerate(first):
                requests[i].partial = firsts[j]
        if not len(done):
            return None
        partials = [requests[i].partial for i in done]
        if any(p is None for p in partials):
            raise RuntimeError("CLS pooling: a prompt ended before its first token was computed")
        return torch.stack(partials)  # type: ignore[arg-type]

    def _finish(
        self, request_ids: list[str], requests: list[_PoolingRequest], vectors: torch.Tensor
    ) -> dict[str, bytes]:
        """Truncate and normalize as each request asks, copy to the host once."""
        hidden_size = vectors.shape[-1]
        normalize = [
            self.config.normalize if r.params.normalize is None else r.params.normalize
            for r in requests
        ]
        dims = [min(r.params.dimensions or hidden_size, hidden_size) for r in requests]
        result = vectors
        if any(normalize):
            mask = torch.tensor(normalize, device=vectors.device)[:, None]
            result = torch.where(mask, F.normalize(vectors, p=2, dim=-1), vectors)
        for j, d in enumerate(dims):
            if d < hidden_size:  # Matryoshka: the prefix is normalized on its own
                result[j, :d] = finish_vector(vectors[j], d, normalize[j])
        host = result.cpu().numpy().astype(POOLED_DTYPE, copy=False)
        out: dict[str, bytes] = {}
        for j, request_id in enumerate(request_ids):
            out[request_id] = host[j, : dims[j]].tobytes()
            self._requests[request_id].partial = None
        return out
