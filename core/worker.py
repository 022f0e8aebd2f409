"""The worker: one device, its model, KV cache and model runner."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from chassis.core.attention import resolve_kv_cache_dtype
from chassis.core.config import EngineConfig
from chassis.core.in_flight import PendingRunnerOutput
from chassis.core.kv_cache_groups import single_group_window
from chassis.core.kv_cache_manager import max_group_blocks_per_request, max_tokens_per_step
from chassis.core.lora.model import LoRAModel
from chassis.core.model_runner import ModelRunner
from chassis.core.request_state_cache import pool_settings_hint, state_pool_over_budget
from chassis.core.scheduler_interface import ModelRunnerOutput, SchedulerOutput
from chassis.core.sleep_weights import checkpoint_tensors
from chassis.core.sleep_worker import WorkerSleep

if TYPE_CHECKING:
    from chassis.core.attention import AttentionBackend
    from chassis.core.draft_model import DraftModelProposer
    from chassis.core.model_interface import CausalLM

logger = logging.getLogger(__name__)


class Worker:
    """Loads the model on the current platform's device and runs steps on it."""

    def __init__(self, config: EngineConfig, device_index: int = 0) -> None:
        from chassis.core.model_loader import build_model, engine_hf_config, resolve_dtype
        from chassis.platforms import get_current_platform
        from chassis.plugins import get_registries

        self.config = config
        self.platform = get_current_platform()
        self.platform.init_worker_process()
        self.platform.set_device(device_index)
        self.device = self.platform.device(device_index)
        registries = get_registries()

        assert config.model is not None and config.attention_backend is not None
        hf_config = engine_hf_config(config)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.platform)
        backend_cls = registries.attention_backends.get(config.attention_backend)
        torch.manual_seed(config.seed)
        model = build_model(config, hf_config, config.model, backend_cls, self.device, self.dtype)
        if config.data_parallel_rank:
            # Engines of one server build the same weights (same seed above), but draw
            # unseeded samples from streams of their own: two such requests on two fresh
            # engines would otherwise get the same tokens.
            torch.manual_seed(config.seed + config.data_parallel_rank)
        # (named now, before LoRA wrappers or the platform's kernels rename any module)
        checkpoint = checkpoint_tensors(model) if config.enable_sleep_mode else None
        #: the model's LoRA slots (``--enable-lora``), wrapped before the platform swaps the
        #: linear layers' kernels (it then swaps the wrapped ones)
        self.lora: LoRAModel | None = None
        if config.enable_lora:
            self.lora = LoRAModel(
                model,
                max_loras=config.max_loras,
                max_rank=config.max_lora_rank,
                max_cpu_loras=config.max_cpu_loras or config.max_loras,
                max_num_tokens=config.max_num_batched_tokens,
            )
        if not config.torch_compile:
            # Compiled forwards run the layers' torch code, not the platform's kernels, whose
            # weight formats prepare_model would set up.
            self.platform.prepare_model(model)
        sampler = registries.samplers.get(config.sampler)(config)
        drafter = self._load_drafter(hf_config, backend_cls, model)
        self.runner = ModelRunner(
            config,
            model,
            sampler,
            self.device,
            kv_dtype=self.dtype,
            pin_memory=self.platform.pin_memory_available(),
            lora=self.lora,
            drafter=drafter,
        )
        #: sleep mode (``--enable-sleep-mode``); None when off
        self.sleep_mode: WorkerSleep | None = None
        if checkpoint is not None:
            model_path = config.model

            def rebuild() -> torch.nn.Module:
                return build_model(
                    config, hf_config, model_path, backend_cls, self.device, self.dtype
                )

            self.sleep_mode = WorkerSleep(self.runner, self.platform, checkpoint, rebuild)
        logger.info(
            "model loaded on %s (%s) in %s with attention backend %s",
            self.platform.device_name(device_index),
            self.platform.name,
            str(self.dtype).removeprefix("torch."),
            config.attention_backend,
        )

    def _load_drafter(
        self, hf_config: Any, backend_cls: type[AttentionBackend], target: CausalLM
    ) -> DraftModelProposer | None:
        """The draft model of ``--speculative-config`` method ``draft_model``, or the EAGLE
        head of method ``eagle`` / ``eagle3`` over ``target``, beside the target (same device, dtype and
        attention backend); None without one."""
        spec = self.config.speculative
        if spec is None or not spec.uses_draft_model:
            return None
        from chassis.core.draft_model import DraftModelProposer, load_draft_model

        proposer_cls: type[DraftModelProposer] = DraftModelProposer
        if spec.uses_eagle3:
            from chassis.core.eagle3 import Eagle3Proposer, load_eagle3_head

            draft = load_eagle3_head(self.config, target, backend_cls, self.device, self.dtype)
            proposer_cls = Eagle3Proposer
        elif spec.uses_mtp:  # the target checkpoint's MTP layer, run as an EAGLE-1 head
            from chassis.core.eagle import EagleProposer
            from chassis.core.mtp import load_mtp_head

            draft = load_mtp_head(self.config, target, backend_cls, self.device, self.dtype)
            proposer_cls = EagleProposer
        elif spec.uses_eagle:
            from chassis.core.eagle import EagleProposer, load_eagle_head

            draft = load_eagle_head(self.config, target, backend_cls, self.device, self.dtype)
            proposer_cls = EagleProposer
        else:
            draft = load_draft_model(self.config, hf_config, backend_cls, self.device, self.dtype)
        # the platform's kernels (the draft runs eager, even with --torch-compile)
        self.platform.prepare_model(draft)
        return proposer_cls(
            self.config,
            draft,
            self.device,
            # the target's cache dtype (``--kv-cache-dtype``), resolved as the runner does
            resolve_kv_cache_dtype(self.config.kv_cache_dtype, self.dtype),
            pin_memory=self.platform.pin_memory_available(),
        )

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit; ``config.num_kv_blocks`` overrides memory sizing."""
        config = self.config
        assert config.max_model_len is not None
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            profiled = []

            def profile() -> None:
                profiled.append(True)
                self.runner.profile_run(config.max_num_batched_tokens)

            budget = self.platform.determine_kv_cache_memory(config, profile)
            states = self.runner.request_states
            if states is not None and not profiled:
                # A fixed budget (--kv-cache-memory, the CPU's) holds the requests' recurrent
                # states too; a profiled one already counted them (allocated before).
                budget -= states.nbytes
            if states is not None and budget < 0:
                # (also for a model without attention layers, whose blocks cost nothing)
                raise ValueError(state_pool_over_budget(states, budget, profiled=bool(profiled)))
            bytes_per_block = self.runner.kv_cache_bytes_per_block()
            if bytes_per_block == 0:
                # No attention layer, nothing cached: blocks cost nothing, so give every
                # sequence its longest context.
                num_blocks = config.max_num_seqs * -(-config.max_model_len // config.block_size)
            else:
                num_blocks = max(budget, 0) // bytes_per_block
        # One request of --max-model-len must fit: all its blocks, or, when the KV cache
        # manager releases what a sliding window left, the most it holds at once (plus the
        # reserved null block); with KV cache groups, every group's blocks together.
        windows = self.kv_cache_group_windows()
        chunks = self.kv_cache_group_chunks()
        window = single_group_window(windows)
        step_tokens = max_tokens_per_step(config)
        needed = max_group_blocks_per_request(
            config.max_model_len, config.block_size, windows, step_tokens, chunks
        )
        has_window = any(w is not None for w in windows) or any(c is not None for c in chunks)
        usable = num_blocks - (1 if has_window else 0)
        if usable < needed:
            if len(windows) > 1:
                chunk_note = f", chunks {list(chunks)}" if any(chunks) else ""
                what = (
                    f"one request of --max-model-len {config.max_model_len} holds at once "
                    f"({needed} blocks over its {len(windows)} KV cache groups, windows "
                    f"{list(windows)}{chunk_note}, with a step of up to {step_tokens} tokens, "
                    "beside the null block)"
                )
            elif window is None:
                what = f"one sequence of --max-model-len {config.max_model_len} needs"
            else:
                what = (
                    f"one request of --max-model-len {config.max_model_len} holds at once "
                    f"({needed} blocks: its sliding window of {window} tokens and a step of "
                    f"up to {step_tokens}, beside the null block)"
                )
            # name the setting that sized the cache: --num-kv-blocks overrides the memory ones
            raise_what = (
                "--num-kv-blocks"
                if config.num_kv_blocks is not None
                else "--kv-cache-memory / --gpu-memory-utilization"
            )
            states = self.runner.request_states
            pool_note = (
                ""
                if states is None or config.num_kv_blocks is not None
                else f" (the per-request recurrent state pool, {states.describe()}, comes out of "
                f"the same memory: {pool_settings_hint(states.specs)})"
            )
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * config.block_size} "
                f"tokens), fewer than {what}; raise {raise_what} or lower --max-model-len"
                f"{pool_note}"
            )
        return num_blocks

    def kv_cache_window(self) -> int | None:
        """The sliding window whose left-behind blocks the KV cache manager releases
        (``ModelRunner.kv_cache_window``), or ``None``: every layer needs every position, or
        ``--no-sliding-window-kv-release``."""
        if not self.config.sliding_window_kv_release:
            return None
        return self.runner.kv_cache_window()

    def kv_cache_group_windows(self) -> tuple[int | None, ...]:
        """The window of each KV cache group (``ModelRunner.kv_groups``) for the KV cache
        manager; one group: ``(kv_cache_window(),)``."""
        groups = self.runner.kv_groups
        if groups is not None:
            return tuple(group.window for group in groups)
        return (self.kv_cache_window(),)

    def kv_cache_group_chunks(self) -> tuple[int | None, ...]:
        """The attention chunk size of each KV cache group (``None``: not a chunk group,
        whose blocks before a request's current chunk the KV cache manager releases), as
        many as :meth:`kv_cache_group_windows`."""
        groups = self.runner.kv_groups
        if groups is not None:
            return tuple(group.chunk for group in groups)
        return (None,)

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def sleep(self, level: int) -> None:
        """Sleep mode: release the KV cache and the weights as ``level`` says
        (:class:`~chassis.core.sleep_worker.WorkerSleep`)."""
        self._sleep_mode().sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        """Sleep mode: bring back the parts ``tags`` names (``"weights"``, ``"kv_cache"``)."""
        self._sleep_mode().wake_up(tags)

    def _sleep_mode(self) -> WorkerSleep:
        if self.sleep_mode is None:
            raise ValueError("sleep mode is off: start the engine with --enable-sleep-mode")
        return self.sleep_mode

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingRunnerOutput:
        return self.runner.execute_model_async(scheduler_output)
