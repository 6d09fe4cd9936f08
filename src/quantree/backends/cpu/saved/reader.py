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


def load_program(path: str | Path) -> torch.export.ExportedProgram:
    """A program saved with ``torch.export.save``, loaded without unpickling anything.

    The one way quantree reads a ``.pt2`` (the CLI and ``quantree.backends.load``).
    """
    p = existing(path, "expected a program saved with torch.export.save")
    check_archive(p)
    register_backend_ops()
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
    return program
