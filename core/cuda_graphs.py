"""Device graphs of pure-decode steps: capture once at start-up, replay per step.

A decode step launches every kernel of the model from Python (hundreds per step), which at
small batches costs more than the kernels themselves. Where the platform can capture graphs
and the attention backend is graph-capture safe, the model runner captures the model's forward
(embedding to final hidden states; for batches of up to ``MAX_LOGITS_CAPTURE_SIZE`` also the
float32 logits; sampling stays eager) once per batch size in a
list of *capture sizes*. A step whose every request has exactly one query token, with at most
the largest capture size of requests, is padded up to the smallest capture size that holds it
and replayed:

- the graphs read static input buffers, which each step fills in place; padding requests have
  one token at slot ``-1`` (nothing is written to the KV cache) and a context of one token;
- the first ``n`` rows of the graph's static output are the step's hidden states;
- a model that keeps auxiliary hidden states (an EAGLE-3 target:
  ``CausalLM.aux_hidden_state_layers``) has the graph copy them into static buffers as well,
  whose first ``n`` rows are handed back to the model after each replay
  (``CausalLM.put_aux_hidden_states``), as an eager forward would have kept them.

Other steps (prefill chunks, mixed batches, larger batches, ``--enforce-eager``, no capture
sizes) run eager.
The graphs share one memory pool and never replay concurrently (one engine step at a time).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from chassis.core.attention import AttentionMetadata, ForwardContext

if TYPE_CHECKING:
    from chassis.core.attention import AttentionBackend
    from chassis.core.config import EngineConfig
    from chassis.core.model_interface import CausalLM
    from chassis.platforms.interface import DeviceEvent, DeviceGraph, Platform

logger = logging.getLogger(__name__)

#: the largest batch captured by default; larger decode batches run eager, where launch
#: overhead is small next to the work of the batch
DEFAULT_MAX_CAPTURE_SIZE = 512
#: graphs of at most this many requests also compute the float32 logits (given a
#: ``logits_fn``): at such batches the LM head's launch and the cast, eager after the
#: replay, were a tenth of the host's step on an H200 (docs/gpu.md, "CUDA graphs"); the
#: static logits of every such graph together stay small (31 rows of the vocabulary)
MAX_LOGITS_CAPTURE_SIZE = 16


def capture_size_pattern(largest: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, up to and including ``largest``.

    Padding a batch to the next size costs at most 15 % extra rows beyond 64 (where decode is
    bound by reading the weights, not by the rows), and the coarser steps halve the graphs
    (start-up time and memory) above 64. ``largest`` itself is always included, so every
    batch up to it has a graph.
    """
    if largest < 1:
        raise ValueError(f"the largest capture size must be >= 1; got {largest}")
    sizes = [s for s in (1, 2, 4) if s < largest]
    sizes += [s for s in range(8, min(64, largest) + 1, 8)]
    sizes += [s for s in range(80, largest + 1, 16)]
    if not sizes or sizes[-1] != largest:
        sizes.append(largest)
    return sorted(set(sizes))


def capture_sizes(config: EngineConfig) -> list[int]:
    """The batch sizes to capture for ``config`` (sorted, unique), from ``cuda_graph_sizes``.

    ``None``: :func:`capture_size_pattern` up to min(``max_num_seqs``,
    ``max_num_batched_tokens``, :data:`DEFAULT_MAX_CAPTURE_SIZE`). One value ``N``: the
    pattern up to min(``N``, ``max_num_seqs``, ``max_num_batched_tokens``) (vLLM's meaning of
    a single value). Several values: exactly those (``EngineConfig.validate`` has checked
    that none exceeds the largest possible decode batch). ``[]``: none (:func:`eager_reason`
    says so first).
    """
    largest_batch = min(config.max_num_seqs, config.max_num_batched_tokens)
    sizes = config.cuda_graph_sizes
    if sizes is None:
        return capture_size_pattern(min(largest_batch, DEFAULT_MAX_CAPTURE_SIZE))
    if len(sizes) == 1:
        return capture_size_pattern(min(sizes[0], largest_batch))
    return sorted(set(sizes))


def eager_reason(
    config: EngineConfig,
    platform: Platform,
    attention_backend: type[AttentionBackend],
    model: CausalLM | None = None,
) -> str | None:
    """Why decode steps must run eager with this setup, or ``None`` when graphs may be used.

    Asks the interfaces (the platform's ``supports_graph_capture``, the backend's
    ``graph_capture_safe``, the model's ``graph_capture_blocker``), never a device name.
    """
    if config.enforce_eager:
        return "--enforce-eager is set"
    if config.cuda_graph_sizes is not None and not config.cuda_graph_sizes:
        return "no capture sizes (cuda_graph_sizes=[]: vLLM's cudagraph_mode NONE, or -O0)"
    if not platform.supports_graph_capture():
        return f"platform {platform.name!r} does not support graph capture"
    if not attention_backend.graph_capture_safe:
        return (
            f"attention backend {config.attention_backend!r} is not graph-capture safe "
            f"(it reads step metadata on the host)"
        )
    if model is not None:
        return model.graph_capture_blocker()
    return None


#: byte alignment of each region of the packed input buffer (any dtype's view starts aligned)
_REGION_ALIGN = 16
#: tables above this many bytes per replay go in a copy of their own, of only the step's
#: columns (a long max_model_len at a large batch would otherwise copy mostly stale columns)
MAX_PACKED_TABLE_BYTES = 256 * 1024


class _StaticInputs:
    """The buffers every graph reads; rows ``0 .. size-1`` are graph ``size``'s inputs.

    They are typed views of one device byte buffer, in this order: ``input_ids`` and
    ``positions`` (int64 ``[max_size]``), ``group_slot_mapping`` (int64 ``[G, max_size]``),
    ``seq_lens`` (int32 ``[max_size]``), ``group_block_table`` (int32 ``[G, max_size, W]``),
    so that a replay fills all of them with one copy of a host mirror of the same layout
    (:class:`_HostStaging`). ``slot_mappings`` and ``block_tables`` are the per-group views.
    """

    def __init__(
        self, max_size: int, max_blocks_per_req: int, device: torch.device, num_groups: int = 1
    ) -> None:
        self.layout = _PackedLayout(max_size, max_blocks_per_req, num_groups)
        self.raw = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        views = self.layout.views(self.raw)
        self.input_ids, self.positions, self.group_slot_mapping, self.seq_lens = views[:4]
        self.group_block_table = views[4]
        # The capture-time contents are the padding's: no KV write, one context token.
        self.group_slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.slot_mappings = list(self.group_slot_mapping)
        self.block_tables = list(self.group_block_table)
        # One query token per request: constant, written once (not part of the copy).
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)


class _PackedLayout:
    """Byte offsets of the static inputs in their packed buffer (see :class:`_StaticInputs`)."""

    def __init__(self, max_size: int, max_blocks_per_req: int, num_groups: int) -> None:
        self.max_size = max_size
        self.width = max_blocks_per_req
        self.num_groups = num_groups
        shapes = [
            (torch.int64, (max_size,)),  # input_ids
            (torch.int64, (max_size,)),  # positions
            (torch.int64, (num_groups, max_size)),  # slot mappings
            (torch.int32, (max_size,)),  # seq_lens
            (torch.int32, (num_groups, max_size, max_blocks_per_req)),  # block tables
        ]
        #: (byte offset, byte size, dtype, shape) of each view
        self.regions: list[tuple[int, int, torch.dtype, tuple[int, ...]]] = []
        offset = 0
        for dtype, shape in shapes:
            size = int(np.prod(shape)) * dtype.itemsize
            self.regions.append((offset, size, dtype, shape))
            offset += -(-size // _REGION_ALIGN) * _REGION_ALIGN
        self.nbytes = offset
        self.tables_offset = self.regions[4][0]

    def views(self, raw: torch.Tensor) -> list[torch.Tensor]:
        """The five typed views of the byte tensor ``raw`` (device or host)."""
        return [
            raw[offset : offset + size].view(dtype).view(shape)
            for offset, size, dtype, shape in self.regions
        ]

    def table_bytes(self, num_rows: int) -> int:
        """Bytes of the tables region that hold rows ``0 .. num_rows-1`` of every group."""
        return ((self.num_groups - 1) * self.max_size + num_rows) * self.width * 4


class _HostStaging:
    """Host mirrors of the packed static inputs, two used in turn: a replay fills one while
    the copy out of the other may still be queued behind the device's previous step (async
    scheduling). Pinned when the platform copies asynchronously; then an event (the
    platform's) recorded after each copy out of a mirror guards its next refill: the engine
    has at most two steps in flight, so by then the copy has finished and ``query()`` says so
    without a wait; only an event that cannot tell is waited for."""

    def __init__(self, layout: _PackedLayout, platform: Platform, pin_memory: bool) -> None:
        self.layout = layout
        self.platform = platform
        self.pin_memory = pin_memory
        self.buffers = [
            torch.zeros(layout.nbytes, dtype=torch.uint8, pin_memory=pin_memory) for _ in range(2)
        ]
        self.arrays = [[view.numpy() for view in layout.views(b)] for b in self.buffers]
        for arrays in self.arrays:
            arrays[2].fill(-1)  # padding slots
            arrays[3].fill(1)  # padding context lengths
        self.events: list[DeviceEvent | None] = [None, None]
        self.turn = 0

    def next(self) -> tuple[torch.Tensor, list[np.ndarray]]:
        """The mirror to fill for this replay (its previous copy has finished) and its numpy
        views (ids, positions, slots, seq_lens, tables)."""
        self.turn ^= 1
        event = self.events[self.turn]
        if event is not None:
            query = getattr(event, "query", None)
            if query is None or not query():
                event.synchronize()
            self.events[self.turn] = None
        return self.buffers[self.turn], self.arrays[self.turn]

    def copied(self) -> None:
        """The current mirror's copy is queued on the device's current stream."""
        if self.pin_memory:
            self.events[self.turn] = self.platform.record_event()


class DecodeGraphs:
    """One captured graph of the model's forward per capture size, and their replay.

    Built by the model runner after the KV cache exists (the graphs bake in the addresses of
    the caches, the weights and the static buffers); :meth:`capture` must run once before
    :meth:`run`. ``replays`` counts replays per capture size. ``model`` is the model, or
    anything called like it (the ``torch.compile``'d forward of ``--torch-compile``).
    ``layer_group`` (the runner's): the KV cache group of each attention layer, whose
    metadata buffer it reads; None: one group. ``aux_model``: the model when it keeps
    auxiliary hidden states (EAGLE-3), else None: each graph then copies the states its forward
    kept into static buffers (``[max_size, width]`` per kept layer; graph ``size`` writes rows
    ``0 .. size-1``), and :meth:`run` puts their first ``n`` rows back into the model.
    ``logits_fn`` (the model's ``compute_logits``, or None): graphs of up to
    :data:`MAX_LOGITS_CAPTURE_SIZE` requests apply it to their hidden states and cast to
    float32, read back by :attr:`last_logits`.
    """

    def __init__(
        self,
        model: Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor],
        kv_caches: list[torch.Tensor],
        platform: Platform,
        sizes: list[int],
        *,
        device: torch.device,
        max_model_len: int,
        max_blocks_per_req: int,
        pin_memory: bool = False,
        layer_group: list[int] | None = None,
        aux_model: CausalLM | None = None,
        logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"capture sizes must be sorted, unique and >= 1; got {sizes}")
        self.model = model
        self.kv_caches = kv_caches
        self.platform = platform
        self.sizes = list(sizes)
        self.device = device
        self.max_model_len = max_model_len
        self.pin_memory = pin_memory
        max_size = self.sizes[-1]
        self.layer_group = layer_group
        num_groups = 1 if layer_group is None else max(layer_group) + 1
        self._inputs = _StaticInputs(max_size, max_blocks_per_req, device, num_groups)
        self._staging = _HostStaging(self._inputs.layout, platform, pin_memory)
        # The host copies of seq_lens and query_start_loc that the metadata carries (kept
        # equal to the device buffers).
        self._seq_lens_host = np.ones(max_size, dtype=np.int32)
        self._seq_lens_cpu = torch.from_numpy(self._seq_lens_host)
        self._query_start_loc_cpu = torch.arange(max_size + 1, dtype=torch.int32)
        self._graphs: dict[int, DeviceGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.aux_model = aux_model
        #: the static buffers of the kept auxiliary hidden states (allocated by the eager
        #: forward :meth:`capture` runs first, when their width and dtype are known)
        self.aux_outputs: list[torch.Tensor] | None = None
        self.replays: Counter[int] = Counter()
        self.logits_fn = logits_fn
        #: graph size -> its static float32 logits (graphs up to MAX_LOGITS_CAPTURE_SIZE)
        self._logits: dict[int, torch.Tensor] = {}
        self._last_logits: torch.Tensor | None = None

    @property
    def max_size(self) -> int:
        """The largest batch a graph exists for."""
        return self.sizes[-1]

    @property
    def last_logits(self) -> torch.Tensor | None:
        """The float32 logits ``logits_fn`` gives for the last :meth:`run`'s hidden states
        (rows ``:n``), when its graph computed them (a ``logits_fn`` and a size up to
        :data:`MAX_LOGITS_CAPTURE_SIZE`); else None. Valid until the next replay, which
        overwrites them; the caller may edit them in place (the sampler does)."""
        return self._last_logits

    @property
    def num_replays(self) -> int:
        """Replays so far, all sizes together."""
        return sum(self.replays.values())

    def size_for(self, num_reqs: int) -> int | None:
        """The smallest capture size >= ``num_reqs``; ``None`` when there is none (run eager)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if num_reqs >= 1 and i < len(self.sizes) else None

    # -- capture --------------------------------------------------------------------------

    def _forward(self, size: int) -> torch.Tensor:
        """The model's forward over rows ``0 .. size-1`` of the static buffers.

        Every Python object is built afresh per call, from new views of the buffers: modules
        memoize per step by object identity (the rotary tables on the ``positions`` tensor,
        backends in ``metadata.derived``); reused objects would let a warm-up's memo stand in
        for work the capture must record. The Python ints are fixed for the graph's life:
        ``size`` requests of one token each, and ``max_seq_len = max_model_len``, an upper
        bound on every replay's ``seq_lens``.
        """
        inputs = self._inputs
        metadata = [
            AttentionMetadata(
                num_actual_tokens=size,
                num_reqs=size,
                query_start_loc=inputs.query_start_loc[: size + 1],
                seq_lens=inputs.seq_lens[:size],
                block_table=block_table[:size],
                slot_mapping=slot_mapping[:size],
                max_query_len=1,
                max_seq_len=self.max_model_len,
                query_start_loc_cpu=self._query_start_loc_cpu[: size + 1],
                seq_lens_cpu=self._seq_lens_cpu[:size],
            )
            for block_table, slot_mapping in zip(
                inputs.block_tables, inputs.slot_mappings, strict=True
            )
        ]
        ctx = ForwardContext(
            attn_metadata=metadata[0],
            kv_caches=self.kv_caches,
            group_metadata=metadata if self.layer_group is not None else None,
            layer_group=self.layer_group,
        )
        hidden = self.model(inputs.input_ids[:size], inputs.positions[:size], ctx)
        if self.aux_model is not None:
            # Python that runs at capture only: the copies are recorded in the graph, so each
            # replay refreshes the buffers the step's drafter reads.
            states = self.aux_model.take_aux_hidden_states()
            if self.aux_outputs is None:
                self.aux_outputs = [
                    torch.empty((self.max_size, *s.shape[1:]), dtype=s.dtype, device=s.device)
                    for s in states
                ]
            if len(states) != len(self.aux_outputs):
                raise RuntimeError(
                    f"the model kept {len(states)} auxiliary hidden states while capturing, "
                    f"{len(self.aux_outputs)} before"
                )
            for buffer, state in zip(self.aux_outputs, states, strict=True):
                buffer[:size].copy_(state)
        if self.logits_fn is not None and size <= MAX_LOGITS_CAPTURE_SIZE:
            # Python that runs at capture only, like the aux states: the tensor of the last
            # call (the capture's) is the one each replay recomputes in place
            self._logits[size] = self.logits_fn(hidden).float()
        return hidden

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first, and log count, seconds and memory.

        Largest first: the shared pool grows to the largest graph's needs and the smaller
        graphs reuse that memory. The static buffers hold padding only (slot ``-1``), so the
        warm-up and capture runs write nothing to the KV cache.
        """
        platform = self.platform
        platform.synchronize()
        free_before = platform.memory_available()
        start = time.perf_counter()
        if self.aux_model is not None and self.aux_outputs is None:
            # One eager forward (padding only: writes no KV) allocates the aux buffers on the
            # current stream, outside any capture.
            self._forward(self.max_size)
        pool = platform.new_graph_pool()
        for size in reversed(self.sizes):
            graph, output = platform.capture_graph(lambda size=size: self._forward(size), pool)
            self._graphs[size] = graph
            self._outputs[size] = output
        platform.synchronize()
        seconds = time.perf_counter() - start
        used = max(0, free_before - platform.memory_available())
        logger.info(
            "captured %d decode graphs (batch sizes %s) in %.2f s; device memory used by "
            "capture: %.1f MiB",
            len(self.sizes),
            _describe_sizes(self.sizes),
            seconds,
            used / 2**20,
        )

    # -- replay ---------------------------------------------------------------------------

    def _host(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor.pin_memory() if self.pin_memory else tensor

    def run(
        self,
        input_ids: np.ndarray | torch.Tensor,
        positions: np.ndarray,
        slot_mapping: np.ndarray | Sequence[np.ndarray],
        seq_lens: np.ndarray,
        block_table: np.ndarray | Sequence[np.ndarray],
    ) -> torch.Tensor:
        """Replay the graph for ``n = len(input_ids)`` one-token requests; return ``[n, hidden]``.

        :param input_ids: ``[n]`` the step's tokens, one per request: host values, or a device
            tensor (tokens an unresolved step sampled, under async scheduling)
        :param positions: ``[n]`` their positions
        :param slot_mapping: ``[n]`` their KV cache slots (``[G, n]`` or a list of ``G``:
            one per KV cache group)
        :param seq_lens: ``[n]`` context lengths including the new token (<= max_model_len)
        :param block_table: ``[n, w]`` int32 block ids, ``w`` <= max blocks per request
            (``[G, n, w]`` or a list of ``G``: one per KV cache group)
        :return: a view of the graph's static output, valid until the next replay; with an
            ``aux_model``, its kept states are views of :attr:`aux_outputs` (rows ``:n``), put
            back into it for its ``take_aux_hidden_states``, valid until the next replay too
        :raises ValueError: ``n`` is 0 or larger than :attr:`max_size`
        """
        n = len(input_ids)
        size = self.size_for(n)
        if size is None:
            raise ValueError(f"no graph for a batch of {n}; capture sizes: {self.sizes}")
        inputs = self._inputs
        slot_mappings = np.asarray(slot_mapping)  # [G, n] (a list of G arrays is stacked)
        if slot_mappings.ndim == 1:
            slot_mappings = slot_mappings[None]
        tables = np.asarray(block_table, dtype=np.int32)  # [G, n, w]
        if tables.ndim == 2:
            tables = tables[None]
        num_groups = len(inputs.slot_mappings)
        if len(slot_mappings) != num_groups or len(tables) != num_groups:
            raise ValueError(
                f"slot mappings and block tables for {len(slot_mappings)} and {len(tables)} "
                f"KV cache groups; the graphs were captured for {num_groups}"
            )
        # Every input goes into one host mirror of the static buffers and reaches them in one
        # copy (each copy costs the host a pinned staging and a launch: ~10-30 us apiece).
        # Padding rows: slot -1 (write nothing), a one-token context (read almost nothing);
        # their ids, positions and table entries are stale but valid. Rows past ``size`` are
        # not read by this graph.
        raw, (ids_h, positions_h, slots_h, lens_h, tables_h) = self._staging.next()
        device_ids = isinstance(input_ids, torch.Tensor)
        if not device_ids:
            ids_h[:n] = input_ids
        positions_h[:n] = positions
        slots_h[:, :n] = slot_mappings
        slots_h[:, n:size] = -1
        lens = self._seq_lens_host[:size]  # also the metadata's seq_lens_cpu
        lens[:n] = seq_lens
        lens[n:] = 1
        lens_h[:size] = lens
        width = tables.shape[2]
        layout = inputs.layout
        table_bytes = layout.table_bytes(n)
        packed_tables = table_bytes <= MAX_PACKED_TABLE_BYTES
        if packed_tables:
            tables_h[:, :n, :width] = tables
            end = layout.tables_offset + table_bytes
        else:
            end = layout.tables_offset
        inputs.raw[:end].copy_(raw[:end], non_blocking=True)
        self._staging.copied()
        if not packed_tables:
            inputs.group_block_table[:, :n, :width].copy_(self._host(tables), non_blocking=True)
        if device_ids:  # sampled by the previous step: gathered on the device
            inputs.input_ids[:n].copy_(input_ids, non_blocking=True)
        self._graphs[size].replay()
        self.replays[size] += 1
        logits = self._logits.get(size)
        self._last_logits = None if logits is None else logits[:n]
        if self.aux_model is not None:
            assert self.aux_outputs is not None  # allocated by capture
            self.aux_model.put_aux_hidden_states([buffer[:n] for buffer in self.aux_outputs])
        return self._outputs[size][:n]


def _describe_sizes(sizes: list[int]) -> str:
    if len(sizes) <= 8:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:4]))}, ..., {', '.join(map(str, sizes[-2:]))}"
