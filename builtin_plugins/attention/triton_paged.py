"""``triton_paged``: paged attention by Triton kernels, for CUDA and ROCm GPUs.

One kernel writes the step's K/V into the paged cache; one unified kernel computes attention
for the whole mixed batch (prefill chunks over cached prefixes and decodes) with online
softmax over the request's KV blocks, GQA query heads grouped per kv head, float32
accumulation; decode-like steps on a GPU with idle multiprocessors also split each request's
KV range and merge the parts in a second small kernel. See
:mod:`chassis.builtin_plugins.attention.triton_paged_kernels`.

A sliding window, a logit soft cap and attention sinks are compile-time variants of the same
kernel: the window masks keys before each query's window and skips the KV tiles wholly before
a query block's (a windowed layer reads about the window, not the context); the cap applies
``cap * tanh(s / cap)`` to the scores in the kernel; the sinks (gpt-oss) start each row's
online softmax from its head's sink logit. Block-table entries wholly before a window may
be the null block (released by the KV cache manager when every layer has a window); a tile
that straddles the window's start reads it and masks it (it holds zeros). A per-token attend
limit (``AttentionMetadata.attend_limit``: Gemma 3's image tokens attend to their whole
image) is a fourth variant: each row's keys end at its limit instead of its position.

An 8-bit KV cache (``--kv-cache-dtype fp8`` / ``fp8_e5m2``) is one more compile-time variant:
the write kernel quantizes (``k / k_scale``, saturated, rounded to nearest even) and the
attention kernel widens each loaded tile to the compute dtype; no host read either way.

Heads wider than 256 (DeepSeek's latent cache: one KV head of 576 shared by every query
head, in a cache whose V plane aliases its K plane) are padded to a power of two and masked,
and a large query-head group is split over programs so that each one's tiles fit the shared
memory (``triton_paged_kernels.choose_launch_config``).

``CHASSIS_FUSED_DECODE_ATTENTION=1`` (read when a backend is built; default off until measured
on a GPU) folds the two small launches around a decode step's attention into the attention
kernel: the KV write of a decode-only step (``max_query_len == 1``) and the split-KV merge.
At batch 1 on an H200 each was a launch per layer costing about as much as its work (0.040 and
0.049 ms of a 1.35 ms step over 28 layers), and every launch is one more node a CUDA graph
replays. Where the write cannot be fused (mixed steps, a query group spread over programs,
aliased K/V planes: ``triton_paged_kernels.fused_kv_write_blocker``) the write kernel runs as
before; the result is the same either way.

On CPU tensors the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1``), which
is for tests; otherwise they raise ``ValueError``.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from typing import Any, ClassVar

import torch

from chassis.builtin_plugins.attention import triton_paged_kernels as kernels
from chassis.core.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

#: ``CHASSIS_FUSED_DECODE_ATTENTION=1``: decode steps write K/V and merge KV splits inside the
#: attention kernel (opt-in, unmeasured; docs/gpu.md, "Fused decode attention")
FUSED_DECODE_VARIABLE = "CHASSIS_FUSED_DECODE_ATTENTION"


def fused_decode_requested() -> bool:
    """Whether ``CHASSIS_FUSED_DECODE_ATTENTION`` is ``1`` in this process's environment now."""
    return os.environ.get(FUSED_DECODE_VARIABLE, "").strip() == "1"


@cache
def _announce_fused_decode() -> None:
    """Log once per process that the fused decode path is on (every layer builds a backend)."""
    logger.info(
        "%s=1: triton_paged writes decode steps' K/V and merges KV splits inside the "
        "attention kernel",
        FUSED_DECODE_VARIABLE,
    )


class TritonPagedAttention(AttentionBackend):
    """Paged attention for one layer by the Triton kernels (the GPU platforms' default).

    Nothing in :meth:`forward` reads a device tensor on the host, so it adds no device->host
    synchronization and can be captured in a CUDA graph; the launch configuration depends only
    on tensor shapes and the metadata's Python ints (``num_reqs``, ``max_query_len``,
    ``max_seq_len``), none of which change the result.
    """

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.bfloat16,
        torch.float16,
        torch.float32,
    )
    #: no host reads; tiles and split count only change speed (see the class docstring)
    graph_capture_safe: ClassVar[bool] = True
    #: all three are constexpr-gated in the kernel (the window also skips KV tiles before it)
    supports_sliding_window: ClassVar[bool] = True
    #: chunked local attention (Llama 4), constexpr-gated like the window
    supports_chunked_attention: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    supports_attention_sinks: ClassVar[bool] = True
    #: quantized on write, widened in the kernel on read (see the module docstring)
    supported_kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = kernels.FP8_KV_DTYPES
    #: both kernels take the K and V planes as ``kv_cache[:, 0]`` / ``kv_cache[:, 1]`` with
    #: the cache's strides: a V plane aliasing the K plane works
    supports_aliased_kv_planes: ClassVar[bool] = True
    #: a constexpr variant of the kernel loads each row's limit (never in a captured graph:
    #: the runner sets ``attend_limit`` only on eager steps)
    supports_attend_limit: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """See :meth:`AttentionBackend.__init__`; also reads ``CHASSIS_FUSED_DECODE_ATTENTION``
        once, into :attr:`fused_decode`."""
        super().__init__(*args, **kwargs)
        #: write a decode step's K/V and merge its KV splits inside the attention kernel
        #: (``CHASSIS_FUSED_DECODE_ATTENTION=1`` when the backend was built); fixed for the
        #: backend's life, so every step, eager or captured, launches the same way
        self.fused_decode = fused_decode_requested()
        if self.fused_decode:
            _announce_fused_decode()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`. Rows past ``num_actual_tokens`` are unspecified."""
        if query.dim() != 3 or query.shape[1:] != (self.num_heads, self.head_dim):
            raise ValueError(
                f"query must be [num_tokens, {self.num_heads}, {self.head_dim}]; "
                f"got {tuple(query.shape)}"
            )
        if key.shape[1:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"key must be [num_tokens, {self.num_kv_heads}, {self.head_dim}]; "
                f"got {tuple(key.shape)}"
            )
        if query.dtype not in self.supported_dtypes:
            raise ValueError(
                f"triton_paged computes in {', '.join(map(str, self.supported_dtypes))}; "
                f"got {query.dtype}"
            )
        # the K/V write goes with the attention launch: a separate kernel first, or, with
        # fused_decode in a decode-only step, inside the attention kernel
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        kernels.paged_attention(
            query,
            kv_cache,
            out,
            query_start_loc=metadata.query_start_loc,
            seq_lens=metadata.seq_lens,
            block_table=metadata.block_table,
            num_reqs=metadata.num_reqs,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            scale=self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            sinks=self.sinks,
            attend_limit=metadata.attend_limit,
            attention_chunk_size=self.attention_chunk_size,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            key=key,
            value=value,
            slot_mapping=metadata.slot_mapping,
            fuse_kv_write=self.fused_decode,
            fuse_combine=self.fused_decode,
        )
        return out
