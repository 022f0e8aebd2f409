"""docs/models.md's table of supported architectures names every architecture the built-in
model plugin registers (a model added without its row fails here), and names nothing that is
not registered."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from chassis.builtin_plugins.models import chassis_register_models

DOCS = Path(__file__).resolve().parent.parent / "docs" / "models.md"


class _Names:
    """A registry that records the names registered with it."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def register(self, name: str, target: Any, *args: Any, **kwargs: Any) -> None:
        self.names.add(name)


def _table_architectures() -> set[str]:
    """The backticked names in the first column of the "Supported architectures" table."""
    text = DOCS.read_text()
    section = text.split("## Supported architectures", 1)[1].split("\n### ", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            # (architecture names are capitalized; a cell may also name a config key)
            names.update(re.findall(r"`([A-Z][A-Za-z0-9_]*)`", first_cell))
    return names


def test_every_registered_architecture_has_a_row() -> None:
    registry = _Names()
    chassis_register_models(registry)
    missing = sorted(registry.names - _table_architectures())
    assert not missing, f"docs/models.md's table lacks rows for {missing}"


def test_every_row_names_a_registered_architecture() -> None:
    registry = _Names()
    chassis_register_models(registry)
    unknown = sorted(_table_architectures() - registry.names)
    assert not unknown, f"docs/models.md's table names unregistered architectures {unknown}"
