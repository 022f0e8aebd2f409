"""``FcfsScheduler`` (``--scheduler fcfs``, the default): first come, first served."""

from __future__ import annotations

from chassis.builtin_plugins.schedulers.continuous import ContinuousBatchingScheduler


class FcfsScheduler(ContinuousBatchingScheduler):
    """First come, first served continuous batching.

    Requests are admitted in arrival order (``add_request`` order) and never overtake each
    other; a request that does not fit waits for blocks to be freed. When a running request
    needs a block and none is free, the most recently arrived running request is preempted
    (possibly the one asking). These are the base class's default policy hooks.
    """
