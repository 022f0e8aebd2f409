"""The engine-wide structured-output settings of vLLM's ``--structured-outputs-config``.

A JSON object (``EngineConfig.structured_outputs_config``) with vLLM's keys:

- ``backend``: the backend plugin by name, the same as ``--structured-output-backend``
  (giving both with different names is a ``ValueError``);
- ``disable_any_whitespace``: every JSON constraint (``json``, ``json_object``,
  ``structural_tag``, a forced tool call's) is compact unless its request sets a whitespace
  option itself (:func:`with_engine_defaults`);
- ``disable_fallback``, ``disable_additional_properties``: accepted, true or false, as on a
  request: the built-in backend has nothing to fall back to and writes declared properties
  only anyway.

Any other key, or a value of the wrong type, is a ``ValueError`` naming the flag.
"""

from __future__ import annotations

from typing import Any

import msgspec

from chassis.core.structured_output import JSON_KINDS, NO_OP_OPTIONS, StructuredOutputsParams

FLAG = "--structured-outputs-config"
_BOOLEAN_KEYS = ("disable_any_whitespace", *NO_OP_OPTIONS)
KEYS = ("backend", *_BOOLEAN_KEYS)


def check_structured_outputs_config(value: Any, backend: str, default_backend: str) -> str:
    """Validate ``value`` (the flag's object) and return the backend to use: its ``backend``
    key, else ``backend`` (``--structured-output-backend``, whose default is
    ``default_backend``). ``ValueError`` naming the flag for an unknown key, a wrong type or
    two different backend names."""
    if not isinstance(value, dict):
        raise ValueError(f"{FLAG} must be a JSON object")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(
            f"{FLAG}: unknown key(s) {', '.join(unknown)} (accepted: {', '.join(KEYS)}; "
            "the reasoning format is --reasoning-parser)"
        )
    for key in _BOOLEAN_KEYS:
        if key in value and not isinstance(value[key], bool):
            raise ValueError(f"{FLAG}: {key} must be true or false")
    named = value.get("backend")
    if named is None or named == "auto":  # vLLM's default: pick the backend; chassis has one
        return backend
    if not isinstance(named, str) or not named:
        raise ValueError(f"{FLAG}: backend must be a backend plugin's name")
    if backend not in (default_backend, named):
        raise ValueError(
            f"{FLAG} names backend {named!r} and --structured-output-backend {backend!r}; give one"
        )
    return named


def with_engine_defaults(
    params: StructuredOutputsParams, config: dict[str, Any] | None
) -> StructuredOutputsParams:
    """``params`` with the engine's ``disable_any_whitespace`` applied: a JSON constraint
    that sets no whitespace option of its own becomes compact; any other is unchanged."""
    if not config or not config.get("disable_any_whitespace"):
        return params
    if params.kind not in JSON_KINDS:
        return params
    if params.disable_any_whitespace or params.whitespace_pattern is not None:
        return params
    return msgspec.structs.replace(params, disable_any_whitespace=True)
