"""A saved graph whose op was swapped for one giving another kind of value (``item`` where
``select`` was: a Python scalar where a kernel reads a tensor) is refused at load, naming
both nodes; the fake run at load cannot tell (it stops at the first data-dependent node).
Found by the 10 000-mutation file fuzz (seed 20261131, mutant 7489: a raw AttributeError at
call)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import quantree as qt
from quantree.backends.cpu.saved.checks.fake_check import check_on_example

aten = torch.ops.aten


def _graph(swap: bool) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    if swap:
        picked = graph.call_function(aten._local_scalar_dense.default, (x,))
    else:
        picked = graph.call_function(aten.select.int, (x, 0, 0))
    parts = graph.call_function(aten.split.Tensor, (x, 1))
    first = graph.call_function(__import__("operator").getitem, (parts, 0))
    out = graph.call_function(
        aten.add.Tensor, (graph.call_function(aten.relu.default, (picked,)), 1)
    )
    graph.output((out, first))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_scalar_where_a_tensor_is_read_is_refused_naming_both_nodes() -> None:
    with pytest.raises(
        qt.QuantreeError,
        match=r"relu_default \(aten.relu.default\) takes self as Tensor, but node "
        r"_local_scalar_dense_default .* gives number",
    ):
        check_on_example(_graph(swap=True), None)


def test_the_honest_graph_and_list_items_pass() -> None:
    check_on_example(_graph(swap=False), None)  # split's items are tensors


def test_a_shape_given_to_an_op_that_takes_numbers_passes() -> None:
    """torch.export writes ``sub.Tensor(t, sym_size(x, 2))`` for ``t - x.shape[-1]`` (Hugging
    Face's Encodec pads so): aten makes the number a 0-d tensor for ``sub``, as for ``add``,
    ``mul``, ``div``; ``relu`` above refuses one, and so does the check."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    size = graph.call_function(aten.sym_size.int, (x, 0))
    graph.output(graph.call_function(aten.sub.Tensor, (x, size)))
    check_on_example(fx.GraphModule(torch.nn.Module(), graph), None)
