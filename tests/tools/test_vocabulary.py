"""The closed vocabulary's rules (``saved/checks/vocabulary.py``), op by op and node by node."""

from __future__ import annotations

import torch

from quantree.backends.cpu.saved.checks.vocabulary import graph_errors, op_error

aten = torch.ops.aten


def test_ops_outside_the_dialect_say_why() -> None:
    assert op_error(aten.add.Tensor) is None
    assert op_error(torch.ops.quantree.linear.default) is None
    assert op_error(aten.lstm.input) is None  # random only with train=True (per node)
    assert "storage" in str(op_error(aten.from_file.default))
    assert "random" in str(op_error(aten.rand.default))
    assert op_error(aten.copy_.default) is None  # in place: where it writes is per node
    assert "mutation" in str(op_error(aten.add.out))  # writes its ``out`` argument
    assert "namespace" in str(op_error(torch.ops.prims.add.default))
    assert "dialect" in str(op_error(print))


def test_in_place_ops_only_write_what_the_graph_made() -> None:
    """``relu_`` on a fresh sum is an ordinary step; into an input or a buffer it writes
    outside the graph (the caller's tensor, the model's state)."""

    class InPlace(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = (x + 1).relu_()
            return y + self.b

    gm = torch.export.export(InPlace(), (torch.ones(3),)).graph_module
    assert list(graph_errors(gm)) == []
    graph = gm.graph
    x = next(n for n in graph.nodes if n.op == "placeholder" and n.name == "x")
    relu = next(n for n in graph.nodes if n.target == aten.relu_.default)
    relu.args = (x,)
    (error,) = graph_errors(gm)
    assert "writes in place into x" in error


def test_recurrent_layers_must_be_deterministic() -> None:
    lstm = torch.nn.LSTM(3, 4, dropout=0.0)
    gm = torch.export.export(lstm.eval(), (torch.ones(2, 1, 3),)).graph_module
    assert list(graph_errors(gm)) == []
    node = next(n for n in gm.graph.nodes if n.target == aten.lstm.input)
    args = list(node.args)
    args[6] = True  # train
    node.args = tuple(args)
    (error,) = graph_errors(gm)
    assert "train=True: random" in error


def test_results_stay_in_cpu_memory() -> None:
    """A file cannot ask for another device (a CUDA context, data-less ``meta`` tensors),
    pinned memory or a sparse layout."""

    class Zeros(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.new_zeros(3) + x

    gm = torch.export.export(Zeros(), (torch.ones(3),)).graph_module
    assert list(graph_errors(gm)) == []
    node = next(n for n in gm.graph.nodes if n.target == aten.new_zeros.default)
    for extra, says in (({"pin_memory": True}, "pinned memory"),
                        ({"device": torch.device("meta")}, "on device meta"),
                        ({"layout": torch.sparse_coo}, "layout")):  # fmt: skip
        node.kwargs = {**node.kwargs, **extra}
        (error,) = graph_errors(gm)
        assert says in error, error
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in extra}
