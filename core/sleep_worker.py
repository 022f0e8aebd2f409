"""Sleep mode on one worker (one rank): what its KV cache and weights become, and back.

- ``sleep(level)``: the runner drops its KV caches and decode graphs
  (:meth:`~chassis.core.model_runner.ModelRunner.free_kv_cache`). The weights: at level 1
  they are copied to host memory and their device storages freed, unless the platform's
  device memory is host memory (``Platform.device_memory_is_host_memory``: the CPU), where
  they stay as they are; at level 2 the tensors a checkpoint fills (parameters and
  persistent buffers) are freed, and the rest (rotary tables, LoRA slots, a draft model)
  goes to host memory as at level 1. Whenever weights leave the device, the copies the
  platform prepared from them are dropped first (``Platform.release_prepared_weights``:
  the CPU's packed linear weights). Then ``Platform.empty_cache`` hands the memory back.
- ``wake_up(tags)``: ``"kv_cache"`` allocates zeroed caches of the same size again;
  ``"weights"`` copies them back from host memory, or after level 2 builds the model
  afresh from the checkpoint (the worker's ``rebuild``, the start-up load) and copies its
  tensors into the freed ones (:func:`~chassis.core.sleep_weights.copy_weights_into`),
  then ``Platform.restore_prepared_weights``. Once both are back, the decode graphs are
  captured again (their addresses changed).

Every tensor object stays the one the model, the compiled forward and the platform's
kernels hold (:mod:`chassis.core.sleep_weights`), so nothing else needs to know. The engine
core checks the calls (sleep mode on, valid level and tags, no request unfinished) and
tracks what sleeps (:class:`~chassis.core.sleep_mode.SleepState`); this class trusts them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from chassis.core.sleep_weights import (
    StorageStash,
    checkpoint_tensors,
    copy_weights_into,
    module_tensors,
)

if TYPE_CHECKING:
    from chassis.core.model_runner import ModelRunner
    from chassis.platforms.interface import Platform

logger = logging.getLogger(__name__)


class WorkerSleep:
    """Sleep and wake one worker's ``runner`` on ``platform``.

    :param checkpoint: the model's :func:`checkpoint_tensors`, taken right after loading
        (before LoRA wrappers or platform kernels renamed any module), so that a model
        built afresh by ``rebuild`` names its tensors the same way
    :param rebuild: builds and loads the model as start-up did (level 2's wake-up)
    """

    def __init__(
        self,
        runner: ModelRunner,
        platform: Platform,
        checkpoint: dict[str, torch.Tensor],
        rebuild: Callable[[], nn.Module],
    ) -> None:
        self.runner = runner
        self.platform = platform
        self.checkpoint = checkpoint
        self.rebuild = rebuild
        #: the parts released (``"weights"``, ``"kv_cache"``)
        self.asleep: set[str] = set()
        #: level 2: the checkpoint tensors' storages, discarded
        self._discarded: StorageStash | None = None
        #: the storages copied to host memory (level 1, and level 2's other tensors)
        self._offloaded: StorageStash | None = None
        #: whether decode graphs were captured before the sleep (then again at wake-up)
        self._had_graphs = False
        #: whether the platform's prepared copies were dropped (then rebuilt at wake-up)
        self._released_prepared = False

    def _models(self) -> list[nn.Module]:
        drafter = self.runner.drafter
        return [self.runner.model] + ([drafter.model] if drafter is not None else [])

    def _tensors(self) -> Iterable[torch.Tensor]:
        for model in self._models():
            yield from module_tensors(model)

    # -- sleep ----------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Release the KV cache, and the weights as ``level`` says (module docstring). If
        that fails half-way, what was released is brought back before the error propagates
        (the engine then stays awake). Nothing to do while asleep."""
        if self.asleep:
            return
        start = time.perf_counter()
        self.asleep = {"weights", "kv_cache"}  # from here on, wake_up brings back what is gone
        try:
            weights = self._release(level)
        except BaseException:
            self.wake_up(("weights", "kv_cache"))
            raise
        logger.info(
            "sleep level %d: KV cache freed, weights %s in %.2f s",
            level,
            weights,
            time.perf_counter() - start,
        )

    def _release(self, level: int) -> str:
        """Do :meth:`sleep`'s work; what became of the weights, for the log."""
        self._had_graphs = self.runner.graphs is not None
        self.runner.free_kv_cache()
        on_host = self.platform.device_memory_is_host_memory()
        done: list[str] = []
        if level == 2 or not on_host:
            for model in self._models():
                self.platform.release_prepared_weights(model)
            self._released_prepared = True
            skip: set[int] = set()
            if level == 2:
                self._discarded = StorageStash(self.checkpoint.values())
                self._discarded.discard()
                skip = self._discarded.keys
                done.append(f"freed ({self._discarded.nbytes / 2**20:.0f} MiB)")
            if not on_host:
                self._offloaded = StorageStash(self._tensors(), skip=skip)
                self._offloaded.offload(self.platform.pin_memory_available())
                moved = self._offloaded.nbytes / 2**20
                what = "other tensors" if level == 2 else "weights"
                done.append(f"{what} moved to host memory ({moved:.0f} MiB)")
        self.platform.empty_cache()
        return ", ".join(done) or "kept (device memory is host memory)"

    # -- wake up --------------------------------------------------------------------------

    def wake_up(self, tags: Iterable[str]) -> None:
        """Bring back the parts ``tags`` names (those asleep), in place."""
        waking = [tag for tag in tags if tag in self.asleep]
        if not waking:
            return
        start = time.perf_counter()
        if "weights" in waking:
            self._wake_weights()
            self.asleep.discard("weights")
        if "kv_cache" in waking:
            self.runner.allocate_kv_cache(self.runner.num_kv_blocks)
            self.asleep.discard("kv_cache")
        if not self.asleep and self._had_graphs:
            self.runner.capture_graphs()
        self.platform.empty_cache()
        logger.info("woke up %s in %.2f s", " and ".join(waking), time.perf_counter() - start)

    def _wake_weights(self) -> None:
        if self._discarded is not None:
            with torch.random.fork_rng(devices=[]):  # leave the sampler's host RNG as it was
                fresh = self.rebuild()
            copy_weights_into(self.checkpoint, checkpoint_tensors(fresh), self._discarded)
            del fresh
            self._discarded = None
        if self._offloaded is not None:
            self._offloaded.restore()
            self._offloaded = None
        self.platform.synchronize()
        if self._released_prepared:
            for model in self._models():
                self.platform.restore_prepared_weights(model)
            self._released_prepared = False
