"""No global tables: no module-level mutable container of quantree is mutated anywhere.

Quantizers and backends are values (DESIGN.md); a module-level list or dict that code
appends to, updates or assigns items of is a registry in disguise. Constant tables
(``BINARY = {"add": 0, ...}`` only read) are fine. The check is static: every module under
``src/quantree`` is parsed with ``ast``; a module-level name bound to a container literal,
comprehension or container constructor is flagged wherever it is mutated through a mutating
method, item assignment or deletion, in its own module (unless a function rebinds the name
locally) or in another module that imports it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

MUTATORS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "update",
        "setdefault",
        "add",
        "pop",
        "popitem",
        "remove",
        "discard",
        "clear",
        "sort",
        "reverse",
        "appendleft",
        "extendleft",
        "__setitem__",
        "__delitem__",
        "__iadd__",
        "__ior__",
    }
)
CONSTRUCTORS = frozenset(
    {
        "list",
        "dict",
        "set",
        "bytearray",
        "defaultdict",
        "OrderedDict",
        "Counter",
        "deque",
        "ChainMap",
        "WeakKeyDictionary",
        "WeakValueDictionary",
        "WeakSet",
    }
)
CONTAINER_NODES = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda


def module_name(path: str) -> str:
    """``src/quantree/backends/cpu.py`` -> ``quantree.backends.cpu.backend``."""
    parts = Path(path).with_suffix("").parts
    parts = parts[parts.index("quantree") :] if "quantree" in parts else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_container(value: ast.expr | None) -> bool:
    if isinstance(value, CONTAINER_NODES):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in CONSTRUCTORS
    return False


def top_level_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, looking inside module-level if/try/with/for blocks."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If | ast.For | ast.While | ast.With):
            yield from top_level_statements(stmt.body + getattr(stmt, "orelse", []))
        elif isinstance(stmt, ast.Try):
            handlers = [s for h in stmt.handlers for s in h.body]
            yield from top_level_statements(stmt.body + handlers + stmt.orelse + stmt.finalbody)


def containers(tree: ast.Module) -> dict[str, int]:
    """Module-level names bound to a mutable container, with the line of the binding."""
    found: dict[str, int] = {}
    for stmt in top_level_statements(tree.body):
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign):
            targets, value = [stmt.target], stmt.value
        else:
            continue
        if is_container(value):
            for target in targets:
                if isinstance(target, ast.Name):
                    found[target.id] = stmt.lineno
    return found


def local_names(scope: Scope) -> set[str]:
    """Names a function binds locally (so they shadow module-level ones), minus ``global``."""
    args = scope.args
    bound = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    bound |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    declared: set[str] = set()
    body = [scope.body] if isinstance(scope, ast.Lambda) else scope.body
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Global | ast.Nonlocal):
            declared.update(node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
    return bound - declared


def mutated_name(node: ast.AST) -> tuple[ast.expr, int] | None:
    """The expression mutated by ``node`` (``x`` of ``x.append(...)``, ``x[k] = v``, ...)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in MUTATORS
    ):
        return container_of(node.func.value), node.lineno
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    for target in targets:
        for sub in ast.walk(target):  # tuple targets: (a[0], b) = ...
            if isinstance(sub, ast.Subscript):
                return container_of(sub.value), node.lineno
    return None


def container_of(target: ast.expr) -> ast.expr:
    """``X`` for ``X[k][j]``: changing an item stored in a table changes the table."""
    while isinstance(target, ast.Subscript):
        target = target.value
    return target


def walk_with_shadowing(
    node: ast.AST, shadowed: frozenset[str]
) -> Iterator[tuple[ast.AST, frozenset[str]]]:
    """Every node, with the module-level names local bindings hide at that point."""
    yield node, shadowed
    if isinstance(node, Scope):
        shadowed = shadowed | local_names(node)
    for child in ast.iter_child_nodes(node):
        yield from walk_with_shadowing(child, shadowed)


def find_mutated_globals(sources: Mapping[str, str]) -> list[str]:
    """``path:line: message`` for each mutation of a module-level container.

    ``sources`` maps file paths (``.../quantree/x.py``) to their text; a mutation is found in
    the defining module or in any module of ``sources`` that imports the name or the module.
    """
    trees = {path: ast.parse(text, filename=path) for path, text in sources.items()}
    tables = {module_name(path): containers(tree) for path, tree in trees.items()}
    problems: list[tuple[str, int, str]] = []
    for path, tree in trees.items():
        here = module_name(path)
        names = {name: (here, name) for name in tables[here]}  # local name -> (module, name)
        modules: dict[str, str] = {}  # local name -> module it refers to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    local = alias.asname or alias.name
                    if alias.name in tables.get(node.module, {}):
                        names[local] = (node.module, alias.name)
                    elif f"{node.module}.{alias.name}" in tables:
                        modules[local] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in tables and alias.asname:
                        modules[alias.asname] = alias.name
        for node, shadowed in walk_with_shadowing(tree, frozenset()):
            found = mutated_name(node)
            if found is None:
                continue
            target, line = found
            owner: tuple[str, str] | None = None
            if isinstance(target, ast.Name) and target.id in names and target.id not in shadowed:
                owner = names[target.id]
            elif (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id in modules
                and target.attr in tables[modules[target.value.id]]
            ):
                owner = (modules[target.value.id], target.attr)
            if owner is not None:
                module, name = owner
                problems.append(
                    (
                        path,
                        line,
                        f"module-level container {module}.{name} "
                        f"(defined line {tables[module][name]}) is mutated",
                    )
                )
    return [f"{path}:{line}: {message}" for path, line, message in sorted(problems)]


def test_no_module_level_container_of_quantree_is_mutated() -> None:
    sources = {
        str(path.relative_to(SRC.parent)): path.read_text()
        for path in sorted((SRC / "quantree").rglob("*.py"))
    }
    assert len(sources) > 30
    assert find_mutated_globals(sources) == []


SYNTHETIC = """
import collections

REGISTRY = []
TABLE: dict[str, int] = {}
BY_KIND = collections.defaultdict(list)
CONSTANT = {"add": 0}
SEEN = set()


def register(rule):
    REGISTRY.append(rule)


def put(key):
    TABLE[key] = 1


def shadowed(REGISTRY=None):
    REGISTRY = []
    REGISTRY.append(1)
    return CONSTANT["add"]


def grow():
    BY_KIND["x"].append(1)
    del TABLE["y"]


SEEN.add(1)
"""

PLUGIN = """
from quantree import table
from quantree.rules import REGISTRY
import quantree.table as t


def extend():
    REGISTRY.extend([1, 2])
    t.TABLE.update({})
"""


def test_checker_finds_each_kind_of_mutation() -> None:
    problems = find_mutated_globals({"src/quantree/rules.py": SYNTHETIC})
    assert problems == [
        "src/quantree/rules.py:12: module-level container quantree.rules.REGISTRY "
        "(defined line 4) is mutated",
        "src/quantree/rules.py:16: module-level container quantree.rules.TABLE "
        "(defined line 5) is mutated",
        "src/quantree/rules.py:26: module-level container quantree.rules.BY_KIND "
        "(defined line 6) is mutated",
        "src/quantree/rules.py:27: module-level container quantree.rules.TABLE "
        "(defined line 5) is mutated",
        "src/quantree/rules.py:30: module-level container quantree.rules.SEEN "
        "(defined line 8) is mutated",
    ]


def test_checker_follows_imports_and_allows_read_only_tables() -> None:
    sources = {
        "src/quantree/rules.py": "REGISTRY = []\n",
        "src/quantree/table.py": "TABLE = {}\nFROZEN = {'a': 1}\n",
        "src/quantree/plugin.py": PLUGIN,
    }
    problems = find_mutated_globals(sources)
    assert [p.split(": ")[0] for p in problems] == [
        "src/quantree/plugin.py:8",
        "src/quantree/plugin.py:9",
    ]
    assert "quantree.rules.REGISTRY" in problems[0] and "quantree.table.TABLE" in problems[1]
    assert find_mutated_globals({"src/quantree/x.py": "A = [1]\nB = A[0]\n"}) == []
