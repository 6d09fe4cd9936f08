"""A loaded program's tables bounded by what the program needs, when the file loads.

``program_checks`` proves a table keeps every access inside the workspace it lays out; it
does not ask whether that workspace is the one the program needs. A file can say a slot's
rows are 2**31 - 1 values apart, and the call then allocates and clears gigabytes (an
allocation failure inside the kernel aborts the process). Lowering lays every slot that owns
storage out dense (its row stride is its width: ``cells_native.Program``,
``lowering_program``, ``program_layout``), so a loaded table must too; and the workspace
the tables lay out for the example's size is charged to the load budget, like every other
allocation a load commits the model to.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._ops import OpOverload

from quantree.backends.cpu.native.checks import fail
from quantree.backends.cpu.native.program_checks import Verdict, check_graph
from quantree.backends.cpu.saved.checks.load_budget import LoadBudget


def _op(node: fx.Node) -> object:
    """The op a node calls (a ``DirectCall`` wraps one)."""
    target = node.target
    return target if isinstance(target, OpOverload) else getattr(target, "op", target)


def _example_size(node: fx.Node) -> int:
    """The size symbol at the saved example: a cell loop's batch, a dynamic program's
    ``(dim - a) // b`` of the dimension ``sym`` names (of one step's input, for a folded
    loop's per-step input); 1 where unknown."""
    if _op(node) == torch.ops.quantree.cell_loop.default:
        xs = node.args[0] if node.args else None
        val = xs.meta.get("val") if isinstance(xs, fx.Node) else None
        size = val.shape[1] if isinstance(val, torch.Tensor) and val.dim() >= 2 else 1
        return size if isinstance(size, int) else 1
    sym: Any = node.kwargs.get("sym", node.args[14] if len(node.args) > 14 else [])
    inputs: Any = node.kwargs.get("inputs", node.args[0] if node.args else [])
    if not (isinstance(sym, list | tuple) and len(sym) == 4 and isinstance(inputs, list | tuple)):
        return 1
    if not all(isinstance(v, int) for v in sym):
        return 1
    index, dim, a, b = sym
    source = inputs[index] if 0 <= index < len(inputs) else None
    val = source.meta.get("val") if isinstance(source, fx.Node) else None
    stepped: Any = node.kwargs.get("stepped", node.args[15] if len(node.args) > 15 else [])
    looped = _op(node) == torch.ops.quantree.program_loop.default
    if not isinstance(val, torch.Tensor):
        return 1
    shape = list(val.shape)
    if looped and isinstance(stepped, list | tuple) and index < len(stepped) and stepped[index]:
        shape = shape[1:]
    if not -len(shape) <= dim < len(shape):
        return 1
    size = shape[dim]
    return max((size - a) // b, 1) if isinstance(size, int) and b > 0 else 1


def check_needs(op: str, verdict: Verdict) -> None:
    """Every slot owning storage is dense: its row stride is its width."""
    for i, s in enumerate(verdict.slots):
        if s.owner == i and s.ld != s.cols:
            raise fail(
                op, f"slot {i} owns rows of {s.cols} values {s.ld} apart (a program's own "
                "slots are dense)"
            )  # fmt: skip


def check_loaded_tables(gm: fx.GraphModule, budget: LoadBudget | None) -> None:
    """``check_graph``, then each table's slots dense and its workspace at the example's
    size within ``budget``."""
    for node, verdict in check_graph(gm):
        quantree = torch.ops.quantree
        names: dict[object, str] = {
            quantree.program.default: "program",
            quantree.program_loop.default: "program_loop",
        }
        op = names.get(_op(node), "cell_loop")
        check_needs(op, verdict)
        if budget is not None:
            size = _example_size(node)
            budget.charge(
                verdict.ws0 + verdict.ws1 * size, f"node {node.name}'s workspace (size {size})"
            )
