"""Two quantree trees in one process: float vs lowered by another tree vs lowered by this one.

    git archive main | tar -x -C /tmp/base          # the tree to compare against
    python benchmarks/against_tree.py --base /tmp/base/src --models dprnn,wave_unet --runs 20
    python benchmarks/against_tree.py --base /tmp/base/src --models xlstm --length 512

Ratios to float from separate processes are not comparable on a loaded machine, so the other
tree's ``quantree`` package is copied into a temporary directory as ``qtbase`` (every
``quantree`` in its sources renamed, its ops registered as ``torch.ops.qtbase.*`` and its
kernels built apart), and both lowered models run interleaved with float in one process
(``common.interleaved_times``: wall and thread-CPU medians). Models from ``modern_zoo.py``,
whole mode, built and calibrated as ``zoo.run_model`` does; the zoo's models (``zoo.py``) as
``peers.py`` builds them, and ``outside_models.py``'s by name (``distilbert``, ...).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import zoo
from common import interleaved_times, load_note, one_thread
from profile_lowered import modern_data
from scan_lengths import longer

import quantree as qt
from quantree.backends import CPU


def any_data(name: str) -> tuple[torch.nn.Module, list[tuple], list[tuple]]:
    """Model, calibration and held-out inputs from whichever zoo names ``name``."""
    import modern_zoo
    import outside_models
    import peers

    if name in modern_zoo.MODELS:
        return modern_data(name)
    if name in zoo.MODELS:
        return peers.data(name)
    torch.manual_seed(0)
    case = outside_models.build(name)
    case.model.eval()
    gen = torch.Generator().manual_seed(1)
    return case.model, [case.sample(gen) for _ in range(16)], [case.sample(gen) for _ in range(4)]


def renamed_copy(src: Path, into: Path) -> None:
    """``src/quantree`` copied to ``into/qtbase`` with every ``quantree`` renamed."""
    target = into / "qtbase"
    shutil.copytree(src / "quantree", target)
    for path in target.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".cpp", ".h"):
            text = path.read_text()
            if "quantree" in text:
                path.write_text(text.replace("quantree", "qtbase"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the other tree's src directory")
    parser.add_argument("--models", default="dprnn,wave_unet,hdemucs,encodec")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument(
        "--length", type=int, default=0, help="tokens: the zoo's repeated (0: the zoo's)"
    )
    args = parser.parse_args()
    one_thread()
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        renamed_copy(Path(args.base), Path(tmp))
        sys.path.insert(0, tmp)
        qtbase = importlib.import_module("qtbase")
        base_cpu = importlib.import_module("qtbase.backends").CPU
        for name in args.models.split(","):
            model, calib, held = any_data(name)
            if args.length:
                calib = [longer(c, args.length) for c in calib]
                held = [longer(h, args.length) for h in held]
            ref = zoo.outputs(model, held)
            base = qtbase.quantize(model, calib[0], calib, backend=base_cpu, progress=False)
            new = qt.quantize(model, calib[0], calib, backend=CPU, progress=False)
            sqnr = {k: zoo.input_dependent_sqnr(ref, zoo.outputs(m, held))
                    for k, m in (("base", base), ("this tree", new))}  # fmt: skip
            calls = {
                "float": lambda m=model, a=held[0]: m(*a),
                "base": lambda m=base, a=held[0]: m(*a),
                "this tree": lambda m=new, a=held[0]: m(*a),
            }
            times = interleaved_times(calls, args.runs, warmup=3)
            fw, fc = times["float"]
            parts = [f"{k} {w / fw:.2f}x wall, {c / fc:.2f}x CPU, {sqnr[k]:.1f} dB"
                     for k, (w, c) in times.items() if k != "float"]  # fmt: skip
            label = f"{name} T{args.length}" if args.length else name
            print(f"{label}: float {fw:.2f} ms wall, {fc:.2f} ms CPU; {'; '.join(parts)}")
            print(f"  {load_note()}", flush=True)
    print(f"torch {torch.__version__}, one thread")


if __name__ == "__main__":
    main()
