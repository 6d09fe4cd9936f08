"""``quantree export``: a quantized program (``quantree quantize``'s output) for a runtime.

    quantree export OUT.pt2 --executorch model.pte [--example DATA.pt]

The ``.pt2`` is the reference graph ``quantree quantize`` writes by default; it is lowered to
ExecuTorch with XNNPACK (``quantree.backends.executorch``) at the shapes of the first argument
tuple of ``--example`` (default: the example inputs saved in the program). The arguments
are ``quantree_cli.add_export``'s.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from quantree.core.errors import QuantreeWarning
from quantree.tools.files import (
    BadFile,
    atomic_write,
    load_calibration,
    load_program,
    program_module,
)


def _example(program: Any, args: argparse.Namespace) -> tuple[Any, ...]:
    if args.example:
        return load_calibration(args.example)[0]
    saved = getattr(program, "example_inputs", None)
    if not saved or saved[1]:
        raise BadFile(
            f"{args.model}: holds no positional example inputs to fix the shapes with; "
            f"give them: quantree export {args.model} --executorch {args.executorch} "
            "--example DATA.pt"
        )
    return tuple(saved[0])


def export_command(args: argparse.Namespace) -> int:
    from quantree.backends.executorch import lower_executorch

    program = load_program(args.model)
    example = _example(program, args)
    protect = (args.model, *([args.example] if args.example else []))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", QuantreeWarning)
        lowered = lower_executorch(program_module(program, args.model), example)  # type: ignore[arg-type]
    for w in caught:
        if issubclass(w.category, QuantreeWarning):
            print(f"quantree: warning: {' '.join(str(w.message).split())}", file=sys.stderr)
    written = atomic_write(
        args.executorch, lambda tmp: Path(tmp).write_bytes(lowered.buffer), protect=protect
    )
    print(f"exported {args.model} -> {written} ({lowered.delegation.render()})")
    return 0
