"""Default sampling parameters from the model's ``generation_config.json``.

Model makers ship the sampling settings they recommend (Qwen3: ``temperature`` 0.6,
``top_p`` 0.95, ``top_k`` 20) in ``generation_config.json``. As vLLM does by default
(``--generation-config auto``), a request that leaves one of these unset gets the model's
value instead of the engine's neutral default; a value the request sets always wins.
``--generation-config none`` (or ``vllm``, vLLM's spelling) ignores the file; a folder path
reads ``generation_config.json`` from that folder instead of the model's.

The keys read are vLLM's: ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
``repetition_penalty``. ``max_new_tokens``, which vLLM also reads (as a cap on every
request's length), is not applied: a request's length limit stays the API's (16 for
completions, the rest of the context for chat).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: the ``--generation-config`` values that ignore the model's file
IGNORE_VALUES = ("none", "vllm")
#: the generation-config keys that become request defaults (they have the same names in
#: ``SamplingParams``)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FILE_NAME = "generation_config.json"


def generation_defaults(source: str, model_dir: str | None) -> dict[str, Any]:
    """The sampling defaults ``source`` names: ``"auto"`` reads ``model_dir``'s file (none
    there: no defaults), :data:`IGNORE_VALUES` give none, any other value is a folder that
    must hold a :data:`FILE_NAME`. Raises ``ValueError`` for a missing or unreadable named
    file and for values :class:`~chassis.core.sampling_params.SamplingParams` refuses."""
    if source in IGNORE_VALUES:
        return {}
    folder = model_dir if source == "auto" else source
    if folder is None:
        return {}
    path = Path(folder).expanduser() / FILE_NAME
    if not path.is_file():
        if source != "auto":
            raise ValueError(
                f"--generation-config {source!r}: no {FILE_NAME} there; name a folder that "
                f"holds one, or use 'auto' (the model's) or 'none'"
            )
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    defaults = {key: raw[key] for key in SAMPLING_KEYS if raw.get(key) is not None}
    _check(defaults, path)
    if defaults:
        logger.info(
            "default sampling parameters from %s (a request's own values win; "
            "--generation-config none ignores the file): %s",
            path,
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )
    return defaults


def _check(defaults: dict[str, Any], path: Path) -> None:
    from chassis.core.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{path} recommends sampling values chassis cannot use ({exc}); pass "
            "--generation-config none to ignore the file"
        ) from None
