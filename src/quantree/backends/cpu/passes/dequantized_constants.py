"""A float op reading a dequantized int8 constant reads the float constant instead.

The recipe quantizes the weights of ops no native kernel runs (an RMSNorm's ``mul`` by its
weight, Mamba's ``dt_proj.weight @ time_step`` written as a ``matmul``, a gate's scale). In
the reference graph each is ``dequantize(constant int8 weight)`` read by a float op: lowered
as it stands, the weight is dequantized on every call, a whole pass over it for nothing.
This pass computes each such dequantize once at lowering, stores the result as a float
constant and points the float ops at it. The values are the ones the reference computes
on every call, bit for bit (the int8 rounding of the weight is kept); only the work moves.
A native op that reads the int8 constant keeps reading it: only aten ops are repointed.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from quantree.core.graphs import attr_at, register_constant
from quantree.core.qdq import DEQUANTIZE_OPS


def _constant_args(gm: fx.GraphModule, node: fx.Node) -> list[object] | None:
    """``node``'s arguments with each ``get_attr`` read; None if any other node is one."""
    args: list[object] = []
    for a in node.args:
        if isinstance(a, fx.Node):
            if a.op != "get_attr":
                return None
            value = attr_at(gm, str(a.target))
            if not isinstance(value, torch.Tensor):
                return None
            args.append(value)
        else:
            args.append(a)
    return args


def _reads_float(user: fx.Node) -> bool:
    return user.op == "call_function" and getattr(user.target, "namespace", "") == "aten"


def fold_dequantized_constants(gm: fx.GraphModule) -> int:
    """Repoint every aten op reading ``dequantize(int8 constant)`` at the float constant,
    in place; returns how many dequantizes were folded."""
    graph = gm.graph
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in DEQUANTIZE_OPS:
            continue
        readers = [u for u in node.users if _reads_float(u)]
        args = _constant_args(gm, node) if readers else None
        if args is None:
            continue
        with torch.no_grad():
            value = node.target(*args, **node.kwargs)  # type: ignore[operator]
        with graph.inserting_before(node):
            constant = graph.get_attr(register_constant(gm, "_cpu_dequantized_", value))
        constant.meta = dict(node.meta)
        for user in readers:
            user.replace_input_with(node, constant)
        if not node.users:
            sources = node.all_input_nodes
            graph.erase_node(node)
            for source in sources:
                if not source.users:
                    graph.erase_node(source)
        folded += 1
    if folded:
        graph.lint()
        gm.recompile()
    return folded
