"""One memory budget for everything loading a saved program allocates.

A small file can declare large things: a JSON member inflating to a gigabyte, a tensor
record of 0 bytes whose metadata claims 2.5 GB, three ``filled`` constants of 1 GiB each,
each under its own cap. So loading charges one :class:`LoadBudget` with what each step is
about to allocate, before it allocates: the parsed graph description, the tensor records,
the constants recipes make, the native programs' workspaces at the example's size. Its
default follows from the file's real size (what quantree writes never needs more than a few
times its file); a user who trusts a file raises it with ``memory_budget=`` or the
``QUANTREE_LOAD_BUDGET`` environment variable (bytes, or with a K/M/G suffix).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from quantree.core.errors import QuantreeError

ENV = "QUANTREE_LOAD_BUDGET"
BASE_BYTES = 256 << 20
"""What any load may use, however small its file (graph description, tables, workspaces)."""
PER_FILE_BYTE = 8
"""Bytes a load may use per byte of its file, on top of :data:`BASE_BYTES`: tensors are
stored at their size; narrowed constants widen up to 8 times, deflated JSON inflates about
tenfold but is charged per parsed byte (:data:`JSON_PARSED_FACTOR`)."""
JSON_PARSED_FACTOR = 16
"""Bytes of Python objects per byte of JSON text (two parses: quantree's check, torch's)."""


class LoadBudgetExceeded(QuantreeError):
    """Loading would allocate more than the budget allows."""


_SIZE = re.compile(r"\s*(\d+)\s*([kKmMgGtT]?)i?[bB]?\s*")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``4G``, ``512M``, ``1000000`` as bytes (ValueError otherwise)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with K, M, G or T)")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


@dataclass
class LoadBudget:
    """Bytes a load may still allocate; :meth:`charge` before each allocation."""

    total: int
    spent: int = 0

    def charge(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or self.spent + nbytes > self.total:
            need = -(-(self.spent + max(nbytes, 0) + BASE_BYTES) // (1 << 20))  # MiB
            raise LoadBudgetExceeded(
                f"{what} needs {nbytes} bytes, past the load budget of {self.total} bytes "
                f"({self.spent} already charged); if you trust the file, raise the budget: "
                f"{ENV}={need}M or load(path, memory_budget={need << 20})"
            )
        self.spent += nbytes


def budget_for(path: str | Path, memory_budget: int | None = None) -> LoadBudget:
    """The budget of loading ``path``: ``memory_budget``, else ``$QUANTREE_LOAD_BUDGET``,
    else :data:`BASE_BYTES` plus :data:`PER_FILE_BYTE` per byte of the file."""
    if memory_budget is not None:
        return LoadBudget(int(memory_budget))
    text = os.environ.get(ENV)
    if text:
        try:
            return LoadBudget(parse_size(text))
        except ValueError as error:
            raise QuantreeError(f"{ENV}: {error}") from None
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    return LoadBudget(BASE_BYTES + PER_FILE_BYTE * size)
