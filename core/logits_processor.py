"""Custom logits processors: batch-level edits of the logits before a token is sampled.

A logits processor is a plugin (``chassis_register_logits_processors``) selected with
``--logits-processors a,b`` (or a qualified ``"package.module:Class"``). The engine builds one
instance of each per model runner, tells it before every step which requests joined, left or
moved within the persistent batch (:class:`BatchUpdate`), and lets it edit the logits of the
rows that sample (:meth:`LogitsProcessor.apply`). Per-request arguments travel in
``SamplingParams.extra_args`` (the API's ``vllm_xargs``), checked by
:meth:`LogitsProcessor.validate_params` when the request is admitted.

The shape is vLLM V1's (``update_state``/``apply``/``is_argmax_invariant``/``validate_params``),
with two differences that come from chassis' runner: a logits row is not a batch row (only
the requests that sample this step have logits, and under speculative decoding a request has
one row after its last token and one after each draft), so :meth:`~LogitsProcessor.apply`
receives the step's :class:`LogitsRows`; and processors may verify drafts
(:attr:`~LogitsProcessor.supports_drafts`) instead of turning speculative decoding off.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class AddedRequest:
    """A request that entered the persistent batch at ``row``.

    ``output_token_ids`` is the runner's own list, not a copy: tokens appended to it later
    show up, so a processor may keep the reference instead of being told each new token.
    ``prompt_token_ids`` never changes. Neither may be modified.
    """

    row: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass(frozen=True, slots=True)
class MovedRequest:
    """The request at row ``src`` now lives at row ``dst``; ``src`` is empty afterwards."""

    src: int
    dst: int


@dataclass(frozen=True)
class BatchUpdate:
    """How the persistent batch changed since the previous update.

    Rows are those of the previous layout. Apply it in this order: forget the requests at
    ``removed`` rows, then perform ``moved`` (a move's ``src`` is never another move's
    ``dst``, so their order does not matter), then record ``added``. A removed row may be
    refilled by a move or an add of the same update. Afterwards rows ``0 .. batch_size - 1``
    hold the batch's requests.
    """

    batch_size: int
    removed: tuple[int, ...] = ()
    moved: tuple[MovedRequest, ...] = ()
    added: tuple[AddedRequest, ...] = ()


class BatchUpdateBuilder:
    """Collects the persistent batch's changes as they happen (``InputBatch`` calls it) and
    turns them into one :class:`BatchUpdate` relative to the rows of the previous update.

    It tracks where each row's current request came from (a row of the previous layout, or
    an add of this update), so any interleaving of adds, removals and moves reduces to: the
    requests that left, one move per request that changed rows, one add per request that
    joined and is still there (reported at its final row).
    """

    def __init__(self) -> None:
        #: row -> its request's origin since the last build: ``("old", previous row)``,
        #: ``("new", AddedRequest)`` or None (empty); untouched rows are absent
        self._origin: dict[int, tuple[str, int | AddedRequest] | None] = {}
        #: previous rows whose request left the batch
        self._removed: set[int] = set()

    def _origin_of(self, row: int) -> tuple[str, int | AddedRequest] | None:
        return self._origin.get(row, ("old", row))

    def add(self, request: AddedRequest) -> None:
        """``request`` entered the batch at ``request.row`` (an empty row)."""
        self._origin[request.row] = ("new", request)

    def remove(self, row: int, moved_from: int | None) -> None:
        """The request at ``row`` left; the one at ``moved_from`` (the last row), if any,
        moved into its place."""
        origin = self._origin_of(row)
        if origin is not None and origin[0] == "old":
            self._removed.add(origin[1])  # type: ignore[arg-type]
        if moved_from is None:
            self._origin[row] = None
        else:
            self._origin[row] = self._origin_of(moved_from)
            self._origin[moved_from] = None

    def build(self, batch_size: int) -> BatchUpdate | None:
        """The update since the last ``build`` (``None`` when nothing changed); resets."""
        if not (self._origin or self._removed):
            return None
        moved: list[MovedRequest] = []
        added: list[AddedRequest] = []
        for row, origin in sorted(self._origin.items()):
            if origin is None:
                continue
            kind, what = origin
            if kind == "old" and what != row:
                moved.append(MovedRequest(what, row))  # type: ignore[arg-type]
            elif kind == "new":
                request: AddedRequest = what  # type: ignore[assignment]
                if request.row != row:
                    request = AddedRequest(
                        row, request.params, request.prompt_token_ids, request.output_token_ids
                    )
                added.append(request)
        update = BatchUpdate(batch_size, tuple(sorted(self._removed)), tuple(moved), tuple(added))
        self._origin, self._removed = {}, set()
        return update


@dataclass
class LogitsRows:
    """Which request each row of this step's logits belongs to.

    Row ``i`` of the logits is request ``batch_rows[i]`` of the persistent batch (the rows
    of :class:`BatchUpdate`). Under speculative decoding a request has several consecutive
    logits rows: the one after its last token, then one after each of its drafts; row ``i``
    follows the request's tokens plus its first ``num_drafts_before[i]`` drafts.
    """

    #: [num_logits_rows] int64, host
    batch_rows: np.ndarray
    #: ``batch_rows`` on the logits' device (copied without waiting for the device)
    batch_rows_device: torch.Tensor
    #: [num_logits_rows] int64, host: drafts the row's position follows; None: no drafts
    num_drafts_before: np.ndarray | None = None
    #: batch row -> the draft tokens the step verifies for that request
    drafts: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def of_step(
        cls,
        batch_rows: np.ndarray,
        request_ids: Sequence[str],
        spec_token_ids: dict[str, list[int]] | None,
        to_device: Callable[[np.ndarray], torch.Tensor],
    ) -> LogitsRows:
        """The rows of a step whose logits row ``i`` is batch row ``batch_rows[i]`` (a
        request with drafts: consecutive rows), ``request_ids`` the batch's and
        ``spec_token_ids`` the step's drafts by request id."""
        batch_rows = np.asarray(batch_rows, dtype=np.int64)
        device_rows = to_device(batch_rows)
        if not spec_token_ids:
            return cls(batch_rows, device_rows)
        n = len(batch_rows)
        index = np.arange(n)
        first = np.ones(n, dtype=bool)
        first[1:] = batch_rows[1:] != batch_rows[:-1]
        # each row's offset from the first row of its request
        before = index - np.maximum.accumulate(np.where(first, index, 0))
        drafts = {}
        for r in batch_rows[first].tolist():
            tokens = spec_token_ids.get(request_ids[r])
            if tokens:
                drafts[r] = list(tokens)
        return cls(batch_rows, device_rows, before.astype(np.int64), drafts)

    @property
    def num_rows(self) -> int:
        return len(self.batch_rows)

    def draft_prefix(self, i: int) -> list[int]:
        """The draft tokens that precede logits row ``i`` (``[]`` for a plain row): a
        processor that reads a request's tokens must read these after them."""
        if self.num_drafts_before is None:
            return []
        k = int(self.num_drafts_before[i])
        return self.drafts[int(self.batch_rows[i])][:k] if k else []


class LogitsProcessor(ABC):
    """Edits the logits of the requests it acts on, for the whole batch at once.

    Register the class with ``chassis_register_logits_processors``; ``--logits-processors``
    selects it. The engine makes one instance per model runner (per tensor-parallel rank),
    with the engine config, the logits' device and whether pinned host memory is available.

    Every step the runner calls :meth:`update_state` (always, also with ``None`` when the
    batch did not change), then, if some row samples, :meth:`apply`. The sampler calls
    processors whose :meth:`is_argmax_invariant` is False after its own ``allowed_token_ids``,
    ``logit_bias``, ``min_tokens`` and bad-word edits and before the penalties (vLLM V1's
    order); argmax-invariant ones after the temperature and min-p, before top-k/top-p, and
    not at all on a step where every row is greedy (docs/sampling.md).

    ``apply`` must not wait for the device (no ``.item()``, ``.tolist()``, ``.cpu()`` of
    device tensors, no ``nonzero`` whose size the host must know): build index tensors on the
    host from the state :meth:`update_state` gave, and copy them with ``non_blocking``.
    """

    #: whether :meth:`apply` handles rows after draft tokens (:meth:`LogitsRows.draft_prefix`);
    #: requests a processor without it acts on get no drafts (``SamplingParams.allow_drafts``)
    supports_drafts: ClassVar[bool] = False
    #: whether :meth:`apply` reads the requests' generated tokens: then, under async
    #: scheduling, the runner waits for a step's tokens still in flight before applying it
    #: to the requests it acts on (a host synchronization those steps pay)
    reads_output_tokens: ClassVar[bool] = False

    def __init__(self, config: EngineConfig, device: torch.device, pin_memory: bool) -> None:
        self.config = config
        self.device = device
        self.pin_memory = pin_memory

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Check a request's arguments (``params.extra_args``) when it is admitted, in the
        front-end; raise ``ValueError`` with a message for the client (HTTP 400). The
        default accepts everything."""
        return None

    @classmethod
    def acts_on(cls, params: SamplingParams) -> bool:
        """Whether this processor may change the logits of a request with ``params`` (the
        default: every request). Decides which requests lose their drafts
        (:attr:`supports_drafts`) and which wait for in-flight tokens
        (:attr:`reads_output_tokens`); :meth:`apply` must leave other rows alone."""
        return True

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes which token has the largest logit (it only
        reshapes the distribution, like min-p): greedy rows may then skip it."""

    @abstractmethod
    def update_state(self, update: BatchUpdate | None) -> None:
        """Take the batch's changes since the previous call (``None``: none); see
        :class:`BatchUpdate` for the order to apply them in."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: LogitsRows) -> torch.Tensor:
        """Edit ``logits`` (``[rows.num_rows, vocab_size]`` float32, modifiable in place)
        and return them (the same tensor or a new one of the same shape)."""


def uses_drafts_or_history(
    classes: Sequence[type[LogitsProcessor]], params: SamplingParams
) -> tuple[bool, bool]:
    """``(blocks_drafts, reads_output_tokens)`` of the processors ``classes`` for a request
    with ``params``: whether one that cannot verify drafts acts on it, and whether one that
    reads generated tokens does."""
    acting = [cls for cls in classes if cls.acts_on(params)]
    return (
        any(not cls.supports_drafts for cls in acting),
        any(cls.reads_output_tokens for cls in acting),
    )


def admit_params(
    classes: Sequence[type[LogitsProcessor]], params: SamplingParams
) -> SamplingParams:
    """A request's params checked by every active processor (``validate_params``; its
    ``ValueError`` propagates), with ``allow_drafts=False`` when one that cannot verify
    drafts acts on it. Called by the input processor, in the front-end."""
    for cls in classes:
        cls.validate_params(params)
    blocks_drafts, _ = uses_drafts_or_history(classes, params)
    if blocks_drafts and params.allow_drafts:
        return params.clone(allow_drafts=False)
    return params


def resolve_logits_processor(name: str) -> type[LogitsProcessor]:
    """The class ``--logits-processors`` names: a registered name, or a qualified
    ``"package.module:Class"`` (vLLM's form) that is imported.

    :raises ValueError: an unknown name (the message lists the registered ones), a
        qualified name that does not import, or a class that is not a
        :class:`LogitsProcessor`
    """
    from chassis.plugins import get_registries
    from chassis.plugins.registry import import_subclass

    registry = get_registries().logits_processors
    if name in registry or ":" not in name:
        return registry.get(name)  # UnknownNameError (a ValueError) lists the known names
    return import_subclass(name, LogitsProcessor, "logits processor")


def resolve_logits_processors(names: Sequence[str]) -> list[type[LogitsProcessor]]:
    """:func:`resolve_logits_processor` of each name; a name given twice is an error."""
    if len(set(names)) != len(names):
        raise ValueError(f"--logits-processors names a processor twice: {list(names)}")
    return [resolve_logits_processor(name) for name in names]


def check_logits_processors(
    names: Sequence[str], sampler_cls: type, sampler_name: str
) -> list[type[LogitsProcessor]]:
    """Resolve ``--logits-processors`` in the front-end and check that the sampler runs
    them (``Sampler.supports_logits_processors``); ``ValueError`` otherwise."""
    classes = resolve_logits_processors(names)
    if classes and not getattr(sampler_cls, "supports_logits_processors", False):
        raise ValueError(
            f"--logits-processors needs a sampler that runs them; sampler {sampler_name!r} "
            "does not (Sampler.supports_logits_processors); use --sampler default"
        )
    return classes


class LogitsProcessors:
    """The engine's active processors in ``--logits-processors`` order, split as the sampler
    calls them."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = list(processors)
        self.classes = [type(p) for p in self.processors]
        self.non_argmax_invariant = [p for p in self.processors if not p.is_argmax_invariant()]
        self.argmax_invariant = [p for p in self.processors if p.is_argmax_invariant()]

    @classmethod
    def build(
        cls, config: EngineConfig, device: torch.device, pin_memory: bool
    ) -> LogitsProcessors | None:
        """One instance of each processor ``config.logits_processors`` names; None if none."""
        names = list(getattr(config, "logits_processors", None) or [])
        if not names:
            return None
        return cls([c(config, device, pin_memory) for c in resolve_logits_processors(names)])

    def request_flags(self, params: SamplingParams) -> tuple[bool, bool]:
        """:func:`uses_drafts_or_history` for the active processors."""
        return uses_drafts_or_history(self.classes, params)

    def update_state(self, update: BatchUpdate | None) -> None:
        for processor in self.processors:
            processor.update_state(update)

    def bind(self, rows: LogitsRows) -> StepLogitsProcessors:
        """The processors with this step's rows, for ``SamplingMetadata.logits_processors``."""
        return StepLogitsProcessors(self, rows)


@dataclass
class StepLogitsProcessors:
    """What a sampler calls: the active processors bound to one step's logits rows."""

    processors: LogitsProcessors
    rows: LogitsRows

    def apply_non_argmax_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        """Run the processors that may change greedy choices (before the penalties)."""
        return self._run(self.processors.non_argmax_invariant, logits)

    def apply_argmax_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        """Run the argmax-invariant processors (after temperature and min-p)."""
        return self._run(self.processors.argmax_invariant, logits)

    def _run(self, processors: list[LogitsProcessor], logits: torch.Tensor) -> torch.Tensor:
        for processor in processors:
            out = processor.apply(logits, self.rows)
            if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise TypeError(
                    f"logits processor {type(processor).__qualname__}.apply returned {shape}; "
                    f"expected a tensor of shape {tuple(logits.shape)}"
                )
            logits = out
        return logits
