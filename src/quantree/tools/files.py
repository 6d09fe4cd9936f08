"""files: the files the CLI reads and writes, loaded with safe loaders only.

Files from users are never unpickled. A program goes through :func:`load_program`, the one
way quantree reads a ``.pt2``: before ``torch.export.load`` sees the archive, every member
is checked against an allowlist (see :func:`check_archive`); members torch would unpickle
with the full unpickler (pickled tensors and objects, legacy state files), compiled code and
anything unknown make the file a :class:`BadFile`; the stored example inputs must load with
``torch.load(weights_only=True)``; the symbolic shape expressions and input guards that
torch ``eval``s/``exec``s must be plain arithmetic on shapes. The load itself then runs with
``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` set, so even a path the checks missed could only use the
restricted unpickler. Calibration data is read with ``torch.load(weights_only=True)``.
Anything wrong with a file (missing, truncated, of the wrong kind, unsafe) becomes a
:class:`BadFile` with a one-line message naming the file. Outputs are written to a
temporary file next to the target and renamed into place, so a failure never leaves a
half-written file and the input is never opened for writing.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

from quantree.backends.cpu.saved.archive import (
    NEVER_UNPICKLED,
    BadFile,
    first_line,
    is_export_archive,
    no_protocol_warning,
)
from quantree.backends.cpu.saved.reader import (  # noqa: F401  (re-exported)
    existing,
    load_program,
    program_module,
    register_backend_ops,
)
from quantree.core.calibrate import as_args
from quantree.core.errors import QuantreeError


def load_calibration(path: str | Path) -> list[tuple[Any, ...]]:
    """A non-empty list of argument tuples saved with ``torch.save`` (a lone tensor = 1-tuple)."""
    p = existing(path, "expected calibration data saved with torch.save")
    if is_export_archive(p):
        raise BadFile(
            f"{p}: is a torch.export program, not calibration data; the model comes first: "
            "quantree quantize MODEL.pt2 --calibration DATA.pt -o OUT.pt2"
        )
    try:
        with no_protocol_warning():
            data = torch.load(str(p), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:
        raise BadFile(
            f"{p}: refused, it holds more than tensors and plain containers and {NEVER_UNPICKLED}; "
            "re-save it with torch.save([(x1,), (x2,)], path) of tensors only"
        ) from None
    except Exception as error:
        raise BadFile(
            f"{p}: not readable as calibration data with torch.load(weights_only=True): "
            f"{first_line(error)}"
        ) from None
    if not isinstance(data, list | tuple):
        raise BadFile(
            f"{p}: holds a {type(data).__name__}; expected a list of argument tuples, "
            "e.g. torch.save([(x1,), (x2,)], path)"
        )
    if not data:
        raise BadFile(f"{p}: the calibration list is empty")
    batches = []
    for i, item in enumerate(data):
        if not isinstance(item, torch.Tensor | list | tuple):
            raise BadFile(
                f"{p}: item {i} is a {type(item).__name__}; each item must be a tuple of "
                "the model's positional arguments"
            )
        batches.append(as_args(item))
    return batches


def check_output(
    path: str | Path, protect: tuple[str | Path, ...] = (), *, create_dirs: bool = True
) -> Path:
    """``path`` as a Path if it may be written: not a directory, not one of the inputs.

    With ``create_dirs`` False its directory must exist (the CLI's outputs: a typo in a
    directory name should not silently create a tree).
    """
    target = Path(path)
    if not create_dirs and not target.parent.is_dir():
        raise BadFile(
            f"{target}: the directory {target.parent} does not exist; create it first "
            f"(mkdir -p {target.parent}) or write somewhere that exists"
        )
    for other in protect:
        if target.exists() and Path(other).exists() and os.path.samefile(target, other):
            raise BadFile(f"{target}: refusing to overwrite the input file {other}")
    if target.exists() and not target.is_file():
        raise BadFile(f"{target}: exists and is not a regular file")
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise BadFile(f"{target}: cannot be created, {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK):
        raise BadFile(f"{target}: cannot be created, {ancestor} is not writable")
    return target


def atomic_write(path: str | Path, write: Any, *, protect: tuple[str | Path, ...] = ()) -> Path:
    """Call ``write(tmp_path)`` and rename the result to ``path``; never onto ``protect``."""
    target = check_output(path, protect)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def save_program(
    module: torch.nn.Module,
    example_args: tuple[Any, ...],
    path: str | Path,
    *,
    protect: tuple[str | Path, ...] = (),
    dynamic_batch: bool = True,
) -> Path:
    """Export ``module`` with ``example_args`` and write it as ``quantree.backends.save``
    does (compacted, graph description deflated); the first dimensions stay dynamic where
    the module allows it."""
    from quantree.backends.cpu.saved.serialize import saved_program, write_program

    try:
        program = saved_program(module, tuple(example_args), dynamic_batch)
    except Exception as error:
        raise QuantreeError(
            f"torch.export could not re-export the quantized model: {first_line(error)}"
        ) from error
    return atomic_write(path, lambda tmp: write_program(program, tmp), protect=protect)
