"""The model runner: turns a ``SchedulerOutput`` into one forward pass and sampled tokens.

One step, as in ARCHITECTURE section 2:
update the persistent batch -> prepare flattened inputs and attention metadata -> forward ->
logits of the rows that sample -> sampler -> token ids to the host.

``execute_model_async`` stops before the last arrow: it starts the copy of the ids and returns
a :class:`~chassis.core.in_flight.PendingRunnerOutput`, so that the engine core can plan and
launch the next step while the device computes this one (async scheduling; see
:mod:`chassis.core.in_flight`). ``execute_model`` is the same, waited for.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from chassis.core import parallel_state
from chassis.core.attention import (
    FP8_KV_DTYPES,
    AttentionMetadata,
    ForwardContext,
    alias_kv_planes,
    check_kv_cache_dtype,
    kv_cache_shape,
    resolve_kv_cache_dtype,
)
from chassis.core.compiled_model import CompiledForward
from chassis.core.cuda_graphs import DecodeGraphs, capture_sizes, eager_reason
from chassis.core.in_flight import InFlightSteps, PendingRunnerOutput
from chassis.core.input_batch import InputBatch, RequestState
from chassis.core.kv_cache_groups import KVCacheGroupSpec, layer_placement, plan_kv_cache_groups
from chassis.core.layers.attention import Attention
from chassis.core.logits_processor import BatchUpdateBuilder, LogitsProcessors, LogitsRows
from chassis.core.model_loader import kv_head_count
from chassis.core.multimodal_runner import MultiModalRunner
from chassis.core.packed_step_metadata import copy_packed, packed_forward_context
from chassis.core.pooler import Pooler
from chassis.core.pooling_config import resolve_pooler_config
from chassis.core.prompt_embeds_runner import PromptEmbedsRunner
from chassis.core.prompt_logprobs import PromptLogprobsCollector
from chassis.core.request_state_cache import RequestStatePool, resolve_state_specs
from chassis.core.sampler_interface import check_sampler_output
from chassis.core.sampling_metadata import SAMPLING_EPS, build_sampling_metadata
from chassis.core.scheduler_interface import ModelRunnerOutput, SchedulerOutput
from chassis.core.seeded_drafts import skip_draws, stream_rewinds
from chassis.core.state_decode_profile import borrowed_state_slots
from chassis.core.structured_output_manager import unpack_masks

if TYPE_CHECKING:
    from chassis.core.attention import AttentionBackend
    from chassis.core.config import EngineConfig
    from chassis.core.draft_model import DraftModelProposer
    from chassis.core.lora.model import LoRAModel
    from chassis.core.model_interface import CausalLM
    from chassis.core.sampler_interface import Sampler
    from chassis.platforms.interface import Platform

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, its KV caches and the persistent batch on one device.

    ``platform`` and ``attention_backend`` (the class the model was built with) decide whether
    pure-decode steps replay captured graphs (see :mod:`chassis.core.cuda_graphs`); by default
    they are the current platform and ``config.attention_backend`` from the registry.
    ``lora`` (with ``--enable-lora``) holds the model's LoRA slots; decode graphs are captured
    with its matmuls, so steps with and without adapters replay them. ``drafter`` (speculative
    decoding with a draft model) proposes each step's drafts for the next one.
    """

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        sampler: Sampler,
        device: torch.device,
        kv_dtype: torch.dtype,
        pin_memory: bool = False,
        *,
        platform: Platform | None = None,
        attention_backend: type[AttentionBackend] | None = None,
        lora: LoRAModel | None = None,
        drafter: DraftModelProposer | None = None,
    ) -> None:
        assert config.max_model_len is not None  # set by finalize_config
        if platform is None:
            from chassis.platforms import get_current_platform

            platform = get_current_platform()
        if attention_backend is None:
            from chassis.plugins import get_registries

            assert config.attention_backend is not None  # set by finalize_config
            attention_backend = get_registries().attention_backends.get(config.attention_backend)
        self.config = config
        self.platform = platform
        self.attention_backend = attention_backend
        self.model = model
        self.lora = lora
        #: the draft model (``--speculative-config`` method ``draft_model``); None: none
        self.drafter = drafter
        if lora is not None and config.torch_compile:
            lora.keep_active()  # one compiled variant, with the adapter matmuls
        #: what runs the forward: the model itself, or its torch.compile'd form
        self.forward: Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor] = (
            CompiledForward(model) if config.torch_compile else model
        )
        self.sampler = sampler
        self.device = device
        #: requests' images: encoder outputs and M-RoPE positions (idle for text)
        self.mm = MultiModalRunner(model, device)
        #: prompts given as input embeddings (``--enable-prompt-embeds``); None: off
        self.prompt_embeds = (
            PromptEmbedsRunner(model, device) if config.enable_prompt_embeds else None
        )
        # ``kv_dtype`` is the model's dtype; ``--kv-cache-dtype fp8`` stores 8-bit floats
        # instead, which the backend must support (the platform checked it; a plugin
        # platform may not have)
        check_kv_cache_dtype(
            config.attention_backend or attention_backend.__name__,
            attention_backend,
            config.kv_cache_dtype,
        )
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, kv_dtype)
        self.pin_memory = pin_memory
        hf = model.hf_config
        self.vocab_size = int(hf.vocab_size)
        # a tensor-parallel model keeps its rank's share of the KV heads (CausalLM contract)
        if model.num_attention_layers == 0:
            # no KV cache at all (a pure state-space model: Mamba2; an encoder): no KV to
            # shape, whatever attention fields the checkpoint's config carries
            self.num_kv_heads, self.head_dim = 1, 1
        else:
            self.num_kv_heads = parallel_state.shard_kv_heads(kv_head_count(hf))[1]
            self.head_dim = int(
                getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
            )
        #: planes per layer's cache: 1 when V aliases K (:meth:`_kv_cache_planes`), else 2
        self.kv_planes = self._kv_cache_planes()
        self.block_size = config.block_size
        self.max_blocks_per_req = math.ceil(config.max_model_len / self.block_size)
        #: the KV cache groups of a model mixing sliding-window and full attention layers
        #: (with the release on); None: one group, one block table. A draft model's layers
        #: read the tables of groups that keep what they read, with caches of their own
        #: (DraftModelProposer.place_on_groups).
        self.kv_groups: list[KVCacheGroupSpec] | None = self._plan_kv_groups()
        #: the KV cache group of each attention layer, by layer number (None: one group)
        self.layer_group: list[int] | None = None
        #: with groups: the cache tensor of each attention layer (its place in its group)
        self._layer_tensor: list[int] | None = None
        if self.kv_groups is not None:
            self.layer_group, self._layer_tensor = layer_placement(
                self.kv_groups, model.num_attention_layers
            )
        if drafter is not None:
            drafter.place_on_groups(self.kv_groups)
        self.batch = InputBatch(
            config.max_num_seqs,
            config.max_model_len,
            self.max_blocks_per_req,
            num_kv_groups=1 if self.kv_groups is None else len(self.kv_groups),
        )
        #: each request's recurrent state (a state-space model's
        #: ``CausalLM.request_state_specs``), allocated before the KV cache is sized so that
        #: memory profiling sees it; None for a model without. Its dtypes: the model's, or
        #: what --mamba-cache-dtype / --mamba-ssm-cache-dtype say.
        specs = resolve_state_specs(
            model.request_state_specs(), config.mamba_cache_dtype, config.mamba_ssm_cache_dtype
        )
        self.request_states: RequestStatePool | None = (
            RequestStatePool(specs, config.max_num_seqs, device, platform.kv_cache_zeros)
            if specs
            else None
        )
        if self.request_states is not None:
            logger.info("request state pool: %s", self.request_states.describe())
        #: custom logits processors (``--logits-processors``), told of every batch change
        self.logits_processors = LogitsProcessors.build(config, device, pin_memory)
        if self.logits_processors is not None:
            self.batch.updates = BatchUpdateBuilder()
        self.in_flight = InFlightSteps(self.batch, platform, pin_memory)
        if drafter is not None:  # probabilistic drafts need the sampler's distributions
            drafter.use_sampler(sampler, has_logits_processors=self.logits_processors is not None)
        self.kv_caches: list[torch.Tensor] = []
        #: the blocks of each cache tensor (set by :meth:`allocate_kv_cache`)
        self.num_kv_blocks = 0
        self.prompt_logprobs = PromptLogprobsCollector()
        #: captured decode graphs; None while there are none (eager only)
        self.graphs: DecodeGraphs | None = None
        #: a pooling engine's (``runner="pooling"``) pooler; None for a generating one
        self.pooler: Pooler | None = None
        if config.runner == "pooling":
            # (the Pooler loads the Dense weights, with the same checks: read them once)
            self.pooler = Pooler(resolve_pooler_config(config, check_dense_weights=False), device)

    # -- KV cache -------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one block takes across all layers (K and V), in the cache's dtype (an 8-bit
        cache's blocks take half a 16-bit one's, so twice as many fit the same memory), the
        draft model's layers included (they share the block ids). With KV cache groups a
        block id names a slot of one group's layers: the bytes of ``L`` layers, the group
        size (:mod:`chassis.core.kv_cache_groups`). A cache whose V plane aliases its K plane
        (:attr:`kv_planes` 1) counts that one plane."""
        shape = kv_cache_shape(1, self.block_size, self.num_kv_heads, self.head_dim)
        per_layer = math.prod(shape) // 2 * self.kv_planes
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        draft = self.drafter.kv_cache_bytes_per_block() if self.drafter is not None else 0
        return per_layer * elem * self._num_cache_tensors() + draft

    def _kv_cache_planes(self) -> int:
        """1 when the model passes its keys as values (``kv_cache_values_are_keys``) and the
        backend works on a cache whose V plane aliases its K plane
        (``supports_aliased_kv_planes``): one plane is stored (:func:`alias_kv_planes`).
        Otherwise 2, also for an 8-bit cache whose layers quantize K and V by different
        scales (one stored plane cannot hold both ``k / k_scale`` and ``v / v_scale``)."""
        model, backend = self.model, self.attention_backend
        if not model.kv_cache_values_are_keys:
            return 2
        name = self.config.attention_backend or backend.__name__
        if not backend.supports_aliased_kv_planes:
            logger.info(
                "KV cache: %s's values are its keys, but attention backend %r does not "
                "declare supports_aliased_kv_planes: K and V planes both stored (twice the "
                "memory of one)",
                type(model).__name__,
                name,
            )
            return 2
        if self.kv_dtype in FP8_KV_DTYPES:
            layers = attention_layers(model)
            if layers is None or any(
                layer.backend.k_scale != layer.backend.v_scale for layer in layers
            ):
                logger.info(
                    "KV cache: 8-bit K and V scales differ (or cannot be seen): K and V "
                    "planes both stored"
                )
                return 2
        return 1

    def _new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """One zeroed cache tensor of ``num_blocks`` blocks from the platform: two planes, or
        one seen as two (:func:`alias_kv_planes`) when :attr:`kv_planes` is 1."""
        shape = kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if self.kv_planes == 2:
            return self.platform.kv_cache_zeros(shape, self.kv_dtype, self.device)
        plane = self.platform.kv_cache_zeros(
            (num_blocks, 1, *shape[2:]), self.kv_dtype, self.device
        )
        return alias_kv_planes(plane)

    def _num_cache_tensors(self) -> int:
        """Cache tensors of ``num_blocks`` blocks: one per layer, or with KV cache groups one
        per place in a group."""
        if self.kv_groups is None:
            return self.model.num_attention_layers
        return max(len(group.layer_ids) for group in self.kv_groups)

    def _plan_kv_groups(self) -> list[KVCacheGroupSpec] | None:
        """KV cache groups when the model mixes sliding-window or chunked local-attention
        layers with full-attention ones
        (:func:`~chassis.core.kv_cache_groups.plan_kv_cache_groups`); None, one block table
        for every layer, when it does not, with ``--no-sliding-window-kv-release``, or when
        some attention is not an ``Attention`` layer this function can see. Group 0 is then
        a full-attention group, which every draft-model layer may read."""
        if not self.config.sliding_window_kv_release:
            return None
        windows = layer_windows(self.model)
        if windows is None:
            return None
        chunks = layer_chunks(self.model)
        full = [w is None and c is None for w, c in zip(windows, chunks, strict=True)]
        if all(full) or not any(full):
            # one group: kv_cache_window's single table (every layer windowed: the largest
            # window; chunked layers without a full layer to hold group 0: every block kept)
            return None
        return plan_kv_cache_groups(windows, chunks)

    def kv_cache_window(self) -> int | None:
        """The window that bounds what every attention layer reads: the largest
        ``sliding_window`` when every layer of the model, and of the draft model, has one;
        ``None`` when any layer attends to the whole context (or the model has no attention
        layer). The KV cache manager releases the blocks a request's window has left."""
        models = [self.model] + ([self.drafter.model] if self.drafter is not None else [])
        windows: list[int | None] = []
        for model in models:
            layers = attention_layers(model)
            if layers is None:
                return None  # attention this function cannot see: keep every position
            windows.extend(layer.sliding_window for layer in layers)
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV caches, then capture the decode graphs where they can be used.

        The graphs bake in the caches' addresses, hence they are captured here, after them.
        """
        self.allocate_kv_cache(num_blocks)
        if isinstance(self.forward, CompiledForward):
            self._compile_forward()
        self._capture_graphs()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate zeroed KV caches of ``num_blocks`` blocks (the draft model's too), and a
        released request-state pool zeroed, without capturing graphs:
        :meth:`initialize_kv_cache` at start-up, sleep mode's wake-up (then
        :meth:`capture_graphs` once the weights are back too)."""
        self.graphs = None
        self.num_kv_blocks = num_blocks
        if self.request_states is not None:
            self.request_states.restore()  # (sleep mode's wake-up; allocated at start-up)
        tensors = [self._new_kv_cache(num_blocks) for _ in range(self._num_cache_tensors())]
        # with KV cache groups, layer j of every group shares tensor j (a block id belongs
        # to one group at a time, so their slots never meet)
        self.kv_caches = (
            tensors if self._layer_tensor is None else [tensors[j] for j in self._layer_tensor]
        )
        # with KV cache groups a position takes a block in every group (EngineInfo's count)
        num_groups = 1 if self.kv_groups is None else len(self.kv_groups)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens) in %s, %.1f MiB%s",
            num_blocks,
            self.block_size,
            num_blocks // num_groups * self.block_size,
            str(self.kv_dtype).removeprefix("torch."),
            num_blocks * self.kv_cache_bytes_per_block() / 2**20,
            " (one plane: V aliases K)" if self.kv_planes == 1 else "",
        )
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks)  # same block ids as the target's

    def free_kv_cache(self) -> None:
        """Drop the KV caches (the draft model's too) and the decode graphs, which hold them
        (sleep mode), and the requests' recurrent state pool: their memory is freed once the
        platform's allocator lets go of it (``Platform.empty_cache``). No step may run until
        :meth:`allocate_kv_cache`, which brings the pool back zeroed."""
        self.graphs = None
        self.kv_caches = []
        if self.request_states is not None:
            self.request_states.release()
        if self.drafter is not None:
            self.drafter.kv_caches = []

    def capture_graphs(self) -> None:
        """Capture the decode graphs again, where they are used (sleep mode's wake-up: the
        KV caches and the weights are back, at new addresses, which the graphs bake in)."""
        self.graphs = None
        self._capture_graphs()

    def _compile_forward(self) -> None:
        """Compile ``--torch-compile``'s forward now rather than in the first requests' steps:
        one dummy forward of several tokens (the graph for any count) and one of a single
        token (torch specializes that size)."""
        assert isinstance(self.forward, CompiledForward)
        start = time.perf_counter()
        self.profile_run(min(16, self.config.max_num_batched_tokens))
        self.profile_run(1)
        logger.info(
            "torch.compile: forward compiled at start-up in %.1f s", time.perf_counter() - start
        )

    def _capture_graphs(self) -> None:
        if self.pooler is not None:
            logger.info("pooling runs prefills only: no decode graphs to capture")
            return
        reason = eager_reason(self.config, self.platform, self.attention_backend, self.model)
        if reason is not None:
            logger.info("decode steps run eager: %s", reason)
            return
        assert self.config.max_model_len is not None
        graphs = DecodeGraphs(
            self.forward,
            self.kv_caches,
            self.platform,
            capture_sizes(self.config),
            device=self.device,
            max_model_len=self.config.max_model_len,
            max_blocks_per_req=self.max_blocks_per_req,
            pin_memory=self.pin_memory,
            layer_group=self.layer_group,
            # an EAGLE-3 target's kept states come out of the graphs as static outputs
            aux_model=self.model if self.model.aux_hidden_state_layers() else None,
            # small batches' logits in the graph too; not where compute_logits gathers or
            # broadcasts across ranks (collectives in graphs are not tried here)
            logits_fn=self.model.compute_logits if parallel_state.world_size() == 1 else None,
        )
        if self.lora is not None:
            # Captured with the adapter matmuls (an all-zero mask is the base model), so that
            # decode steps replay whether or not their requests run adapters.
            self.lora.prepare_profile(0)
        graphs.capture()
        if self.lora is not None:
            self.lora.deactivate()
        self.graphs = graphs

    # -- one step -------------------------------------------------------------------------

    def update_states(self, out: SchedulerOutput) -> None:
        """Apply the scheduler's diff to the persistent batch."""
        # Sorted: removals move rows, so their order lays out the batch, which must be the
        # same on every tensor-parallel rank (a set's order differs between processes).
        for request_id in sorted(out.finished_request_ids):
            self.batch.remove(request_id)
            self.prompt_logprobs.drop(request_id)
            self.mm.remove(request_id)
            if self.prompt_embeds is not None:
                self.prompt_embeds.remove(request_id)
            if self.request_states is not None:
                self.request_states.free(request_id)
        for new in out.new_requests:
            self.batch.remove(new.request_id)  # a preempted request comes back as new
            if self.request_states is not None:
                self._fresh_state(new.request_id, new.num_computed_tokens)
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed % (2**63))
                if params.temperature >= SAMPLING_EPS:
                    # Resumed after preemption: continue the stream where it was, so the
                    # tokens do not depend on preemptions (and hence on the other requests).
                    skip_draws(generator, len(new.output_token_ids), self.vocab_size)
            state = RequestState(
                request_id=new.request_id,
                prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids),
                sampling_params=params,
                eos_token_ids=frozenset(new.eos_token_ids),
                generator=generator,
                lora_int_id=new.lora_request.lora_int_id if new.lora_request else 0,
                processors_read_output=self.logits_processors is not None
                and self.logits_processors.request_flags(params)[1],
            )
            if new.prompt_embeds is not None:  # placeholder ids: no prompt tokens to penalize
                state.sampling_row.prompt_token_ids = []
            if new.lora_request is not None and self.lora is not None:
                self.lora.add_request(new.lora_request)
            self.batch.add(state, new.block_ids, new.num_computed_tokens, new.num_null_blocks)
            self.mm.add(new.request_id, new.prompt_token_ids, new.mm_features)
            if self.prompt_embeds is not None:
                self.prompt_embeds.add(new.request_id, new.prompt_embeds)
            if params.prompt_logprobs is not None and not new.output_token_ids:
                self.prompt_logprobs.start(
                    new.request_id, new.prompt_token_ids, params.prompt_logprobs
                )
        for cached in out.cached_requests:
            row = self.batch.row_of[cached.request_id]
            self.batch.append_blocks(row, cached.new_block_ids)
            self.batch.null_leading_blocks(row, cached.num_null_blocks)
            self.batch.num_computed_tokens[row] = cached.num_computed_tokens
        if self.pooler is not None:
            self.pooler.update(out)

    def _fresh_state(self, request_id: str, num_computed_tokens: int) -> None:
        """A zeroed state slot for a request the runner (re)starts: a recurrent state
        summarizes every token before it, so the request must be computed from position 0
        (prefix caching is off for such models)."""
        assert self.request_states is not None
        if num_computed_tokens:
            raise RuntimeError(
                f"request {request_id!r} starts at token {num_computed_tokens}, but "
                f"{type(self.model).__name__} carries a recurrent state that must be computed "
                "from the first token (is prefix caching on?)"
            )
        self.request_states.free(request_id)
        self.request_states.allocate(request_id)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return host_to_device(array, self.device, self.pin_memory)

    def _copy_metadata(self, packed: torch.Tensor) -> torch.Tensor:
        """The step's packed attention metadata on the device (one non-blocking copy from
        the host tensor :func:`packed_forward_context` built; itself on the CPU)."""
        return copy_packed(packed, self.device)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled ids."""
        return self.execute_model_async(out).result()

    @torch.inference_mode()
    def execute_model_async(self, out: SchedulerOutput) -> PendingRunnerOutput:
        """Launch one step; the ids reach the host when the result is asked for.

        The plan may schedule the decode of a token an unresolved step sampled (async
        scheduling): its id is read from the device. Results must be asked for in step order
        (:mod:`chassis.core.in_flight`).
        """
        self.update_states(out)
        if self.logits_processors is not None:
            self.logits_processors.update_state(self.batch.updates.build(self.batch.num_reqs))
        if out.is_empty:
            return PendingRunnerOutput.ready(ModelRunnerOutput())
        batch = self.batch

        # Scheduled requests in persistent-batch row order.
        rows = np.array(sorted(batch.row_of[r] for r in out.num_scheduled_tokens), dtype=np.int64)
        num_scheduled = np.array(
            [out.num_scheduled_tokens[batch.request_ids[r]] for r in rows], dtype=np.int64
        )
        starts = batch.num_computed_tokens[rows]
        seq_lens = starts + num_scheduled
        cu = np.cumsum(num_scheduled)
        query_start_loc = np.concatenate(([0], cu)).astype(np.int32)
        total = int(cu[-1])

        # Speculative decoding: a request's drafts follow its known tokens for this step only
        # (verified below; the accepted ones become its tokens when the step resolves). None
        # on a step without drafts, which then skips the per-token arithmetic for them.
        num_drafts: np.ndarray | None = None
        if out.spec_token_ids:
            num_drafts = np.zeros(len(rows), dtype=np.int64)
            for i, r in enumerate(rows):
                drafts = out.spec_token_ids.get(batch.request_ids[r])
                if drafts:
                    num_drafts[i] = len(drafts)
                    known = batch.num_tokens[r]
                    batch.token_ids[r, known : known + len(drafts)] = drafts

        # Flatten: which request each token belongs to, and its position in the sequence.
        req_of_token = np.repeat(np.arange(len(rows)), num_scheduled)
        positions = starts[req_of_token] + (np.arange(total) - query_start_loc[:-1][req_of_token])
        token_rows = rows[req_of_token]
        input_ids: np.ndarray | torch.Tensor = batch.token_ids[token_rows, positions]
        # Tokens past the known ones (and this step's drafts) were sampled by a step whose ids
        # are still on the device.
        known_tokens = batch.num_tokens[token_rows]
        if num_drafts is not None:
            known_tokens += num_drafts[req_of_token]
        pending = positions >= known_tokens
        if pending.any():
            pending_index = np.nonzero(pending)[0]
            input_ids = self.in_flight.input_ids(
                input_ids,
                pending_index,
                [batch.request_ids[r] for r in token_rows[pending_index]],
                self._to_device,
            )
        slot_mappings, block_tables = group_slots_and_tables(
            batch, rows, token_rows, positions, int(seq_lens.max()), self.block_size
        )
        seq_lens_i32 = seq_lens.astype(np.int32)

        # ``positions`` are sequence indices: they placed the K/V slots above and bound
        # attention. The rotary positions are the same array, and the input embeddings are
        # the model's own, except for requests with images (core/multimodal_runner.py):
        # M-RoPE positions, and encoder rows in place of a step's image placeholder tokens.
        rotary_positions = positions
        inputs_embeds: torch.Tensor | None = None
        #: an encoder-decoder's (Whisper's) clips of requests starting this step
        encoder_inputs: list[dict[str, torch.Tensor] | None] | None = None
        scheduled_ids: list[str] = []
        if self.mm:  # (some request in the runner has images; text steps skip all this)
            scheduled_ids = [batch.request_ids[r] for r in rows]
            rotary_positions = self.mm.rotary_positions(scheduled_ids, query_start_loc, positions)
            if isinstance(input_ids, np.ndarray):
                input_ids = self._to_device(input_ids)
            if self.model.is_encoder_decoder:  # (its items feed its encoder, not its rows)
                encoder_inputs = self.mm.encoder_inputs(scheduled_ids, starts)
            else:
                inputs_embeds = self.mm.inputs_embeds(
                    scheduled_ids, starts, num_scheduled, query_start_loc, input_ids
                )
        if self.prompt_embeds:  # prompts given as embeddings: their rows replace the ids'
            ids_of_rows = [batch.request_ids[r] for r in rows]
            if isinstance(input_ids, np.ndarray):
                input_ids = self._to_device(input_ids)
            inputs_embeds = self.prompt_embeds.apply(
                ids_of_rows, starts, num_scheduled, query_start_loc, input_ids, inputs_embeds
            )
        # Gemma 3's image tokens attend to their whole image (attend_limit); only steps with
        # image tokens, which run eager, carry the limits
        attend_limit: np.ndarray | None = None
        if inputs_embeds is not None and self.model.bidirectional_image_blocks:
            attend_limit = self.mm.attend_limits(scheduled_ids, query_start_loc, positions)
            if attend_limit is not None:
                check_attend_limits(attend_limit, seq_lens[req_of_token], scheduled_ids)
        # (a step with images or 3-component positions runs eager: graphs take neither)
        plain_step = inputs_embeds is None and rotary_positions.ndim == 1 and encoder_inputs is None

        if self.lora is not None:
            self.lora.prepare_step(batch.lora_ids[token_rows])
        graphs = self.graphs
        if (
            graphs is not None
            and plain_step
            and total == len(rows)
            and graphs.size_for(total) is not None
        ):
            # Pure decode (one token per request) within the captured sizes: replay.
            hidden = graphs.run(
                input_ids, rotary_positions, slot_mappings, seq_lens_i32, block_tables
            )
            graph_logits = graphs.last_logits
        else:
            graph_logits = None
            # Every group's table and slots (and the shared query_start_loc and seq_lens)
            # reach the device in one copy; step_forward_context is the reference.
            ctx = packed_forward_context(
                query_start_loc,
                seq_lens_i32,
                slot_mappings,
                block_tables,
                int(num_scheduled.max()),
                self._copy_metadata,
                self.kv_caches,
                self.layer_group,
                self.pin_memory,
            )
            if attend_limit is not None:
                ctx.set_attend_limit(self._to_device(attend_limit))
            if self.request_states is not None:
                ctx.request_states = self.request_states.tensors
                ctx.state_slots = self._to_device(
                    self.request_states.slots(batch.request_ids[r] for r in rows)
                )
            if isinstance(input_ids, np.ndarray):
                input_ids = self._to_device(input_ids)
            if plain_step:
                hidden = self.forward(input_ids, self._to_device(rotary_positions), ctx)
            else:  # (the compiled forward takes neither: the model itself, eager)
                extra = {} if encoder_inputs is None else {"encoder_inputs": encoder_inputs}
                hidden = self.model(
                    input_ids,
                    self._to_device(rotary_positions),
                    ctx,
                    inputs_embeds=inputs_embeds,
                    **extra,
                )
        if scheduled_ids:  # encoder outputs of images now wholly computed are dropped
            self.mm.finish_step(scheduled_ids, seq_lens)

        if self.pooler is not None:  # prefill only: pool the states, sample nothing
            batch.num_computed_tokens[rows] = seq_lens
            request_ids = [batch.request_ids[r] for r in rows]
            pooled = self.pooler.pool(hidden, request_ids, starts, num_scheduled, query_start_loc)
            return PendingRunnerOutput.ready(
                ModelRunnerOutput(
                    request_ids=request_ids,
                    sampled_token_ids=[[] for _ in request_ids],
                    pooled=pooled,
                )
            )

        # Rows whose every token, known or in flight, is now computed sample their next one;
        # a request with drafts samples after its last token and after each draft.
        samples = seq_lens >= batch.num_tokens[rows] + batch.num_unresolved[rows]
        sample_idx = np.nonzero(samples)[0]
        request_ids = [batch.request_ids[r] for r in rows]
        # Per logits row: the index (into rows) of its request, and its token's flat position
        # (a request with d drafts has d + 1 consecutive rows, ending at its last token).
        if num_drafts is None:  # one row per sampling request: its last token
            row_of_sample = sample_idx
            sample_token = cu[sample_idx] - 1
        else:
            counts = 1 + num_drafts[sample_idx]
            row_of_sample = np.repeat(sample_idx, counts)
            offsets = np.arange(len(row_of_sample)) - np.repeat(np.cumsum(counts) - counts, counts)
            sample_token = cu[row_of_sample] - np.repeat(counts, counts) + offsets

        prompt_logprobs = self.prompt_logprobs.collect(
            self.model, hidden, request_ids, starts, num_scheduled, query_start_loc
        )

        sample_rows = rows[row_of_sample]
        states = [batch.states[r] for r in sample_rows]
        result = None
        rewinds = None
        if states:
            if len(sample_token) == total and graph_logits is not None:
                logits = graph_logits  # every row samples; the graph computed them
            else:
                if len(sample_token) == total:
                    sample_hidden = hidden  # every token samples, in order: every row
                else:
                    sample_hidden = hidden[self._to_device(sample_token)]
                logits = self.model.compute_logits(sample_hidden).float()
            unresolved = batch.num_unresolved[sample_rows]
            if unresolved.any() and any(
                state.sampling_row.reads_output_history
                for state, n in zip(states, unresolved, strict=True)
                if n
            ):
                # Penalties and min_tokens read the generated tokens: wait for the last ones.
                self.in_flight.resolve_all()
            if out.allowed_token_masks:
                self._mask_disallowed_tokens(logits, states, out.allowed_token_masks)
            metadata_s = build_sampling_metadata(
                [s.sampling_row for s in states], self.device, self.vocab_size
            )
            if self.logits_processors is not None:
                metadata_s.logits_processors = self.logits_processors.bind(
                    LogitsRows.of_step(
                        sample_rows, batch.request_ids, out.spec_token_ids, self._to_device
                    )
                )
            verify = None
            if self.drafter is not None and out.spec_token_ids:
                # rows verifying probabilistic drafts: copied before the sampler edits them
                verify = self.drafter.prepare_verify(
                    logits[:, : self.vocab_size], states, out.spec_token_ids
                )
            if out.spec_token_ids:  # seeded requests' streams: one draw per kept token
                rewinds = stream_rewinds(states, out.spec_token_ids, self.vocab_size)
            result = self.sampler(logits[:, : self.vocab_size], metadata_s)
            check_sampler_output(result, metadata_s, self.sampler)  # plugins: fail by name
            if verify is not None:  # their tokens by rejection sampling instead
                result.sampled_token_ids = self.drafter.verify(verify, result.sampled_token_ids)
            if parallel_state.world_size() > 1:
                # Every rank continues from the driver's tokens: the other ranks' generators
                # need not stay in step with it (rank 0 may share its process with the user's).
                result = dataclasses.replace(
                    result,
                    sampled_token_ids=parallel_state.broadcast_from_driver(
                        result.sampled_token_ids
                    ),
                )

        batch.num_computed_tokens[rows] = seq_lens
        pending = self.in_flight.launch(
            request_ids,
            row_of_sample.tolist(),
            sample_rows,
            states,
            result,
            prompt_logprobs,
            out.spec_token_ids,
            rewinds,
        )
        if self.drafter is not None:
            return self._propose_drafts(pending, rows, starts, hidden, query_start_loc)
        return pending

    def _propose_drafts(
        self,
        pending: PendingRunnerOutput,
        rows: np.ndarray,
        starts: np.ndarray,
        hidden: torch.Tensor,
        query_start_loc: np.ndarray,
    ) -> PendingRunnerOutput:
        """Draft-model speculative decoding: wait for the step (async scheduling is refused
        with it), then let the draft model run over the step's kept tokens and propose the
        next drafts (``ModelRunnerOutput.draft_token_ids``; :mod:`chassis.core.draft_model`).
        An EAGLE head also reads the step's hidden states (:mod:`chassis.core.eagle`)."""
        assert self.drafter is not None
        output = pending.result()
        sampled = np.array([bool(t) for t in output.sampled_token_ids], dtype=bool)
        output.draft_token_ids = self.drafter.propose(
            self.batch, rows, starts, sampled, hidden, query_start_loc
        )
        return PendingRunnerOutput.ready(output)

    def _mask_disallowed_tokens(
        self, logits: torch.Tensor, states: list[RequestState], masks: dict[str, bytes]
    ) -> None:
        """Set ``-inf`` on the logits of the tokens a constrained row may not sample
        (structured outputs), before the sampler sees them: any sampler then keeps to the
        constraint, and logprobs are those of the constrained distribution (as vLLM's)."""
        rows = [i for i, state in enumerate(states) if state.request_id in masks]
        if not rows:
            return
        allowed = unpack_masks([masks[states[i].request_id] for i in rows], self.vocab_size)
        index = self._to_device(np.array(rows, dtype=np.int64))
        constrained = logits[index, : self.vocab_size]
        constrained.masked_fill_(~self._to_device(allowed), float("-inf"))
        logits[index, : self.vocab_size] = constrained

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """One forward over ``num_tokens`` dummy tokens without a KV cache write.

        Shows peak activation memory before the KV cache is sized, and warms up kernels. A
        budget longer than ``max_model_len`` is split into several requests (as a real step
        would be), and logits are computed for as many rows as a step can sample
        (``max_num_seqs``, times ``1 + num_speculative_tokens`` with speculative decoding), so
        that both peaks are seen; with probabilistic drafts, rejection sampling then runs on
        those logits (:meth:`DraftModelProposer.profile_verify`), and the draft model's
        forward follows. A model with per-request recurrent state then runs a decode step
        over as many free state slots as a step holds (:meth:`_profile_state_decode`).
        """
        num_tokens = max(1, num_tokens)
        input_ids, positions, ctx = self._dummy_prefill(num_tokens, self.config.max_model_len)
        if self.lora is not None:
            self.lora.prepare_profile(num_tokens)  # the adapter matmuls' memory too
        hidden = self.forward(input_ids, positions, ctx)
        if self.lora is not None:
            self.lora.deactivate()
        # Speculative decoding samples after each draft too: up to 1 + k rows per request.
        spec = self.config.speculative
        rows_per_seq = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        logits = self.model.compute_logits(
            hidden[: min(self.config.max_num_seqs * rows_per_seq, num_tokens)]
        ).float()
        if self.drafter is not None:  # rejection sampling runs while the step's logits live
            self.drafter.profile_verify(logits)
        del logits, ctx  # (ctx: the dummy caches)
        if self.request_states is not None and self.pooler is None:
            self._profile_state_decode(num_tokens)
        if self.drafter is not None:
            self.drafter.profile_run(num_tokens)

    def _dummy_prefill(
        self, num_tokens: int, max_seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """:func:`dummy_prefill` over this runner's model and KV cache layout (the memory
        profile's steps)."""
        return dummy_prefill(
            num_tokens,
            max_seq_len,
            self.block_size,
            self.model.num_attention_layers,
            self.num_kv_heads,
            self.head_dim,
            self.kv_dtype,
            self.device,
            self._to_device,
            aliased_kv_planes=self.kv_planes == 1,
        )

    def _profile_state_decode(self, num_tokens: int) -> None:
        """One dummy decode step of ``min(max_num_seqs, num_tokens)`` requests over free
        slots of the state pool, zeroed after (:mod:`chassis.core.state_decode_profile`):
        the state mixers' temporaries grow with the requests, and may outgrow the prefill's."""
        assert self.request_states is not None
        num_reqs = min(self.config.max_num_seqs, num_tokens)
        with borrowed_state_slots(self.request_states, num_reqs, self.device) as slots:
            if slots.numel() == 0:
                return
            # one token per request at position 0 (no KV written): the state layers' decode
            # temporaries; attention over long contexts is left to the prefill above
            input_ids, positions, ctx = self._dummy_prefill(slots.numel(), 1)
            ctx.request_states = self.request_states.tensors
            ctx.state_slots = slots
            hidden = self.forward(input_ids, positions, ctx)
            self.model.compute_logits(hidden)  # (every request samples)


def attention_layers(model: CausalLM) -> list[Attention] | None:
    """``model``'s :class:`Attention` layers, in module order; ``None`` when they are not all
    of its ``num_attention_layers`` (some attention is a layer this cannot see)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    return layers if len(layers) == model.num_attention_layers else None


def layer_windows(model: CausalLM) -> list[int | None] | None:
    """Each attention layer's ``sliding_window`` by layer number (None: full attention);
    ``None`` when :func:`attention_layers` cannot see them all or their ``layer_idx`` are
    not ``0 .. num_attention_layers - 1``."""
    num_layers = model.num_attention_layers
    layers = attention_layers(model)
    if layers is None or sorted(m.layer_idx for m in layers) != list(range(num_layers)):
        return None
    windows: list[int | None] = [None] * num_layers
    for layer in layers:
        windows[layer.layer_idx] = layer.sliding_window
    return windows


def layer_chunks(model: CausalLM) -> list[int | None]:
    """Each attention layer's ``attention_chunk_size`` by layer number (None: no chunks), for
    a model whose :func:`layer_windows` are known."""
    chunks: list[int | None] = [None] * model.num_attention_layers
    for layer in attention_layers(model) or []:
        chunks[layer.layer_idx] = layer.attention_chunk_size
    return chunks


def check_attend_limits(
    attend_limit: np.ndarray, token_seq_lens: np.ndarray, request_ids: Sequence[str]
) -> None:
    """A ``RuntimeError`` when a token's attend limit reaches past its request's context this
    step (``token_seq_lens``, per token): the scheduler ended a prefill chunk inside an image
    block whose tokens attend to each other both ways, so keys it needs are not computed."""
    bad = np.nonzero(attend_limit >= token_seq_lens)[0]
    if len(bad):
        raise RuntimeError(
            f"a prefill chunk ends inside an image block (token {int(bad[0])} of the step "
            f"attends up to position {int(attend_limit[bad[0]])}, its context ends at "
            f"{int(token_seq_lens[bad[0]])}; requests {list(request_ids)}): the scheduler must "
            "schedule an image block's remaining tokens in one step "
            "(Request.bidirectional_blocks)"
        )


def host_to_device(array: np.ndarray, device: torch.device, pin_memory: bool) -> torch.Tensor:
    """``array`` as a tensor on ``device``: the host array itself on the CPU, else a
    non-blocking copy (from pinned memory when ``pin_memory``)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if tensor.device == device:
        return tensor
    if pin_memory:
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def group_slots_and_tables(
    batch: InputBatch,
    rows: np.ndarray,
    token_rows: np.ndarray,
    positions: np.ndarray,
    max_seq_len: int,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Every KV cache group's tokens' cache slots (int64, ``[G, T]``: token ``t`` of row
    ``token_rows[t]`` at ``positions[t]``) and the ``rows``' block tables, as wide as
    ``max_seq_len`` needs (int32, ``[G, R, B]``, contiguous); row ``g`` is group ``g``'s."""
    max_blocks = math.ceil(max_seq_len / block_size)
    tables = batch.group_block_table  # [group, row, entry]: every group in one indexing
    block_ids = tables[:, token_rows, positions // block_size].astype(np.int64)
    slot_mappings = block_ids * block_size + positions % block_size
    block_tables = np.ascontiguousarray(tables[:, rows, :max_blocks])
    return slot_mappings, block_tables


def step_forward_context(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: Sequence[np.ndarray],
    slot_mappings: Sequence[np.ndarray],
    max_query_len: int,
    to_device: Callable[[np.ndarray], torch.Tensor],
    kv_caches: list[torch.Tensor],
    layer_group: list[int] | None,
) -> ForwardContext:
    """The forward context of a step with one block table and slot mapping per KV cache
    group (:func:`step_attention_metadata` for each; the groups share the device copies of
    ``query_start_loc`` and ``seq_lens``). ``layer_group`` maps attention layers to groups
    (None: one group).

    The reference path: it copies each array separately (``2 + 2G`` calls of
    ``to_device``); the runner uses :func:`packed_forward_context` (one copy), which tests
    compare with this."""
    first = step_attention_metadata(
        query_start_loc, seq_lens, block_tables[0], slot_mappings[0], max_query_len, to_device
    )
    if layer_group is None:
        return ForwardContext(attn_metadata=first, kv_caches=kv_caches)
    group_metadata = (
        [first]
        + [
            dataclasses.replace(
                first,
                block_table=to_device(table),
                slot_mapping=to_device(slots),
                derived={},  # a backend's memo is per block table
            )
            for table, slots in zip(block_tables[1:], slot_mappings[1:], strict=True)
        ]
    )
    return ForwardContext(
        attn_metadata=first,
        kv_caches=kv_caches,
        group_metadata=group_metadata,
        layer_group=layer_group,
    )


def step_attention_metadata(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    slot_mapping: np.ndarray,
    max_query_len: int,
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> AttentionMetadata:
    """The attention metadata of a forward from its host arrays: ``query_start_loc``
    (int32, ``[R + 1]``), ``seq_lens`` (int32, ``[R]``), the rows' ``block_table``, the
    tokens' ``slot_mapping`` (int64) and the longest query; ``to_device`` copies each to the
    device, and the host ``query_start_loc`` and ``seq_lens`` stay for backends that plan on
    the host."""
    return AttentionMetadata(
        num_actual_tokens=len(slot_mapping),
        num_reqs=len(seq_lens),
        query_start_loc=to_device(query_start_loc),
        seq_lens=to_device(seq_lens),
        block_table=to_device(block_table),
        slot_mapping=to_device(slot_mapping),
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=torch.from_numpy(query_start_loc),
        seq_lens_cpu=torch.from_numpy(seq_lens),
    )


def dummy_prefill(
    num_tokens: int,
    max_model_len: int,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype,
    device: torch.device,
    to_device: Callable[[np.ndarray], torch.Tensor],
    *,
    aliased_kv_planes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
    """``(input_ids, positions, ctx)`` of a memory-profiling forward over ``num_tokens``
    dummy tokens, split into prefills of at most ``max_model_len`` (as a real step would
    be), for a model of ``num_layers`` attention layers.

    Their K/V are not cached (slot -1): ``ctx`` holds one-block dummy caches (with
    ``aliased_kv_planes`` one plane seen as two, as the runner's real caches then are), and
    every block id is 0, that block, so backends that read context through the block table
    stay in it. ``to_device`` copies a host array to ``device``.
    """
    lengths = [max_model_len] * (num_tokens // max_model_len) + (
        [num_tokens % max_model_len] if num_tokens % max_model_len else []
    )
    planes = 1 if aliased_kv_planes else 2
    shape = (1, planes, block_size, num_kv_heads, head_dim)
    dummy_cache = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(num_layers)]
    if aliased_kv_planes:
        dummy_cache = [alias_kv_planes(plane) for plane in dummy_cache]
    starts = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    seq_lens = np.array(lengths, dtype=np.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=len(lengths),
        query_start_loc=to_device(starts),
        seq_lens=to_device(seq_lens),
        block_table=torch.zeros(
            (len(lengths), math.ceil(max(lengths) / block_size)), dtype=torch.int32, device=device
        ),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
        query_start_loc_cpu=torch.from_numpy(starts),
        seq_lens_cpu=torch.from_numpy(seq_lens),
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = to_device(np.concatenate([np.arange(n, dtype=np.int64) for n in lengths]))
    return input_ids, positions, ForwardContext(attn_metadata=metadata, kv_caches=dummy_cache)
