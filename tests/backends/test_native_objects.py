"""The object cache (``QUANTREE_NATIVE_OBJECT_CACHE``): an object compiled once is copied
for the same command and sources, and compiled again when either differs.

A fake compiler (a shell script writing its arguments as the object and logging each call)
stands in for ``c++``: what is checked is which commands run, not what they make.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from quantree.backends.cpu.native import build as build_native

FAKE = """#!/bin/sh
echo "$@" >> "{log}"
while [ "$#" -gt 1 ]; do
  if [ "$1" = "-o" ]; then echo "object of $*" > "$2"; fi
  shift
done
"""


@pytest.fixture
def compiler(tmp_path: Path) -> tuple[str, Path]:
    log = tmp_path / "calls.log"
    script = tmp_path / "fake-c++"
    script.write_text(FAKE.format(log=log))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), log


def calls(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def build(compiler: str, out: Path, extra: tuple[str, ...] = (), more=()) -> dict[str, bytes]:
    out.mkdir()
    objects = build_native.compile_objects(compiler, out, "", {}, extra=extra, more=more)
    return {Path(o).name: Path(o).read_bytes() for o in objects}


def test_the_same_command_copies_the_object_compiled_once(compiler, tmp_path, monkeypatch):
    fake, log = compiler
    monkeypatch.setenv(build_native.OBJECT_CACHE, str(tmp_path / "objects"))
    first = build(fake, tmp_path / "a")
    assert calls(log) == len(build_native.SOURCES)
    second = build(fake, tmp_path / "b")
    assert calls(log) == len(build_native.SOURCES)  # no compiler run
    assert second == first
    build(fake, tmp_path / "c", extra=("-DOTHER",))  # another command: compiled again
    assert calls(log) == 2 * len(build_native.SOURCES)


def test_an_extra_source_is_compiled_again_when_its_bytes_change(compiler, tmp_path, monkeypatch):
    fake, log = compiler
    monkeypatch.setenv(build_native.OBJECT_CACHE, str(tmp_path / "objects"))
    source = tmp_path / "src" / "extra_check.cpp"
    source.parent.mkdir()
    source.write_text("int f() { return 1; }\n")
    build(fake, tmp_path / "a", more=(source,))
    build(fake, tmp_path / "b", more=(source,))
    assert calls(log) == len(build_native.SOURCES) + 1
    source.write_text("int f() { return 2; }\n")
    build(fake, tmp_path / "c", more=(source,))
    assert calls(log) == len(build_native.SOURCES) + 2  # that source alone


def test_without_the_variable_every_build_compiles(compiler, tmp_path, monkeypatch):
    fake, log = compiler
    monkeypatch.delenv(build_native.OBJECT_CACHE, raising=False)
    build(fake, tmp_path / "a")
    build(fake, tmp_path / "b")
    assert calls(log) == 2 * len(build_native.SOURCES)
