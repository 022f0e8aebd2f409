"""Session fixtures are built once per run: no test module imports one.

pytest keeps one fixture definition (and so one cached value) per module that defines a
fixture, and an imported fixture counts as defined there: a session fixture of
``tests/fixtures_*.py`` imported into N test modules ran N + 1 times (SmolLM2's tokenizer
extraction, ~15 s each, four times a run). ``tests/conftest.py`` registers them instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _session_fixtures(module: Path) -> set[str]:
    """Names of the functions of ``module`` decorated ``@pytest.fixture(scope="session")``."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Call) and any(
                keyword.arg == "scope"
                and isinstance(keyword.value, ast.Constant)
                and keyword.value.value == "session"
                for keyword in decorator.keywords
            ):
                names.add(node.name)
    return names


def _star_names(module: Path) -> set[str]:
    """What ``from module import *`` binds: ``__all__`` (every test fixture module has one)."""
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return _session_fixtures(module)  # without __all__, every public name


def test_no_test_module_imports_a_session_fixture() -> None:
    fixture_modules = {path.stem: path for path in TESTS.glob("fixtures_*.py")}
    session = {stem: _session_fixtures(path) for stem, path in fixture_modules.items()}
    assert session["fixtures_models"] >= {"tiny_llama_dir", "smollm2_dir"}  # the scan works
    offenders = []
    for test_file in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(test_file.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.module not in fixture_modules:
                continue
            imported = {alias.name for alias in node.names}
            if "*" in imported:
                imported = _star_names(fixture_modules[node.module])
            for name in sorted(imported & session[node.module]):
                offenders.append(f"{test_file.name}:{node.lineno} imports {name}")
    assert not offenders, "register these in tests/conftest.py instead:\n" + "\n".join(offenders)


def test_the_scan_sees_a_star_import_of_a_session_fixture(tmp_path: Path) -> None:
    """The check above finds what it looks for: a session fixture behind ``*``."""
    module = tmp_path / "fixtures_x.py"
    module.write_text(
        "import pytest\n__all__ = ['shared', 'helper']\n"
        "@pytest.fixture(scope='session')\ndef shared():\n    return 1\n"
        "@pytest.fixture\ndef per_test():\n    return 2\n"
        "def helper():\n    return 3\n"
    )
    assert _session_fixtures(module) == {"shared"}
    assert _star_names(module) & _session_fixtures(module) == {"shared"}
