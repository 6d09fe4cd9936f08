"""One place per native op: ``ops.OPS`` lists the op modules, each declares its C entry points.

The loader keeps no table of C signatures and the builder no list of sources: each op module
declares the symbols it calls (``SIGNATURES``, by their ctypes argument types) and calls
them through its own ``kernels()``, and every ``.cpp`` in ``native/csrc`` is compiled. These
tests keep that true: a symbol called without a declaration would be called with ctypes'
guesses for its arguments.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import quantree.backends.cpu as cpu
from quantree.backends.cpu.native import build, loader
from quantree.backends.cpu.ops import OPS

PACKAGE = Path(cpu.__file__).parent
CALL = re.compile(r"\b(\w+)\(\)\.(qt_\w+)\b")


def _modules() -> dict[str, object]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent.parent.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = importlib.import_module(name)
    return found


def test_every_module_that_defines_quantree_ops_is_in_ops() -> None:
    defining = {
        name
        for name, module in _modules().items()
        if re.search(r"^@op\(", Path(module.__file__).read_text(), re.M)  # type: ignore[attr-defined]
    }
    listed = {m.__name__ for m in OPS}
    assert defining <= listed, f"define ops but are not in ops.OPS: {defining - listed}"
    for module in OPS:  # and each listed module defines ops or declares C entry points
        assert module.__name__ in defining or "SIGNATURES" in vars(module), module.__name__


def test_each_c_symbol_is_declared_once_and_called_through_its_declaration() -> None:
    modules = _modules()
    declared: dict[str, str] = {}
    for name, module in modules.items():
        for symbol in vars(module).get("SIGNATURES", {}):
            assert symbol not in declared, f"{symbol}: declared in {declared[symbol]} and {name}"
            declared[symbol] = name
    called = 0
    for name, module in modules.items():
        if module is loader:  # the library's own entry points (the path chosen at load)
            continue
        for accessor, symbol in CALL.findall(Path(module.__file__).read_text()):  # type: ignore[attr-defined]
            owner = modules[declared.get(symbol, name)]
            assert symbol in declared, f"{name} calls {symbol}, which no module declares"
            assert getattr(module, accessor) is vars(owner)["kernels"], (
                f"{name} calls {symbol} through {accessor}(), not through {owner.__name__}.kernels"  # type: ignore[attr-defined]
            )
            called += 1
    assert called >= len(declared) - 2  # qt_conv2d and qt_quantize16 are declared, kept for C
    lib = loader.library()
    assert all(hasattr(lib, symbol) for symbol in declared)


def test_the_builder_compiles_every_source_in_csrc() -> None:
    cpp = {p.name for p in build.CSRC.glob("*.cpp")}
    isa = set(build.X86_ISA_SOURCES) | set(build.ARM64_ISA_SOURCES)
    assert set(build.SOURCES) == cpp - isa and isa <= cpp
    assert set(build.HEADERS) == {p.name for p in build.CSRC.glob("*.h")}
