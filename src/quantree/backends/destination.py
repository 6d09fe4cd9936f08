"""A file a backend will write: its directory checked before the work that writes it.

Exporting takes seconds to minutes; a path in a directory that does not exist failed only
after all of it, with the writer's raw ``FileNotFoundError`` (torch's archive writer, ONNX's,
a plain ``open``). Every backend that writes a file checks its destination here first.
"""

from __future__ import annotations

import os
from pathlib import Path

from quantree.core.errors import QuantreeError


def writable_destination(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a ``Path`` whose directory exists; else a ``QuantreeError`` with the fix."""
    if not isinstance(path, (str, os.PathLike)):
        raise QuantreeError(
            f"{what} takes a file path (a str or pathlib.Path), got {type(path).__name__}"
        )
    target = Path(path)
    parent = target.parent
    if not parent.is_dir():
        raise QuantreeError(
            f"cannot {what} to {str(path)[:200]!r}: its directory {str(parent)[:200]!r} does "
            "not exist; create it first (os.makedirs(directory, exist_ok=True)) or give a path "
            "in an existing directory"
        )
    if target.is_dir():
        raise QuantreeError(
            f"cannot {what} to {str(path)[:200]!r}: it is a directory; give a file path in it"
        )
    return target
