"""``quantree_et::rnn``: the whole int8 recurrent layer as one operator of an ExecuTorch program.

Registered with torch (functional and out variant, a fake kernel for export) so that
``torch.export`` and ``to_edge`` keep a lowered recurrent layer as ONE node, and
``to_executorch`` finds the out variant ExecuTorch calls; the runtime kernel of that out
variant is ``csrc/quantree_et_kernels.cpp`` (``kernels.load``). In PyTorch (eager, or the
exported program run as it is) both variants run quantree's CPU op ``quantree.rnn``: the
same C++ core, so an exported program computes what the ``.pte`` computes.

Its own namespace, not ``quantree``: that one is the CPU backend's, which ExecuTorch cannot
run (``export.check_reference`` refuses it in a graph handed to the exporter).

Arguments (every one checked again by the runtime kernel, which reads them from a file):
``x`` ``[T, B, K]`` time-major, int8 (float with ``config[6]``); ``h0``/``c0`` int8 initial
states or None for zeros; ``params`` the CPU op's packed weights, row sums, scales and
biases per layer and direction; ``config`` = (kind, hidden, layers, directions, hidden
bits, proj_size, float input, float output[, x bits, y bits]: 16 for int16 sequences);
``qparams`` the CPU op's 18 floats.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.rnn)

NAMESPACE = "quantree_et"
KINDS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
ARGS = "Tensor x, Tensor? h0, Tensor? c0, Tensor[] params, int[] config, float[] qparams"
OUTS = "Tensor(a!) out, Tensor(b!) h_n, Tensor(c!) c_n"

LIBRARY = torch.library.Library(NAMESPACE, "DEF")
LIBRARY.define(f"rnn({ARGS}) -> (Tensor, Tensor, Tensor)")
LIBRARY.define(f"rnn.out({ARGS}, *, {OUTS}) -> (Tensor(a!), Tensor(b!), Tensor(c!))")


def run_cpu(
    x: Tensor,
    h0: Tensor | None,
    c0: Tensor | None,
    params: list[Tensor],
    config: list[int],
    qparams: list[float],
) -> tuple[Tensor, Tensor, Tensor]:
    """The layer computed by quantree's CPU op (what the ExecuTorch kernel computes)."""
    kind, hidden, layers, dirs, bits, proj, float_in, float_out = config[:8]
    x_bits, y_bits = (*config[8:10], 8, 8)[:2]
    hx = [] if h0 is None else [h0, *([c0] if c0 is not None else [])]
    return torch.ops.quantree.rnn.default(
        KINDS[kind], x, hx, list(params), hidden, layers, dirs == 2, False, list(qparams),
        bits, proj, bool(float_in), bool(float_out), x_bits, y_bits,
    )  # fmt: skip


def rnn_cpu(x, h0, c0, params, config, qparams):  # type: ignore[no-untyped-def]
    return tuple(t.clone() for t in run_cpu(x, h0, c0, params, config, qparams))


def rnn_out_cpu(x, h0, c0, params, config, qparams, *, out, h_n, c_n):  # type: ignore[no-untyped-def]
    results = run_cpu(x, h0, c0, params, config, qparams)
    for target, value in zip((out, h_n, c_n), results, strict=True):
        target.resize_(value.shape).copy_(value)
    return out, h_n, c_n


def output_shapes(x: Tensor, config: list[int]) -> tuple[tuple[int, ...], ...]:
    kind, hidden, layers, dirs, _, proj = config[:6]
    width = proj or hidden
    steps, batch = x.shape[0], x.shape[1]
    cells = (layers * dirs, batch, hidden) if kind == 0 else (0,)
    return (steps, batch, dirs * width), (layers * dirs, batch, width), cells


def rnn_fake(x, h0, c0, params, config, qparams):  # type: ignore[no-untyped-def]
    out, h, c = output_shapes(x, config)
    dtype = torch.float32 if config[7] else torch.int8
    return (
        x.new_empty(out, dtype=dtype),
        x.new_empty(h, dtype=torch.int8),
        x.new_empty(c, dtype=torch.int8),
    )


def rnn_out_fake(x, h0, c0, params, config, qparams, *, out, h_n, c_n):  # type: ignore[no-untyped-def]
    return out, h_n, c_n


LIBRARY.impl("rnn", rnn_cpu, "CPU")
LIBRARY.impl("rnn.out", rnn_out_cpu, "CPU")
torch.library.register_fake(f"{NAMESPACE}::rnn")(rnn_fake)
torch.library.register_fake(f"{NAMESPACE}::rnn.out")(rnn_out_fake)

RNN = torch.ops.quantree_et.rnn.default
RNN_OUT = torch.ops.quantree_et.rnn.out
