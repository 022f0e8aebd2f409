"""Switches read from the environment, as vLLM reads its ``VLLM_*`` ones."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping


def env_flag_set(names: Iterable[str], environ: Mapping[str, str] | None = None) -> bool:
    """True when any of the variables ``names`` is ``1`` or ``true`` (any case, surrounding
    spaces ignored) in ``environ`` (default: this process's environment)."""
    environ = os.environ if environ is None else environ
    return any(environ.get(name, "0").strip().lower() in ("1", "true") for name in names)
