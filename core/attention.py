"""The attention-backend interface and the one metadata object every backend reads.

A step's batch mixes prefill chunks (possibly over a cached prefix) and single-token decodes.
Tokens of all requests are concatenated ("flattened") along the first dimension; request ``i``
owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, which are the *last* query tokens
of its ``seq_lens[i]`` context tokens. Its K/V live in the paged cache at the blocks listed in
``block_table[i]``; the new tokens' K/V are written at ``slot_mapping`` (slot = block * block_size
+ offset; ``-1`` marks padding that must not be written).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


@dataclass
class AttentionMetadata:
    """Everything an attention backend needs for one step (shared by all layers)."""

    #: tokens of real requests in this step; rows past it are padding
    num_actual_tokens: int
    num_reqs: int
    #: [num_reqs + 1] int32, cumulative query lengths (cu_seqlens_q), on the device
    query_start_loc: torch.Tensor
    #: [num_reqs] int32, context length of each request *including* this step's tokens
    seq_lens: torch.Tensor
    #: [num_reqs, max_blocks_per_req] int32, physical block ids (unused entries arbitrary)
    block_table: torch.Tensor
    #: [num_tokens] int64, cache slot of each new token, -1 for padding
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    #: host copies of query_start_loc and seq_lens (reference paths loop over requests)
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    #: scratch space where a backend memoizes what it derives from this metadata once per
    #: step (gather indices, masks) and then reuses in every layer; keys are backend-private
    derived: dict[str, Any] = field(default_factory=dict)
    #: ``[num_actual_tokens]`` int32 on the device, or ``None`` (plain causal attention): the
    #: last context position each query token may attend to. A token's own position for a
    #: causal token; the block's last position for a token inside a block of tokens that
    #: attend to each other both ways (Gemma 3's image tokens: ``CausalLM.
    #: bidirectional_image_blocks``). Always ``position <= attend_limit[t] < seq_len`` of its
    #: request, so a single-token query (a decode) has its own position. Set only on eager
    #: steps that schedule such a block (never on decode steps or captured graphs), and only
    #: for backends with :attr:`AttentionBackend.supports_attend_limit`; a sliding window
    #: still counts back from the token's own position (HF's ``sliding AND (causal OR
    #: block)``)
    attend_limit: torch.Tensor | None = None


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """Shape of one layer's paged KV cache: ``[num_blocks, 2 (K, V), block_size, kv_heads, dim]``."""
    return (num_blocks, 2, block_size, num_kv_heads, head_dim)


def alias_kv_planes(plane: torch.Tensor) -> torch.Tensor:
    """A one-plane cache ``[num_blocks, 1, block_size, kv_heads, dim]`` as the
    :func:`kv_cache_shape` tensor backends take, its V plane the K plane itself
    (``expand``: stride 0 on dim 1, no second copy). For a model whose values are its keys
    (``CausalLM.kv_cache_values_are_keys``) on a backend that declares
    :attr:`AttentionBackend.supports_aliased_kv_planes`; writes through either plane land in
    the one."""
    if plane.dim() != 5 or plane.shape[1] != 1:
        raise ValueError(
            "a one-plane cache is [num_blocks, 1, block_size, kv_heads, dim]; got "
            f"{tuple(plane.shape)}"
        )
    return plane.expand(plane.shape[0], 2, *plane.shape[2:])


#: the 8-bit ``--kv-cache-dtype`` names and the torch dtypes their caches are allocated in
FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
#: the 8-bit cache dtypes themselves (what backends list in ``supported_kv_cache_dtypes``)
FP8_KV_DTYPES: tuple[torch.dtype, ...] = tuple(dict.fromkeys(FP8_KV_CACHE_DTYPES.values()))


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache tensors are allocated in: ``model_dtype`` for ``"auto"``, else
    the 8-bit float of :data:`FP8_KV_CACHE_DTYPES`. Unknown names are a ``ValueError``."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype must be one of auto, {', '.join(FP8_KV_CACHE_DTYPES)}; "
            f"got {kv_cache_dtype!r}"
        )
    return FP8_KV_CACHE_DTYPES[kv_cache_dtype]


def check_kv_cache_dtype(
    backend_name: str, backend: type[AttentionBackend], kv_cache_dtype: str
) -> None:
    """``ValueError`` when ``backend`` cannot store a ``kv_cache_dtype`` (a flag value) cache,
    naming the backends registered that can."""
    if kv_cache_dtype == "auto":
        return
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, torch.float32)
    if dtype in backend.supported_kv_cache_dtypes:
        return
    from chassis.plugins import get_registries

    registry = get_registries().attention_backends
    able = []
    for name in registry.names():
        try:  # (an error message: a plugin backend that fails to import is just not listed)
            if dtype in registry.get(name).supported_kv_cache_dtypes:
                able.append(name)
        except Exception:
            continue
    raise ValueError(
        f"attention backend {backend_name!r} does not support --kv-cache-dtype "
        f"{kv_cache_dtype}; backends that do: {', '.join(able) or '(none registered)'} "
        "(choose one with --attention-backend, or use --kv-cache-dtype auto)"
    )


class AttentionBackend(ABC):
    """Paged attention for one layer. One instance per attention layer.

    Register a subclass with ``chassis_register_attention_backends``; it is selected with
    ``--attention-backend NAME`` or by the platform's ``default_attention_backend``.
    """

    #: dtypes the backend computes in
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    )
    #: whether :meth:`forward` may be captured in a device graph and replayed on new metadata:
    #: it reads no device tensor's value on the host (nor the ``*_cpu`` copies, which a graph
    #: would freeze), and it uses the metadata's Python ints only in ways that stay correct
    #: when, at replay, ``num_reqs`` and ``num_actual_tokens`` are as at capture (padding
    #: requests have one token, ``seq_len`` 1 and slot ``-1``), every query has one token, and
    #: ``max_seq_len`` is only an upper bound on ``seq_lens``
    graph_capture_safe: ClassVar[bool] = False
    #: whether the backend honours ``sliding_window`` (Mistral, Gemma 2/3 local layers); a
    #: model layer that needs it refuses a backend without it (no silent full attention)
    supports_sliding_window: ClassVar[bool] = False
    #: whether the backend honours ``attention_chunk_size`` (Llama 4's chunked local attention
    #: layers); a model layer that needs it refuses a backend without it
    supports_chunked_attention: ClassVar[bool] = False
    #: whether the backend honours ``logits_soft_cap`` (Gemma 2)
    supports_logits_soft_cap: ClassVar[bool] = False
    #: whether the backend honours ``sinks`` (gpt-oss): a model layer with attention sinks
    #: refuses a backend without it
    supports_attention_sinks: ClassVar[bool] = False
    #: 8-bit cache dtypes (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) the backend can
    #: store K/V in besides the compute dtype, which every backend supports
    #: (``--kv-cache-dtype``). A backend listing one must, when ``kv_cache.dtype`` is it,
    #: store ``clamp(k / k_scale)`` (and ``v / v_scale``) saturated to the dtype's finite
    #: range and read back ``stored * k_scale``; ``k_scale``/``v_scale`` are float attributes
    #: of the instance (1.0 unless set), fixed once the engine runs
    supported_kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()
    #: whether which of those formats work depends on the device (kernels that convert with
    #: the compiler's or the hardware's 8-bit types, as Triton's do): then engine setup also
    #: asks the platform (``Platform.fp8_kv_cache_dtypes``). False for a backend whose
    #: conversions are torch code, which runs on any device
    fp8_kv_cache_needs_device_support: ClassVar[bool] = True
    #: whether :meth:`forward` works on a cache whose V plane aliases its K plane
    #: (:func:`alias_kv_planes`: ``kv_cache[:, 1]`` is ``kv_cache[:, 0]``, ``stride(1) == 0``),
    #: which the runner allocates for a model that passes the same tensor as key and value
    #: (``CausalLM.kv_cache_values_are_keys``, DeepSeek's latent cache), at half the memory. A
    #: backend declaring it addresses the planes only through ``kv_cache[:, 0]`` /
    #: ``kv_cache[:, 1]`` or the tensor's strides, never by viewing the whole tensor as
    #: contiguous (``view``/``reshape`` over dims 0 and 1, or an assumed V offset); writing K
    #: and then V to an aliased slot leaves V, which is K. Without it such a model gets an
    #: ordinary two-plane cache (correct, twice the memory)
    supports_aliased_kv_planes: ClassVar[bool] = False
    #: whether :meth:`forward` honours :attr:`AttentionMetadata.attend_limit` (query ``t``
    #: attends to keys ``k <= attend_limit[t]`` instead of ``k <= position``); a model whose
    #: image tokens attend to each other both ways refuses a backend without it when built
    #: (:func:`chassis.core.layers.attention.check_attend_limit_support`)
    supports_attend_limit: ClassVar[bool] = False

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
        attention_chunk_size: int | None = None,
    ) -> None:
        """``scale`` multiplies ``q . k``. ``sliding_window`` (``None``: the whole context)
        limits each query to the last ``sliding_window`` positions, its own included.
        ``attention_chunk_size`` ``C`` (``None``: off; chunked local attention, Llama 4)
        limits the query at position ``p`` to positions ``floor(p / C) * C .. p``, the start
        of its chunk on (with a window as well, the later of the two lower bounds counts).
        ``logits_soft_cap`` (``None``: off) maps each scaled score ``s`` to
        ``cap * tanh(s / cap)`` before the softmax. ``sinks`` (``None``: off), a
        ``[num_heads]`` tensor of per-head logits (gpt-oss's attention sinks), joins every
        query's softmax denominator: head ``h``'s weights become
        ``exp(s_j) / (exp(sinks[h]) + sum_i exp(s_i))``, so the sink takes probability mass
        but contributes no value; it is neither scaled nor soft-capped. The backend keeps a
        reference to the tensor (the model's parameter, filled in place when the weights
        load) and reads it at every call. The attention layer passes these keywords only
        when set, so a backend whose ``__init__`` predates them keeps working for the models
        that need none of them."""
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
        if attention_chunk_size is not None and attention_chunk_size < 1:
            raise ValueError(
                f"attention_chunk_size must be >= 1 or None, got {attention_chunk_size}"
            )
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(
                f"sinks must be a [num_heads] = [{num_heads}] tensor, got {tuple(sinks.shape)}"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.attention_chunk_size = attention_chunk_size
        self.logits_soft_cap = logits_soft_cap
        self.sinks = sinks
        #: per-tensor dequantization scales of an 8-bit KV cache (see
        #: ``supported_kv_cache_dtypes``); 1.0 = no calibration (vLLM's default)
        self.k_scale = 1.0
        self.v_scale = 1.0

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this step's K/V into ``kv_cache`` and return causal attention output.

        :param query: ``[num_tokens, num_heads, head_dim]``
        :param key: ``[num_tokens, num_kv_heads, head_dim]`` (new tokens only)
        :param value: ``[num_tokens, num_kv_heads, head_dim]``
        :param kv_cache: this layer's cache, shape :func:`kv_cache_shape` (with
            :attr:`supports_aliased_kv_planes`, possibly V aliasing K: stride 0 on dim 1)
        :param metadata: the step's :class:`AttentionMetadata`
        :return: ``[num_tokens, num_heads, head_dim]``; rows past ``num_actual_tokens`` are
            unspecified. Query token ``j`` of request ``i`` sits at position
            ``p = seq_lens[i] - query_len_i + j`` and attends to context positions ``0 .. p``
            (causal over the cached prefix + chunk), or ``p - sliding_window + 1 .. p`` (not
            below 0) with a sliding window, or ``floor(p / C) * C .. p`` with
            ``attention_chunk_size`` ``C``; with ``metadata.attend_limit`` (a backend with
            :attr:`supports_attend_limit`) the last position it attends to is
            ``attend_limit[t]`` instead of ``p``, the window's start unchanged; scores are soft-capped when
            ``logits_soft_cap`` is set, and ``sinks`` join each softmax's denominator.
            With a sliding window (or chunks), block-table entries wholly before the window
            (the chunk) of a request's first query may be the null block (block 0, never
            written: a kernel that reads it and masks it out reads zeros), their blocks released
            (``chassis.core.block_pool.NULL_BLOCK_ID``).
        """


@dataclass
class ForwardContext:
    """Passed to ``CausalLM.forward``: what attention layers read during one step."""

    #: the step's metadata: every layer's when the KV cache has one group of layers
    #: (``group_metadata`` is None), else group 0's (read :meth:`metadata_for`)
    attn_metadata: AttentionMetadata
    #: one cache tensor per attention layer, indexed by layer number
    kv_caches: list[torch.Tensor]
    #: with several KV cache groups: one metadata per group (its own ``block_table`` and
    #: ``slot_mapping``; ``query_start_loc`` and ``seq_lens`` are the same for all)
    group_metadata: list[AttentionMetadata] | None = None
    #: with ``group_metadata``: the group of each attention layer, indexed by layer number
    layer_group: list[int] | None = None
    #: for a model with per-request recurrent state (``CausalLM.request_state_specs``): the
    #: pool's tensors (``[num_slots, *shape]`` each, in the specs' order) ...
    request_states: list[torch.Tensor] | None = None
    #: ... and the slot of each request of the step, in its order (``[num_reqs]`` int64 on
    #: the device); both None for other models and for memory-profiling forwards (a layer
    #: then starts every request from a zero state and keeps nothing)
    state_slots: torch.Tensor | None = None

    def set_attend_limit(self, attend_limit: torch.Tensor) -> None:
        """Give every KV cache group's metadata ``attend_limit``
        (:attr:`AttentionMetadata.attend_limit`: one int32 per token of the step)."""
        self.attn_metadata.attend_limit = attend_limit
        for metadata in self.group_metadata or ():
            metadata.attend_limit = attend_limit

    def metadata_for(self, layer_idx: int) -> AttentionMetadata:
        """The metadata attention layer ``layer_idx`` reads: its KV cache group's."""
        if self.group_metadata is None or self.layer_group is None:
            return self.attn_metadata
        return self.group_metadata[self.layer_group[layer_idx]]
