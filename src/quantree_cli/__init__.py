"""The ``quantree`` command's arguments, parsed before anything imports torch.

This package is separate from ``quantree`` because importing ``quantree`` imports torch
(it registers ``torch.ops.quantree.*``, which a plain ``torch.export.load`` of a lowered model
needs), and torch's import costs seconds of CPU: ``quantree --help`` and a usage error would
wait for it. Here argparse runs first; only a command that will do work imports
``quantree.tools.cli``, which runs it.

Each subcommand is one ``add_<name>`` function registered in ``SUBCOMMANDS``: a new command
is a new function and one entry there, with its handler ``<name>_command`` run by
``quantree.tools.cli.run``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

MODEL_HELP = (
    "MODEL.pt2 written by torch.export.save, or module:function (also path/to/file.py:function), "
    "a Python factory returning (model, example_args), run as your own code"
)


def add_demo(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser("demo", help="quantize the bundled char-level LSTM and report")
    demo.add_argument("--calibration-batches", type=int, default=50)
    demo.add_argument(
        "--eval-chars", type=int, default=100_000, help="validation characters for bits/char"
    )
    demo.add_argument("--report", default="quantree-report/report.html", help="HTML report path")
    demo.add_argument("--all", action="store_true", help="also the cells-mode and a16w8 recipes")


def add_quantize(commands: argparse._SubParsersAction) -> None:
    quantize = commands.add_parser("quantize", help="quantize a saved program or a model factory")
    quantize.add_argument("model", help=MODEL_HELP)
    quantize.add_argument(
        "--calibration", required=True, help="DATA.pt: torch.save'd list of argument tuples"
    )
    quantize.add_argument("-o", "--output", required=True, help="where to write OUT.pt2")
    quantize.add_argument(
        "--backend",
        choices=("auto", "reference", "cpu"),
        default="auto",
        help="auto (default): the fastest backend this machine runs, the native int8 kernels "
        "where they load (to load OUT.pt2 elsewhere, import quantree first), else the reference; "
        "reference: the quantize/dequantize graph (what `quantree export` and --format onnx read); "
        "cpu: the native int8 kernels",
    )
    quantize.add_argument(
        "--static-batch",
        action="store_true",
        help="save OUT.pt2 with every dimension fixed to the first calibration batch's "
        "(default: the first dimension stays dynamic where the model allows it; a factory's "
        "model is captured with it dynamic, as qt.quantize does)",
    )
    quantize.add_argument(
        "--recurrent",
        choices=("whole", "cells"),
        default="whole",
        help="whole: LSTM/GRU/RNN quantized at their boundary (default); cells: every gate "
        "and the cell state a quantization point",
    )
    quantize.add_argument(
        "--format",
        choices=("pt2", "onnx", "onnxruntime"),
        default="pt2",
        help="pt2: a torch.export archive (default); onnx: QDQ ONNX of the reference graph "
        "for any runtime; onnxruntime: the same with recurrent layers on ONNX Runtime's "
        "integer operators (both need the [onnx] extra)",
    )
    quantize.add_argument(
        "--reduce-range",
        action="store_true",
        help="7-bit weights (ONNX Runtime's reduce_range): for ONNX Runtime or OpenVINO on x86 "
        "CPUs without VNNI, whose int8 kernels saturate on full-range weights",
    )
    quantize.add_argument("--report", help="also write an HTML report of per-tensor SQNR")
    quantize.add_argument("--quiet", action="store_true", help="no progress bar")


def add_inspect(commands: argparse._SubParsersAction) -> None:
    inspect = commands.add_parser("inspect", help="show what a quantized .pt2 quantizes and how")
    inspect.add_argument("model", help="a .pt2 program (e.g. written by quantree quantize)")


def _comparison_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("float", help=f"the float model: {MODEL_HELP}")
    parser.add_argument("quantized", help="QUANT.pt2 written by quantree quantize")
    parser.add_argument(
        "--data", required=True, help="DATA.pt: torch.save'd list of argument tuples"
    )
    parser.add_argument(
        "--batches", type=int, default=8, help="compare on the first N batches (default 8)"
    )


def add_compare(commands: argparse._SubParsersAction) -> None:
    compare = commands.add_parser(
        "compare", help="per-tensor SQNR of a quantized model against its float model"
    )
    _comparison_arguments(compare)
    compare.add_argument("--limit", type=int, default=20, help="rows shown, worst first")


def add_report(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser(
        "report", help="an HTML report of a quantized model against its float model"
    )
    _comparison_arguments(report)
    report.add_argument("-o", "--output", required=True, help="where to write REPORT.html")


def add_export(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export", help="write a quantized .pt2 (quantree quantize's output) for a runtime"
    )
    export.add_argument("model", help="OUT.pt2 written by quantree quantize (reference backend)")
    export.add_argument(
        "--executorch", required=True, metavar="MODEL.pte", help="write an ExecuTorch program"
    )
    export.add_argument(
        "--example",
        help="DATA.pt (torch.save'd list of argument tuples): the first fixes the input "
        "shapes (default: the example inputs saved in the program)",
    )


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_demo,
    add_quantize,
    add_inspect,
    add_compare,
    add_report,
    add_export,
)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantree", description="Graph-mode post-training static quantization for PyTorch."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse (``--help`` and usage errors exit here, torch not imported), then run."""
    args = parser().parse_args(None if argv is None else list(argv))
    from quantree.tools.cli import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
