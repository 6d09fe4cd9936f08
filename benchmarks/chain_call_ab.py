"""The chain call's Python (``native/chains.py`` and the code around it) against a git revision's.

    python benchmarks/chain_call_ab.py --base main --models cnn,resnet18,mobilenet_v2 --runs 10

Per model (``peers.py``'s builders and data): one lowered model's graph in two fresh modules,
"before" made by ``--base``'s ``chains.py``, ``fast_attributes.py`` and shape guard class
(their source read with ``git show``, loaded beside this tree's), "after" by this tree's;
the same native library, the same bound calls. Timed as ``chains_ab.py`` does (float first,
the two after it in alternating order, one thread, medians of process CPU time,
``--rounds`` rounds), outputs compared bit for bit on the held-out inputs.
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
import types
import warnings
from pathlib import Path

import torch
import torch.fx as fx
from chains_ab import report_rows
from common import load_note, one_thread  # benchmarks/ is on the path

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.chains import run_chains_natively
from quantree.backends.cpu.native.fast_attributes import read_buffers_directly

ROOT = Path(__file__).resolve().parent.parent


def module_at(rev: str, path: str, name: str) -> types.ModuleType:
    """``path`` as it is at ``rev``, loaded as module ``name``."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout  # fmt: skip
    module = types.ModuleType(name)
    module.__file__ = f"{rev}:{path}"
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def with_guard_class(gm: fx.GraphModule, cls: type) -> fx.GraphModule:
    """``gm`` with its own copy of the shape guard, of class ``cls`` (nothing remembered)."""
    guard = gm._modules.get("_guards_fn")
    if guard is not None and hasattr(guard, "passed"):
        own = copy.copy(guard)
        own.__dict__ = dict(guard.__dict__)
        own.__class__ = cls
        own.passed = set()
        gm._modules["_guards_fn"] = own
    return gm


def main() -> None:
    import peers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main")
    parser.add_argument("--models", default="cnn,resnet18,mobilenet_v2,squeezenet,crnn")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    one_thread()
    warnings.simplefilter("ignore")
    native = "src/quantree/backends/cpu/native/"
    old_chains = module_at(args.base, native + "chains.py", "quantree_base_chains")
    old_fast = module_at(args.base, native + "fast_attributes.py", "quantree_base_fast")
    old_guards = module_at(args.base, "src/quantree/core/capturing/shape_guards.py",
                           "quantree_base_guards")  # fmt: skip
    print(f"before: {args.base}'s chain call; after: this tree's\n")
    print("| model | chains (ops) | float ms | before: CPU ratio | after: CPU ratio "
          "| after / before | bits equal |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for name in args.models.split(","):
        model, calib, held = peers.data(name)
        lowered = qt.quantize(model, calib[0], calib, backend=CPU, progress=False)
        before = fx.GraphModule(lowered, lowered.graph)
        before = old_chains.run_chains_natively(old_fast.read_buffers_directly(before))
        before = with_guard_class(before, old_guards.PassedShapes)
        after = run_chains_natively(read_buffers_directly(fx.GraphModule(lowered, lowered.graph)))
        after = with_guard_class(after, type(lowered._modules.get("_guards_fn")))
        report_rows(name, model, before, after, held, args.rounds, args.runs)
    print(f"\n{load_note()}; torch {torch.__version__}; one thread, process CPU time")


if __name__ == "__main__":
    sys.exit(main())
