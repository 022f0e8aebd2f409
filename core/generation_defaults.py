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

``--override-generation-config`` (vLLM's flag, a dict of the same keys) sets values over
the file's, key by key; with ``--generation-config none`` they are the only defaults, as in
vLLM. A key outside the ones above is refused (vLLM drops it silently), so a typo does not
go unnoticed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: the ``--generation-config`` values that ignore the model's file
IGNORE_VALUES = ("none", "vllm")
#: the generation-config keys that become request defaults (they have the same names in
#: ``SamplingParams``)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FILE_NAME = "generation_config.json"


def generation_defaults(
    source: str, model_dir: str | None, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The sampling defaults ``source`` names, with ``overrides`` set over them.

    ``"auto"`` reads ``model_dir``'s file (none there: no defaults), :data:`IGNORE_VALUES`
    give none, any other value is a folder that must hold a :data:`FILE_NAME`. Raises
    ``ValueError`` for a missing or unreadable named file, for an override key outside
    :data:`SAMPLING_KEYS` and for values
    :class:`~chassis.core.sampling_params.SamplingParams` refuses."""
    defaults = _file_defaults(source, model_dir)
    if overrides:
        check_generation_overrides(overrides)
        defaults.update({k: v for k, v in overrides.items() if v is not None})
        logger.info(
            "default sampling parameters after --override-generation-config: %s",
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )
    return defaults


def check_generation_overrides(overrides: Mapping[str, Any]) -> None:
    """``ValueError`` unless ``overrides`` (``--override-generation-config``) is a dict of
    :data:`SAMPLING_KEYS` with values ``SamplingParams`` accepts."""
    if not isinstance(overrides, Mapping):
        raise ValueError(
            "--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.5}'"
        )
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(
            f"--override-generation-config: unknown key(s) {', '.join(unknown)}; the "
            f"defaults chassis applies are {', '.join(SAMPLING_KEYS)} (a request's length "
            "limit, max_new_tokens, stays the API's)"
        )
    from chassis.core.sampling_params import SamplingParams

    try:
        SamplingParams(**{k: v for k, v in overrides.items() if v is not None})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--override-generation-config: {exc}") from None


def _file_defaults(source: str, model_dir: str | None) -> dict[str, Any]:
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
