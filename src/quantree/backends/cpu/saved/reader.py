"""reader: the one way quantree reads a ``.pt2``, with safe loaders only.

``load_program`` checks every member of the archive against an allowlist
(``archive.check_archive``) before ``torch.export.load`` sees it, then loads with the
restricted unpickler forced everywhere. It lives with the saved-model code so that
``quantree.backends.load`` needs nothing from the tools above it; the CLI's file handling
(``quantree.tools.files``) reads programs through it too.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from pathlib import Path

import torch

from quantree.backends.cpu.saved.archive import (
    NEVER_UNPICKLED,
    BadFile,
    check_archive,
    first_line,
    weights_only_everywhere,
)
from quantree.backends.cpu.saved.checks.fake_check import check_on_example
from quantree.backends.cpu.saved.checks.load_budget import (
    LoadBudget,
    LoadBudgetExceeded,
    budget_for,
)
from quantree.backends.cpu.saved.checks.vocabulary import program_errors
from quantree.core.errors import QuantreeError


def existing(path: str | Path, what: str) -> Path:
    """``path`` as a Path, if it names a regular file; a ``BadFile`` saying ``what`` if not."""
    p = Path(path)
    if not p.exists():
        raise BadFile(f"{p}: no such file ({what})")
    if not p.is_file():
        raise BadFile(f"{p}: not a regular file ({what})")
    return p


def register_backend_ops() -> None:
    """Import the built-in backends so programs using their custom ops can be loaded."""
    with contextlib.suppress(ImportError):
        importlib.import_module("quantree.backends")


def load_program(
    path: str | Path, budget: LoadBudget | None = None
) -> torch.export.ExportedProgram:
    """A program saved with ``torch.export.save``, loaded without unpickling anything, within
    ``budget`` (default: ``load_budget.budget_for(path)``), of quantree's dialect only
    (``checks/vocabulary.py``: checked on the file's text before torch resolves a name, then
    on the loaded graph before anything calls it).

    The one way quantree reads a ``.pt2`` (the CLI and ``quantree.backends.load``).
    """
    p = existing(path, "expected a program saved with torch.export.save")
    register_backend_ops()  # the dialect's quantree:: ops, so that names resolve
    try:
        check_archive(p, budget_for(p) if budget is None else budget)
    except BadFile:
        raise
    except LoadBudgetExceeded as error:
        raise BadFile(f"{p}: {error}") from None
    except Exception as error:  # a damaged archive the checks' readers choke on: refused
        raise BadFile(f"{p}: not a readable torch.export archive: {first_line(error)}") from None
    try:
        with weights_only_everywhere() as records:
            program = torch.export.load(str(p))
    except Exception as error:
        raise BadFile(
            f"{p}: not a readable torch.export program (truncated, or saved some other way): "
            f"{first_line(error)}"
        ) from None
    for record in records:
        if "weights_only=False" in record.getMessage():  # cannot happen: checked, then forced
            raise BadFile(f"{p}: torch fell back to unpickling a member; {NEVER_UNPICKLED}")
        logging.getLogger(record.name).handle(record)
    if not isinstance(program, torch.export.ExportedProgram):
        raise BadFile(f"{p}: holds a {type(program).__name__}, not an ExportedProgram")
    for refused in program_errors(program):
        raise BadFile(f"{p}: refused, {refused} (quantree loads only its own dialect)")
    return program


def program_module(
    program: torch.export.ExportedProgram, path: str | Path, *, check: bool = True
) -> torch.fx.GraphModule:
    """``program.module()``, a ``BadFile`` naming ``path`` where torch cannot build it (its
    call graph or signature contradicts the graph: torch asserts) or, with ``check``, where
    a node does not run on fake tensors like the saved example (``checks/fake_check.py``)."""
    try:
        module = program.module()
    except Exception as error:
        what = first_line(error)
        raise BadFile(f"{path}: not a consistent torch.export program: {what}") from None
    if check:
        try:
            check_on_example(module, program.example_inputs, budget_for(path).total)
        except QuantreeError as error:
            raise BadFile(f"{path}: {error}") from None
    return module
