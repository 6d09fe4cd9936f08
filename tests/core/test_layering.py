"""The core knows nothing of the wings that stand on it (recurrent, backends, tools, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "src" / "quantree" / "core"
WINGS = ("quantree.recurrent", "quantree.backends", "quantree.tools", "quantree.workloads")
OUTSIDE_CORE = (*WINGS, "quantree.recipes", "quantree.pipeline", "quantree.capturing")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_module_imports_no_wing(path: Path) -> None:
    bad = [m for m in _imports(path) if m == "quantree" or m.startswith(OUTSIDE_CORE)]
    assert not bad, f"{path.name} imports {bad}"


def test_no_module_imports_prepare_for_its_metadata() -> None:
    """The metadata contract lives in core.stages; prepare is imported only to prepare."""
    src = CORE.parent
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "quantree.core.prepare":
                assert {a.name for a in node.names} <= {"prepare"}, path
