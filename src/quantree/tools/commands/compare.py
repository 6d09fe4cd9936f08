"""``quantree compare`` and ``quantree report``: the numeric debugger from the command line.

Both take the float model (a ``.pt2`` or a ``module:function`` factory), the quantized
``.pt2`` that ``quantree quantize`` wrote, and the data to compare on, and run
``quantree.compare`` (``tools/compare.py``): ``compare`` prints the table, ``report`` writes it
as HTML (``tools/report.py``) with the per-step charts of recurrent layers and a summary of
what is quantized. Every file is read with the safe loaders; none is written but the report.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from quantree.tools.commands.model_source import is_factory, load_factory
from quantree.tools.compare import Comparison, compare
from quantree.tools.files import BadFile, load_calibration, load_program, program_module
from quantree.tools.metrics import sqnr_text


def _float_model(spec: str) -> torch.nn.Module:
    if is_factory(spec):
        model, _ = load_factory(spec)
        return model
    return program_module(load_program(spec), spec)


def _quantized_model(path: str) -> torch.nn.Module:
    from quantree.backends import load  # derived constants computed once, as lowering did

    return load(path)


def comparison_of(args: argparse.Namespace) -> tuple[Comparison, torch.nn.Module]:
    """Run the comparison the arguments describe; the quantized module with it."""
    if args.batches < 1:
        raise BadFile(f"--batches {args.batches}: compare on at least one batch")
    data = load_calibration(args.data)[: args.batches]
    float_model = _float_model(args.float)
    quantized = _quantized_model(args.quantized)
    try:
        return compare(float_model, quantized, data), quantized
    except BadFile:
        raise
    except Exception as error:
        if type(error).__module__.startswith("quantree"):
            raise
        raise BadFile(
            f"{args.data}: the models fail on the data ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}); give the "
            "argument tuples the float model was exported or built for"
        ) from None


def compare_command(args: argparse.Namespace) -> int:
    comparison, _ = comparison_of(args)
    print(comparison.render(limit=args.limit))
    return 0


def report_command(args: argparse.Namespace) -> int:
    from quantree.tools.files import atomic_write, check_output

    check_output(args.output, (args.float, args.quantized, args.data))
    comparison, quantized = comparison_of(args)
    page = report_page(comparison, quantized, args.float, args.quantized)
    written = atomic_write(
        args.output,
        lambda tmp: Path(tmp).write_text(page, encoding="utf-8"),
        protect=tuple(p for p in (args.float, args.quantized, args.data) if Path(p).exists()),
    )
    worst = comparison.rows[0] if comparison.rows else None
    if worst is not None:
        print(f"worst tensor: {worst.name} at {sqnr_text(worst.sqnr_db)} dB")
    print(f"report: {written.resolve()}")
    return 0


def report_page(
    comparison: Comparison, quantized: Any, float_name: str, quantized_name: str
) -> str:
    from quantree.tools.inspection import summary
    from quantree.tools.report import Report

    report = Report(f"quantree: {Path(quantized_name).name}")
    report.paragraph(
        f"{quantized_name} against the float model {float_name}; SQNR measured on "
        f"{comparison.batches} batch(es)."
    )
    report.time_steps({Path(quantized_name).name: comparison})
    report.comparison(comparison, "per-tensor SQNR against float")
    if isinstance(quantized, fx.GraphModule):
        report.heading("What is quantized")
        report.preformatted(summary(quantized, Path(quantized_name).name))
    return report.html()
