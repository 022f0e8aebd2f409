"""``PriorityScheduler`` (``--scheduler priority``): lower ``priority`` values are served first."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chassis.builtin_plugins.schedulers.continuous import ContinuousBatchingScheduler

if TYPE_CHECKING:
    from chassis.core.request import Request


class PriorityScheduler(ContinuousBatchingScheduler):
    """Priority continuous batching, vLLM's convention: a *lower* ``request.priority`` value is
    more urgent; ties go to the earlier arrival.

    The waiting queue and the running requests are ordered by ``(priority, arrival)``. When
    blocks run out, the running request with the worst key (largest priority value, latest
    arrival) is preempted, and a waiting request may preempt running requests whose key is
    worse than its own to get in.
    """

    uses_priority = True

    def sort_key(self, request: Request) -> tuple[int, int]:
        """``(priority, arrival index)``."""
        return (request.priority, self.arrival_index(request))

    def can_preempt_for(self, request: Request, victim: Request) -> bool:
        """A waiting request may preempt running requests that rank strictly after it."""
        return self.sort_key(victim) > self.sort_key(request)
