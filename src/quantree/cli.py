"""The ``quantree`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quantree", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="quantize the bundled char-level LSTM and report")
    demo.add_argument("--calibration-batches", type=int, default=50)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from quantree.demo import print_rows, run_demo

        print_rows(run_demo(args.calibration_batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
