"""Steps whose sampled ids are still on their way to the host, and what the next step reads.

The model runner hands each step's sampled ids to :class:`InFlightSteps` as device tensors.
It starts their copy to the host (pinned memory, non-blocking), records a device event after
it and returns a :class:`PendingRunnerOutput` at once, so the host can plan and launch the
next step while the device still computes this one (async scheduling). Until the ids are
resolved, the next step reads the tokens it must decode straight from the device tensor
(:meth:`InFlightSteps.input_ids`), and the persistent batch counts them in
``InputBatch.num_unresolved``.

Resolution is in step order: resolving a step resolves every older one first. It waits for
the event, appends each sampled token to its request's row (if that request is still in the
batch: one preempted or finished meanwhile no longer is) and builds the step's
``ModelRunnerOutput``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from chassis.core.request import TokenLogprobs
from chassis.core.sampler_interface import SampledLogprobs
from chassis.core.scheduler_interface import ModelRunnerOutput
from chassis.core.speculative import accepted_tokens

if TYPE_CHECKING:
    from chassis.core.input_batch import InputBatch, RequestState
    from chassis.core.sampler_interface import SamplerOutput
    from chassis.core.seeded_drafts import StreamRewind
    from chassis.platforms.interface import DeviceEvent, Platform

_HOST = torch.device("cpu")


class PendingRunnerOutput:
    """A step's :class:`ModelRunnerOutput`, which the device may still be computing.

    :meth:`result` waits for it (and for every older step of the same runner); calling it
    again returns the same object.
    """

    def __init__(self, resolve: Callable[[], ModelRunnerOutput]) -> None:
        self._resolve = resolve
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> PendingRunnerOutput:
        """An already known output (a step that sampled nothing, or ran synchronously)."""
        pending = cls(lambda: output)
        pending._output = output
        return pending

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._resolve()
        return self._output


@dataclass
class _Step:
    """One launched step: what its output needs once the ids are on the host."""

    request_ids: list[str]
    #: per sampling row (logits order): its index in ``request_ids``
    sample_positions: list[int]
    #: per sampling row: the request's runner state when it sampled (identity = incarnation)
    states: list[RequestState]
    #: ``[rows]`` sampled ids on the host (filled by a non-blocking copy before ``event``)
    token_ids: torch.Tensor
    logprobs: SampledLogprobs | None
    prompt_logprobs: dict[str, list[TokenLogprobs | None]]
    event: DeviceEvent
    #: request id -> the draft tokens its rows verify (speculative decoding)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    #: request id -> how to put a seeded request's generator back after its verify rows
    rewinds: dict[str, StreamRewind] = field(default_factory=dict)
    output: ModelRunnerOutput | None = None


@dataclass
class _LastSampled:
    """The most recent step's sampled ids, on the device, by request."""

    token_ids: torch.Tensor
    index_of: dict[str, int]


class InFlightSteps:
    """The model runner's launched-but-unresolved steps, oldest first."""

    def __init__(self, batch: InputBatch, platform: Platform, pin_memory: bool) -> None:
        self.batch = batch
        self.platform = platform
        self.pin_memory = pin_memory
        self._steps: deque[_Step] = deque()
        self._last: _LastSampled | None = None

    @property
    def num_unresolved_steps(self) -> int:
        return len(self._steps)

    # -- the next step's inputs --------------------------------------------------------------

    def input_ids(
        self,
        input_ids: np.ndarray,
        pending_index: np.ndarray,
        pending_request_ids: list[str],
        to_device: Callable[[np.ndarray], torch.Tensor],
    ) -> torch.Tensor:
        """The step's ``input_ids`` on the device, where the tokens at ``pending_index`` (not
        known on the host) are those the previous step sampled for ``pending_request_ids``.

        No device-to-host copy: the ids are gathered on the device.

        :raises RuntimeError: a pending token's request did not sample in the previous step
            (the scheduler and the runner disagree about which tokens exist)
        """
        last = self._last
        index_of = last.index_of if last is not None else {}
        try:
            src = [index_of[r] for r in pending_request_ids]
        except KeyError as exc:
            raise RuntimeError(
                f"request {exc.args[0]!r} is scheduled to decode a token that the previous "
                "step did not sample"
            ) from None
        assert last is not None  # some pending id was found in it
        sampled = last.token_ids
        if len(pending_index) == len(input_ids):
            if src == list(range(len(sampled))):
                return sampled  # steady decode: the same requests in the same order
            return sampled[to_device(np.array(src, dtype=np.int64))]
        ids = to_device(input_ids)
        ids[to_device(pending_index)] = sampled[to_device(np.array(src, dtype=np.int64))]
        return ids

    # -- launch and resolve ----------------------------------------------------------------

    def launch(
        self,
        request_ids: list[str],
        sample_positions: list[int],
        sample_rows: np.ndarray,
        states: list[RequestState],
        result: SamplerOutput | None,
        prompt_logprobs: dict[str, list[TokenLogprobs | None]],
        drafts: dict[str, list[int]] | None = None,
        rewinds: dict[str, StreamRewind] | None = None,
    ) -> PendingRunnerOutput:
        """Register a step the device is computing.

        ``result`` holds the ids (and logprobs) sampled for the requests at
        ``sample_positions`` of ``request_ids``, whose batch rows are ``sample_rows`` and
        runner states ``states``; it is ``None`` when no row sampled. A request with
        ``drafts`` (speculative decoding) has one sampling row after its last token and one
        after each draft, consecutive; its tokens are the drafts the model chose and the
        model's next one (:func:`~chassis.core.speculative.accepted_tokens`); a seeded one's
        generator is then rewound to one draw per token by its entry in ``rewinds``
        (:mod:`chassis.core.seeded_drafts`).
        """
        if result is None:
            self._last = None
            output = ModelRunnerOutput(
                request_ids=request_ids,
                sampled_token_ids=[[] for _ in request_ids],
                prompt_logprobs=prompt_logprobs,
            )
            return PendingRunnerOutput.ready(output)
        sampled = result.sampled_token_ids
        self._last = _LastSampled(
            sampled, {request_ids[i]: j for j, i in enumerate(sample_positions)}
        )
        logprobs = result.logprobs
        if logprobs is not None:
            logprobs = SampledLogprobs(
                token_ids=self._to_host(logprobs.token_ids),
                logprobs=self._to_host(logprobs.logprobs),
                ranks=self._to_host(logprobs.ranks),
            )
        step = _Step(
            request_ids=request_ids,
            sample_positions=sample_positions,
            states=states,
            token_ids=self._to_host(sampled),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            event=self.platform.record_event(),
            drafts=drafts or {},
            rewinds=rewinds or {},
        )
        # (a request with drafts has several sampling rows, yet one step in flight)
        self.batch.num_unresolved[np.unique(sample_rows) if drafts else sample_rows] += 1
        self._steps.append(step)
        return PendingRunnerOutput(lambda: self._resolve_through(step))

    def resolve_all(self) -> None:
        """Wait for every launched step and apply its tokens to the batch."""
        while self._steps:
            self._resolve(self._steps.popleft())

    def _resolve_through(self, step: _Step) -> ModelRunnerOutput:
        while step.output is None:
            self._resolve(self._steps.popleft())
        return step.output

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == _HOST:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin_memory)
        host.copy_(tensor, non_blocking=self.pin_memory)
        return host

    def _resolve(self, step: _Step) -> None:
        step.event.synchronize()
        batch = self.batch
        token_ids = step.token_ids.tolist()
        sampled: list[list[int]] = [[] for _ in step.request_ids]
        first_row: dict[int, int] = {}  # request index -> its first sampling row
        for j, i in enumerate(step.sample_positions):
            sampled[i].append(int(token_ids[j]))
            first_row.setdefault(i, j)
        for i, j in first_row.items():
            request_id = step.request_ids[i]
            drafts = step.drafts.get(request_id)
            if drafts:
                sampled[i] = accepted_tokens(sampled[i], drafts)
            row = batch.row_of.get(request_id)
            # The same incarnation of the request (not one re-added after a preemption).
            if row is not None and batch.states[row] is step.states[j]:
                batch.num_unresolved[row] -= 1
                for token_id in sampled[i]:
                    batch.append_token(row, token_id)
                if drafts:  # the rejected drafts' positions are not computed after all
                    batch.num_computed_tokens[row] -= len(drafts) + 1 - len(sampled[i])
                rewind = step.rewinds.get(request_id)
                if rewind is not None:
                    rewind.apply(len(sampled[i]))
        logprobs: list[TokenLogprobs | None] | None = None
        if step.logprobs is not None:
            logprobs = [None] * len(step.request_ids)
            for j, i in enumerate(step.sample_positions):
                num = step.states[j].sampling_params.logprobs
                logprobs[i] = _row_logprobs(step.logprobs, j, num)
        step.output = ModelRunnerOutput(
            request_ids=step.request_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=step.prompt_logprobs,
        )


def _row_logprobs(logprobs: SampledLogprobs, j: int, num: int | None) -> TokenLogprobs | None:
    if num is None:
        return None
    k = 1 + num
    return TokenLogprobs(
        token_ids=[int(t) for t in logprobs.token_ids[j, :k].tolist()],
        logprobs=[float(x) for x in logprobs.logprobs[j, :k].tolist()],
        rank=int(logprobs.ranks[j]),
    )
