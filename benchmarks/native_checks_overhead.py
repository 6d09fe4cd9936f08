"""The cost of the native argument checks (``native_checks.py``, ``program_checks.py``,
``bound_calls.py``).

The same lowered models run with the checks on and with them patched out (a no-op in their
place; a bound call runs its kernel on the pointers it recorded, with no guard), in one
process, interleaved round by round (the order alternates), one thread: median thread-CPU
time per call. ``python benchmarks/native_checks_overhead.py [rounds]``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from cnn_mlp_latency import SmallCnn  # benchmarks/ is on the path
from common import load_note
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native import bound_calls, program_checks
from quantree.backends.cpu.native import checks as native_checks

torch.set_num_threads(1)
torch.manual_seed(0)
NAMES = [
    "linear",
    "linear16",
    "conv2d",
    "conv1d",
    "matmul",
    "dequantize",
    "lookup",
    "binary",
    "softmax",
    "max_pool2d",
    "rnn_call",
    "rnn_cell",
]
saved = {n: getattr(native_checks, n) for n in NAMES}
saved_program = (program_checks.program, program_checks.cell_loop, program_checks.symbol)
BINDINGS: list = []  # every bound call of the models below


def unguarded(binding):
    """A bound call with nothing checked: its kernel on the recorded pointers."""
    run, pointers, derived = binding.run, binding.pointers, binding.derived
    return lambda args: run(args, pointers, derived)


def checks(on: bool) -> None:
    for n in NAMES:
        setattr(native_checks, n, saved[n] if on else (lambda *a, **k: None))
    program_checks.program, program_checks.cell_loop, program_checks.symbol = (
        saved_program if on else (lambda *a, **k: None,) * 3
    )
    for binding, fast in BINDINGS:
        binding.fast = fast if on else unguarded(binding)


def lowered(model, x):
    model.eval()
    data = [(x + 0.01 * i,) for i in range(4)]
    return qt.quantize(model, (x,), data, backend=CPU, progress=False)


cases = []
x = torch.randn(1, 3, 32, 32)
cases.append(("small CNN 1x3x32x32", lowered(SmallCnn(), x), x, 200))
xl = torch.randn(128, 1, 256)
cases.append(("LSTM 256x256x2 seq128 batch1", lowered(nn.LSTM(256, 256, 2), xl), xl, 5))
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
for label, model, inp, n in cases:
    times = {True: [], False: []}
    with torch.no_grad():
        for _ in range(20):
            model(inp)
    BINDINGS[:] = [
        (node.target.binding, node.target.binding.fast)
        for node in model.graph.nodes
        if isinstance(getattr(node.target, "binding", None), bound_calls.Binding)
    ]
    with torch.no_grad():
        for r in range(rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                checks(on)
                t0 = time.thread_time()
                for _ in range(n):
                    model(inp)
                times[on].append((time.thread_time() - t0) / n * 1e6)
    checks(True)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"{label}: checks on {on:.1f} us, off {off:.1f} us, overhead {100 * (on / off - 1):+.1f}%"
    )
print(load_note())
