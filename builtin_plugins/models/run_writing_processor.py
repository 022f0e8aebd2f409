"""The prompt expansion of processors whose items stand for runs of several kinds of tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from chassis.core.multimodal import MultiModalFeature
from chassis.core.placeholder_runs import write_placeholder_runs


class RunWritingProcessor:
    """Mixin, listed before a :class:`~chassis.core.multimodal_processing.MultiModalProcessor`
    class, for a processor whose ``process_item`` returns, besides the item's tensors, its
    whole token run (``placeholder_ids``: image rows with the break, tile or timestamp tokens
    around them): :meth:`process` expands the prompt as the base class does, then writes each
    such run over its copies of the placeholder (:func:`write_placeholder_runs`)."""

    def process(
        self,
        prompt_token_ids: Sequence[int],
        items: Mapping[str, Sequence[Any]],
        kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """As the base class's ``process``, then each item's run written into the prompt."""
        expanded, features = super().process(prompt_token_ids, items, kwargs)  # type: ignore[misc]
        return write_placeholder_runs(expanded, features), features
