"""The whole-layer recurrent op's argument block (``RnnRunner``), built once per lowered node.

A lowered graph calls ``quantree::rnn`` through one runner per node, which keeps the weights'
data pointers and the grids from its first call. What it computes must be what the op
computes through the dispatcher (a fresh block every call), bit for bit, after the weights
change in place, after they are replaced by other tensors, and in a copy of the graph; an
initial state the model never passes (``nn.LSTM`` without ``hx``) is no tensor at all and
gives the bits of an explicit int8 zero state on the same grid.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.direct import DirectCall
from quantree.backends.cpu.ops.elementwise import dequantize, quantize
from quantree.backends.cpu.ops.recurrent.rnn import RnnRunner


class Output(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def lowered(
    rnn: nn.Module, shape: tuple[int, ...], sequences: qt.QDtype = qt.QDtype.INT16
) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    model = Output(rnn.eval()).eval()
    x = torch.randn(*shape)
    data = [(torch.randn(*shape),) for _ in range(3)]
    # stacked layers kept in one call: the runner's inner-layer (int16) path is exercised too
    quantizer = qt.Int8Quantizer(split_layers=False, recurrent_sequence_dtype=sequences)
    return qt.lower(
        qt.quantize(model, (x,), data, quantizer=quantizer, backend="reference"), CPU
    ), x


def rnn_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    (node,) = [n for n in gm.graph.nodes if str(n.target) == "quantree.rnn.default"]
    return node


def spy_args(gm: torch.fx.GraphModule, x: torch.Tensor) -> tuple:
    """The arguments the lowered graph passes to its rnn op."""
    target = rnn_node(gm).target
    assert isinstance(target, DirectCall) and isinstance(target.implementation, RnnRunner)
    runner = target.implementation
    seen: list[tuple] = []

    def spy(*args):
        seen.append(args)
        return runner(*args)

    target.implementation = spy
    try:
        gm(x)
    finally:
        target.implementation = runner
    return seen[0]


def test_no_initial_state_is_exactly_an_int8_zero_state():
    gm, x = lowered(nn.LSTM(12, 10, 2, bidirectional=True), (6, 3, 12))
    targets = {str(n.target) for n in gm.graph.nodes}
    assert "aten.zeros.default" not in targets  # no zeros made and quantized per call
    args = list(spy_args(gm, x))
    assert args[2] == []
    qparams = args[8]
    h_s, h_z, c_s, c_z = qparams[6:10]
    shape = (4, 3, 10)
    args[2] = [
        quantize(torch.zeros(shape), h_s, int(h_z)),
        quantize(torch.zeros(shape), c_s, int(c_z)),
    ]
    given = torch.ops.quantree.rnn.default(*args)
    for a, b in zip(RnnRunner()(*spy_args(gm, x)), given, strict=True):
        assert torch.equal(a, b)


def test_runner_equals_the_op_after_weights_change():
    gm, x = lowered(nn.GRU(9, 7, 2), (5, 2, 9))
    args = spy_args(gm, x)
    runner = rnn_node(gm).target.implementation
    first = runner(*args)
    for a, b in zip(first, torch.ops.quantree.rnn.default(*args), strict=True):
        assert torch.equal(a, b)
    bias = args[3][3]  # layer 0's float b_ih, changed in place: read as it is
    bias.add_(0.5)
    changed = runner(*args)
    assert not torch.equal(changed[0], first[0])
    for a, b in zip(changed, torch.ops.quantree.rnn.default(*args), strict=True):
        assert torch.equal(a, b)
    params = list(args[3])  # replaced by another tensor: a new argument block
    params[3] = params[3] - 1.0
    replaced = (*args[:3], params, *args[4:])
    for a, b in zip(runner(*replaced), torch.ops.quantree.rnn.default(*replaced), strict=True):
        assert torch.equal(a, b)


def test_copied_graph_runs_on_its_own_weights():
    gm, x = lowered(nn.LSTM(8, 6), (4, 2, 8))
    expected = gm(x)
    twin = copy.deepcopy(gm)
    assert torch.equal(twin(x), expected)
    del gm
    assert torch.equal(twin(x), expected)


def test_quantize_and_dequantize_around_the_layer_run_inside_it_exactly():
    # int8 sequences: the int8 quantize and dequantize fused into the kernel
    gm, x = lowered(nn.LSTM(12, 10, 2), (6, 3, 12), qt.QDtype.INT8)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "quantree.quantize.default" not in targets
    assert "quantree.dequantize.default" not in targets
    args = list(spy_args(gm, x))[:13]  # x_bits and y_bits 8 (the op's defaults) left off
    assert args[1].dtype == torch.float32 and args[-2:] == [True, True]
    fused = torch.ops.quantree.rnn.default(*args)
    x_s, x_z, y_s, y_z = args[8][0], int(args[8][1]), args[8][4], int(args[8][5])
    args[1], args[-2:] = quantize(x, x_s, x_z), [False, False]
    apart = torch.ops.quantree.rnn.default(*args)
    assert fused[0].dtype == torch.float32
    assert torch.equal(fused[0], dequantize(apart[0], y_s, y_z))
    assert torch.equal(fused[1], apart[1]) and torch.equal(fused[2], apart[2])
