"""``template_sjf``: the built-in FCFS scheduler with the policy order "shortest prompt first".

The built-in schedulers share one machinery (``ContinuousBatchingScheduler``: token budget,
KV blocks, chunked prefill, prefix caching, preemption by recompute) and differ only in their
policy hooks. This plugin overrides one, :meth:`sort_key`, which orders the waiting queue:
short prompts are admitted first, which lowers the mean time to first token when long and
short prompts arrive together -- at the risk of starving a long prompt under a steady stream
of short ones, the trade-off a research plugin like this one would measure.
"""

from __future__ import annotations

from chassis.builtin_plugins.schedulers.fcfs import FcfsScheduler
from chassis.core.request import Request


class ShortestPromptFirstScheduler(FcfsScheduler):
    """FCFS, except that requests are ordered by prompt length (shortest first), then arrival.

    The same key orders the running requests within a step and picks the preemption victim
    (the largest key: the longest prompt, latest arrival), as the built-in hooks document.
    """

    def sort_key(self, request: Request) -> tuple[int, int]:
        """``(prompt length, arrival index)``: total, unique per request, stable while queued."""
        return (request.num_prompt_tokens, self.arrival_index(request))
