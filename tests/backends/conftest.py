"""Fixtures the CPU backend's tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from quantree.backends.cpu.native.loader import ISA_NAMES, isa_cap, library


@pytest.fixture
def select() -> Iterator[Callable[[str], bool]]:
    """``select(name)``: run the native library on that ISA path for the rest of the test
    (False where this CPU lacks it); the machine's own path again afterwards."""
    lib = library()
    available = [n for i, n in enumerate(ISA_NAMES) if lib.qt_select_isa(i) == i]
    lib.qt_select_isa(isa_cap())

    def choose(name: str) -> bool:
        if name not in available:
            return False
        assert ISA_NAMES[lib.qt_select_isa(ISA_NAMES.index(name))] == name
        return True

    yield choose
    lib.qt_select_isa(isa_cap())
