"""The built-in structured-output backend ``"chassis"`` (``--structured-output-backend
chassis``), registered through ``chassis.general_plugins``.

Constraints (JSON schema, any JSON object, regex, choice, GBNF grammar with its recursion
unrolled (:mod:`.grammar`), structural tag) compile to a byte-level regular expression
(:mod:`.ir`), then to a lazily built DFA (:mod:`.automaton`) whose states give the
allowed-token masks (:mod:`.token_masks`); :mod:`.backend` ties them to the engine's
:class:`~chassis.core.structured_output.StructuredOutputBackend` interface.
"""

from __future__ import annotations

from typing import Any

from chassis.plugins.hookspecs import hookimpl

_PKG = "chassis.builtin_plugins.structured_output"


@hookimpl
def chassis_register_structured_output_backends(registry: Any) -> None:
    registry.register("chassis", f"{_PKG}.backend:ChassisStructuredOutputBackend")
