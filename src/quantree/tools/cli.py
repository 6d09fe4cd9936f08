"""The ``quantree`` command line: demo, quantize, inspect, compare, report, export.

The arguments are defined in ``quantree_cli``, which parses them before torch is imported
and then calls :func:`run` (``python -m quantree_cli`` or the ``quantree`` script).

Errors a user can fix (a missing, truncated or wrong-type file, an unavailable option) print
one line on stderr and exit with status 2; a quantization error (quantree's own error type)
prints one line and exits with status 1. Input files are only ever read.

``quantree quantize`` under ``torchrun --nproc-per-node N`` calibrates on N processes: each
reads the calibration file and takes its contiguous block of the batches, the statistics
are merged (``quantree.calibrate`` does it in a process group), and rank 0 alone converts
and writes the outputs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from quantree.core.calibrate import BadBatch, as_call, calibrate, check_batch
from quantree.core.errors import QuantreeError, QuantreeWarning
from quantree.core.observing.distributed import RankFailed, in_process_group
from quantree.recipes.int8 import Int8Quantizer, RecurrentMode
from quantree.tools.commands.model_source import fixed_batch_note, is_factory, load_factory
from quantree.tools.files import (
    BadFile,
    check_output,
    first_line,
    load_calibration,
    load_program,
    program_module,
    save_program,
)
from quantree.tools.metrics import sqnr_text

EXIT_QUANTIZE_FAILED = 1
EXIT_BAD_INPUT = 2
REPORT_BATCHES = 8


class UsageError(BadFile):
    """An option that cannot be honoured in this build (cells mode, a backend)."""


def _quantizer(recurrent: str, reduce_range: bool = False) -> Any:
    mode = RecurrentMode.WHOLE if recurrent == "whole" else RecurrentMode.CELLS
    return Int8Quantizer(recurrent=mode, reduce_range=reduce_range)


def _backend(name: str, output_format: str) -> Any:
    from quantree.core.lower import REFERENCE

    if name == "reference" or (name == "auto" and output_format != "pt2"):
        return REFERENCE  # an ONNX file is written from the reference graph
    if name == "auto":
        from quantree.backends.fastest import fastest_backend

        return fastest_backend()
    try:
        from quantree.backends import CPU
    except ImportError:
        raise UsageError("--backend cpu: the CPU backend is not available in this build") from None
    return CPU


def _check_fits(module: torch.nn.Module, args: tuple[Any, ...], source: str) -> None:
    """Batch 0 is also the example the output is exported with: it must run on the program."""
    try:
        check_batch(module, (args, {}), 0)
    except BadBatch as error:
        raise BadFile(f"{source}: {error}") from None
    try:
        with torch.no_grad():
            module(*args)
    except Exception as error:
        raise BadFile(
            f"{source}: calibration batch 0 does not fit the program's inputs ({first_line(error)})"
        ) from None


def _calibrate(prepared: fx.GraphModule, data: list[tuple[Any, ...]], args: Any) -> None:
    """Every batch is checked before calibration starts: a bad one fails fast, in one line.

    The checks run on the prepared graph, which may take more than the program did (a
    cells-mode graph has no shape guard: its sequence length may change). A batch of a wrong
    feature size then fails inside an op, reported the same way with the batch index that
    calibrate notes on the error. In a process group every process checks every batch (so
    all refuse the same file alike) and calibrates on its own block; batch numbers in its
    errors are the file's.
    """
    start, stop = _block(len(data))
    try:
        for index, batch in enumerate(data):
            check_batch(prepared, as_call(batch, index), index)
        calibrate(prepared, data[start:stop], progress=not args.quiet)
    except BadBatch as error:
        message = f"calibration batch {start + error.index} {error.problem}; {error.fix}"
        raise BadFile(f"{args.calibration}: {message}") from None
    except QuantreeError as error:
        if start and not isinstance(error, RankFailed):
            error.add_note(f"(batch numbers count from batch {start} of {args.calibration})")
        raise
    except Exception as error:
        where = "; ".join(getattr(error, "__notes__", ()))
        raise BadFile(
            f"{args.calibration}: the program fails on the calibration data ({where}): "
            f"{first_line(error)}"
        ) from None


def _block(batches: int) -> tuple[int, int]:
    """This process's contiguous block of the batches, as ``quantree.shard`` cuts them."""
    if not in_process_group():
        return 0, batches
    world, rank = dist.get_world_size(), dist.get_rank()
    return (batches * rank) // world, (batches * (rank + 1)) // world


@contextlib.contextmanager
def _process_group() -> Any:
    """Join the process group ``torchrun`` describes in the environment, if there is one."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model(args: argparse.Namespace, data: list[tuple[Any, ...]]) -> fx.GraphModule:
    """The graph to quantize: a saved program's, or a factory's model captured as
    ``qt.quantize`` captures it (first dimension dynamic unless ``--static-batch``)."""
    if is_factory(args.model):
        from quantree.recurrent.capture import capture

        model, example = load_factory(args.model)
        module = capture(model, example, dynamic_batch=not args.static_batch)
    else:
        program = load_program(args.model)
        note = None if args.static_batch else fixed_batch_note(program, args.model)
        if note is not None:
            warnings.warn(note, QuantreeWarning, stacklevel=2)
        module = program_module(program, args.model)
    _check_fits(module, data[0], args.calibration)
    return module


def quantize_command(args: argparse.Namespace) -> int:
    from quantree.core.convert import convert
    from quantree.core.lower import lower
    from quantree.core.prepare import prepare

    inputs = (args.model, args.calibration)
    check_output(args.output, inputs, create_dirs=False)
    if args.report:
        if Path(args.report).resolve() == Path(args.output).resolve():
            raise UsageError(
                f"{args.report}: --report and -o name the same file; give the report its own "
                f"path, e.g. --report {Path(args.output).with_suffix('.html')}"
            )
        check_output(args.report, inputs)  # a report may go to a new directory, as the demo's
    data = load_calibration(args.calibration)
    quantizer = _quantizer(args.recurrent, args.reduce_range)
    backend = _backend(args.backend, args.format)
    if args.format != "pt2" and args.backend == "cpu":
        raise UsageError(f"--format {args.format} writes the reference graph; drop --backend cpu")
    args.backend = backend.name  # what --backend auto chose, as the report names it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = _model(args, data)
        with _process_group():
            prepared = prepare(module, quantizer)
            _calibrate(prepared, data, args)
            processes = dist.get_world_size() if in_process_group() else 1
            if processes > 1 and dist.get_rank() != 0:
                return 0  # rank 0 writes the outputs
        quantized = lower(convert(prepared), backend)
    if args.format != "pt2":
        from quantree.backends.onnx import OnnxTarget, export_onnx
        from quantree.tools.files import atomic_write

        target = OnnxTarget.ONNXRUNTIME if args.format == "onnxruntime" else OnnxTarget.QDQ
        with warnings.catch_warnings(record=True) as exported:
            warnings.simplefilter("always")
            written = atomic_write(
                args.output,
                lambda tmp: export_onnx(quantized, data[0], tmp, target=target),
                protect=(args.model, args.calibration),
            )
        caught += exported
    else:
        written = save_program(
            quantized,
            data[0],
            args.output,
            protect=(args.model,),
            dynamic_batch=not args.static_batch,
        )
    for w in caught:
        if issubclass(w.category, QuantreeWarning):
            print(f"quantree: warning: {' '.join(str(w.message).split())}", file=sys.stderr)
    across = f" on {processes} processes" if processes > 1 else ""
    print(f"quantized {args.model} on {len(data)} calibration batch(es){across} -> {written}")
    if args.report:
        _write_report(args, prepared, quantized, data)
    return 0


def _write_report(
    args: argparse.Namespace,
    reference: fx.GraphModule,
    quantized: torch.nn.Module,
    data: list[tuple[Any, ...]],
) -> None:
    from quantree.tools.compare import compare
    from quantree.tools.files import atomic_write
    from quantree.tools.inspection import summary
    from quantree.tools.report import Report

    # The prepared model computes what the float model computes and has the cells of a
    # cells-mode layer as its own graphs, so the report shows inside them too.
    comparison = compare(reference, quantized, data[:REPORT_BATCHES])
    report = Report(f"quantree: {Path(args.model).name}")
    report.paragraph(
        f"{args.model} quantized ({args.recurrent} recurrent mode, {args.backend} backend) "
        f"on {len(data)} calibration batch(es); SQNR measured on the first "
        f"{comparison.batches} of them."
    )
    report.time_steps({f"{args.recurrent} mode, {args.backend}": comparison})
    report.comparison(comparison, "per-tensor SQNR against float")
    if isinstance(quantized, fx.GraphModule):
        report.heading("What is quantized")
        report.preformatted(summary(quantized, Path(args.output).name))
    page = report.html()
    written = atomic_write(
        args.report,
        lambda tmp: Path(tmp).write_text(page, encoding="utf-8"),
        protect=(args.model, args.calibration),
    )
    worst = comparison.rows[0] if comparison.rows else None
    if worst is not None:
        print(f"worst tensor: {worst.name} at {sqnr_text(worst.sqnr_db)} dB")
    print(f"report: {written.resolve()}")


def inspect_command(args: argparse.Namespace) -> int:
    from quantree.backends.cpu.saved.serialize import fold_saved_recipes
    from quantree.tools.inspection import summary

    program = load_program(args.model)
    module = program_module(program, args.model)
    if isinstance(module, fx.GraphModule):  # derived constants read as constants, not ops
        fold_saved_recipes(module, args.model)
    print(summary(module, str(args.model)))
    return 0


def demo_command(args: argparse.Namespace) -> int:
    from quantree.tools.demo_report import main as demo_main

    demo_main(args.calibration_batches, args.eval_chars, args.report, all_variants=args.all)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the command ``quantree_cli`` parsed; errors a user can fix are one line on stderr."""
    from quantree.tools.commands.compare import compare_command, report_command
    from quantree.tools.commands.export import export_command

    command = {
        "demo": demo_command,
        "quantize": quantize_command,
        "inspect": inspect_command,
        "compare": compare_command,
        "report": report_command,
        "export": export_command,
    }
    try:
        return command[args.command](args)
    except BadFile as error:
        print(f"quantree: error: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as error:  # an output that cannot be written (permissions, a full disk)
        where = f"{error.filename}: " if error.filename else ""
        print(f"quantree: error: {where}{error.strerror or error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except QuantreeError as error:
        message = " ".join(str(error).split())
        print(f"quantree: error: {message[:500]}", file=sys.stderr)
        return EXIT_QUANTIZE_FAILED
