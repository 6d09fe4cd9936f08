"""The one AMX GEMM against the VNNI kernels and ``--base``'s ``isa_amx.cpp``, per shape, in C.

    python benchmarks/amx_gemm_ab.py --base b76a420 [--shapes 128x1024x256x1,3136x64x576]

Builds ``amx_gemm_ab.cpp`` with this tree's kernel objects plus ``isa_amx.cpp`` as it was at
``--base`` (main before branch ``h-amx26``: the second AMX GEMM, renamed ``old_tall_amx``),
then runs one process per shape: the same operands through VNNI (``qt_amx(0)``), the old
kernel, and the one path at ``qt_amx(1)`` and ``qt_amx(2)``; thread CPU time, best of 15;
outputs compared bit for bit. Needs a CPU and OS with AMX.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from quantree.backends.cpu.native import build

HERE = Path(__file__).resolve().parent
SHAPES = ("128x1024x256x1,128x1024x256,64x2048x512x1,1024x1024x256x1,32x1024x256,"
          "32x1024x256x1,17x1024x256,3136x64x576,196x256x2304,1024x64x64,100x64x300,"
          "3136x32x28")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="b76a420")
    parser.add_argument("--shapes", default=SHAPES, help="MxNxK[x1 for two planes], ...")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        old = out / "old_amx.cpp"
        path = "src/quantree/backends/cpu/native/csrc/isa_amx.cpp"
        shown = subprocess.run(["git", "show", f"{args.base}:{path}"], cwd=HERE, check=True,
                               capture_output=True, text=True)  # fmt: skip
        old.write_text(shown.stdout)
        objects = build.compile_objects("c++", out, "native", more=(HERE / "amx_gemm_ab.cpp",))
        flags = ("-march=x86-64-v4", "-mavx512vnni", "-mamx-tile", "-mamx-int8")
        cmd = ["c++", *build.FLAGS, *flags, "-Dgemm_amx=old_tall_amx", "-c", str(old), "-o",
               str(out / "old_amx.o")]  # fmt: skip
        subprocess.run(cmd, check=True)
        program = build.link_program("c++", [*objects, str(out / "old_amx.o")], out / "ab")
        print(f"| M x N x K | VNNI us | {args.base}'s isa_amx.cpp us | one path, qt_amx(1) us "
              "| qt_amx(2) us | bits equal |\n|---|---|---|---|---|---|")  # fmt: skip
        for shape in args.shapes.split(","):
            dims = shape.split("x")
            run = subprocess.run([str(program), *dims], check=True, capture_output=True, text=True)
            print(run.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
