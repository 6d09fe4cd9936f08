"""What a saved recipe allocates when ``load`` folds it, known from its arguments first.

``filled`` makes a constant of the size the file declares, ``widened`` up to 8 bytes per
stored byte; the others make tensors of their tensor arguments' sizes (a few temporaries
each). ``load`` charges these bytes to its budget before running any recipe
(``load_budget.py``), so a file cannot commit the load to gigabytes with a few recipes each
within its own op's cap.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch import Tensor

from quantree.backends.cpu.saved.checks.load_budget import LoadBudget
from quantree.backends.cpu.saved.derived_ops import RECIPE_OPS
from quantree.core.graphs import fetch_attr

TEMPORARIES = 4
"""Tensors of its result's size a recipe holds at once (rounding, scaling, the result)."""


def _value(gm: fx.GraphModule, arg: object) -> object:
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        return fetch_attr(gm, str(arg.target))
    return arg


def recipe_bytes(gm: fx.GraphModule, node: fx.Node) -> int:
    """An upper bound on the bytes folding ``node`` (a recipe call) allocates."""
    args = [_value(gm, a) for a in node.args]
    op = node.target
    if op == torch.ops.quantree.filled.default:
        size, dtype = (args[1], args[2]) if len(args) >= 3 else ([], torch.float64)
        dims = [n for n in size if isinstance(n, int)] if isinstance(size, list | tuple) else []
        item = dtype.itemsize if isinstance(dtype, torch.dtype) else 8
        return math.prod(max(n, 0) for n in dims) * item
    if op == torch.ops.quantree.derived_row_sums.default and len(args) >= 2:
        rows = args[1] if isinstance(args[1], int) else 0
        return TEMPORARIES * 4 * max(rows, 0)
    tensors = [a for a in args if isinstance(a, Tensor)]
    return TEMPORARIES * 8 * sum(t.numel() for t in tensors)


def charge_recipes(gm: fx.GraphModule, budget: LoadBudget) -> None:
    """Charge ``budget`` with what folding each recipe of ``gm`` allocates, at most."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in RECIPE_OPS:
            budget.charge(recipe_bytes(gm, node), f"node {node.name} ({node.target})")
