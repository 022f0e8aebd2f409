"""Built-in logits processors, registered through ``chassis.general_plugins``."""

from __future__ import annotations

from typing import Any

from chassis.plugins.hookspecs import hookimpl


@hookimpl
def chassis_register_logits_processors(registry: Any) -> None:
    registry.register(
        "no_repeat_ngram",
        "chassis.builtin_plugins.logits_processors.no_repeat_ngram:NoRepeatNGramLogitsProcessor",
    )
