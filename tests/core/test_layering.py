"""The wings stand in one order, and no import runs back up it (DESIGN.md, "Package layout").

core < recurrent < recipes < backends < tools < the package face (``__init__.py``,
``pipeline.py``) < ``quantree_cli`` (the command's argument parsing, a package of its own so
that it runs before torch is imported; it imports no torch and no quantree at module level):
a module imports only from its own wing or the wings below it. Every
import counts, function-local ones included (the whole syntax tree is walked), since a
function-local import is a dependency all the same, only a later one. Between modules there
is no cycle, and no module imports another's private name (``_x``): if two modules need it,
it is not private.

The module graph is read from the source files, so the checks run on any tree: the first
test's failure names the module and the import to move.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
WINGS = (
    ("core", ("quantree.core",)),
    ("recurrent", ("quantree.recurrent",)),
    ("recipes", ("quantree.recipes",)),
    ("backends", ("quantree.backends",)),
    ("tools", ("quantree.tools", "quantree.workloads")),
    ("face", ("quantree", "quantree.pipeline")),
    ("cli", ("quantree_cli",)),
)
"""Each wing and the modules it holds (a name and everything under it), bottom first."""
FACE = {"quantree", "quantree.pipeline"}
PACKAGES = ("quantree", "quantree_cli")
"""The top-level packages under src/: the library, and the command line standing above it."""


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``'s)."""
    found = {}
    for path in sorted(p for package in PACKAGES for p in (SRC / package).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def wing(module: str) -> int | None:
    """The rank of ``module``'s wing (0 is core), None if it belongs to none."""
    if module in FACE:
        return len(WINGS) - 2
    for rank, (_, roots) in enumerate(WINGS):
        if rank == len(WINGS) - 2:
            continue  # the face is named module by module, not by a prefix
        if any(module == root or module.startswith(root + ".") for root in roots):
            return rank
    return None


def resolve(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads (relative imports included)."""
    if not node.level:
        return node.module or ""
    package = importer if modules()[importer].name == "__init__.py" else importer.rsplit(".", 1)[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def imports(module: str) -> Iterator[tuple[int, str, str]]:
    """``(line, imported module, name)`` for every quantree import anywhere in ``module``;
    ``name`` is what ``from m import name`` takes when it is not a module, else empty."""
    tree = ast.parse(modules()[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    yield node.lineno, alias.name, ""
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, node)
            if source.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules():
                    yield node.lineno, sub, ""
                else:
                    yield node.lineno, source, alias.name


def edges() -> dict[str, set[str]]:
    """Module -> the quantree modules it imports (explicitly; not the parent packages)."""
    return {m: {target for _, target, _ in imports(m) if target != m} for m in modules()}


@pytest.mark.parametrize("module", sorted(modules()))
def test_every_module_belongs_to_a_wing(module: str) -> None:
    assert wing(module) is not None, (
        f"{module} belongs to no wing: move it into core/, recurrent/, recipes/, backends/ "
        "or tools/ (or make it part of the package face in tests/core/test_layering.py)"
    )


@pytest.mark.parametrize("module", sorted(modules()))
def test_no_import_runs_up_the_wing_order(module: str) -> None:
    rank = wing(module)
    if rank is None:
        pytest.skip("in no wing (see test_every_module_belongs_to_a_wing)")
    upward = [
        f"line {line}: {target}" + (f".{name}" if name else "")
        for line, target, name in imports(module)
        if (other := wing(target)) is not None and other > rank
    ]
    assert not upward, (
        f"{module} ({WINGS[rank][0]}) imports from wings above it: {upward}. "
        f"The order is {' < '.join(w for w, _ in WINGS)}"
    )


def test_no_import_cycle_between_modules() -> None:
    graph = edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    assert not cycles, f"modules that import each other (directly or round a loop): {cycles}"


@pytest.mark.parametrize("module", sorted(modules()))
def test_no_private_name_imported_across_modules(module: str) -> None:
    private = [
        f"line {line}: {target}.{name}"
        for line, target, name in imports(module)
        if name.startswith("_") and not name.startswith("__")
    ]
    private += [
        f"line {line}: {target}" for line, target, _ in imports(module) if _private_module(target)
    ]
    assert not private, (
        f"{module} imports private names of other modules: {private}. If two modules need "
        "it, it is not private: drop the underscore (or move it to where both can read it)"
    )


def _private_module(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def test_no_module_imports_prepare_for_its_metadata() -> None:
    """The metadata contract lives in core.stages; prepare is imported only to prepare."""
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "quantree.core.prepare":
                assert {a.name for a in node.names} <= {"prepare"}, path


def test_no_folder_holds_more_than_15_python_files() -> None:
    folders: dict[Path, int] = {}
    for path in modules().values():
        folders[path.parent] = folders.get(path.parent, 0) + 1
    crowded = {str(f.relative_to(SRC)): n for f, n in folders.items() if n > 15}
    assert not crowded, f"folders over 15 Python files (make folders by role): {crowded}"


def test_a_module_over_400_lines_says_why_in_its_first_lines() -> None:
    long = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        if len(lines) > 400 and not any("Over 400 lines" in line for line in lines[:15]):
            long.append(f"{name} ({len(lines)} lines)")
    assert not long, f"split these, or say why they are long in their first lines: {long}"


@pytest.mark.parametrize("module", sorted(m for m in modules() if wing(m) == len(WINGS) - 1))
def test_the_command_line_imports_no_torch_before_parsing(module: str) -> None:
    """``quantree --help`` and a usage error must not wait for torch: only function bodies of
    ``quantree_cli`` may import torch or quantree (which imports torch)."""
    heavy = [
        f"line {node.lineno}"
        for node in ast.parse(modules()[module].read_text()).body
        if isinstance(node, ast.Import | ast.ImportFrom)
        and any(
            name.split(".")[0] in ("torch", "quantree")
            for name in (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
        )
    ]
    assert not heavy, f"{module} imports torch or quantree at module level: {heavy}"
