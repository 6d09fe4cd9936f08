"""What a lowered model still computes in float, said once at lowering.

Two findings, each one ``QuantreeWarning``:

- float ops that read an int8 constant through a dequantize: the weight is stored int8 but
  no native kernel consumes it, so it is dequantized on every call (an embedding table or an
  LSTM cell's weights once cost most of a model's time this way);
- every other op left computing in float (shape and view ops, and ops that only create
  tensors, are not counted), by op, with the first nodes of each, but those the backend's
  ``simulated`` warning already names (ops next to activation quantize/dequantize nodes).
"""

from __future__ import annotations

import collections
import dataclasses
import warnings

import torch
import torch.fx as fx

from quantree.backends.cpu.passes.regions import FLOAT_OPS_KEY
from quantree.core.errors import QuantreeWarning
from quantree.core.qdq import DEQUANTIZE_OPS
from quantree.core.values import module_scope

DATA_MOVEMENT = {
    *("view", "reshape", "permute", "transpose", "t", "expand", "expand_as", "unsqueeze"),
    *("squeeze", "flatten", "unflatten", "contiguous", "clone", "slice", "select", "alias"),
    *("_unsafe_view", "detach", "detach_", "dropout", "copy_", "lift_fresh_copy", "split"),
    *("split_with_sizes", "chunk", "unbind", "to", "_to_copy", "zeros", "ones", "full"),
    *("arange", "new_zeros", "new_ones", "new_full", "new_empty", "empty", "scalar_tensor"),
    *("zeros_like", "ones_like", "full_like", "empty_like", "as_strided", "narrow"),
    *("_pack_padded_sequence", "_pad_packed_sequence", "index_select"),
}
"""aten ops that move, view or create data: not "computing in float"."""
FLOAT_KERNELS = frozenset({"group_norm", "norm_block", "attention"})
"""``quantree`` ops that compute in float (native float kernels): reported like aten's."""
SHOWN = 3  # node names shown per op


def _name(node: fx.Node) -> str:
    return str(getattr(node.target, "__name__", node.target)).split(".")[0]


def _is_float(node: fx.Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, list | tuple) else (val,)
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)


def _dequantizes_constant(arg: fx.Node) -> bool:
    """A reference dequantize of a folded constant (lowering keeps those as convert made)."""
    source = arg.args[0] if arg.target in DEQUANTIZE_OPS else None
    return isinstance(source, fx.Node) and source.op == "get_attr"


def float_ops(root: torch.nn.Module) -> list[tuple[str, fx.Node | ProgramOp, bool]]:
    """``(where, node, reads a dequantized int8 constant)`` of every aten op of ``root``'s
    graphs (nested ones too) that computes a float tensor, those inside native region
    programs included; ``where`` is the submodule."""
    found: list[tuple[str, fx.Node | ProgramOp, bool]] = []
    for prefix, module in root.named_modules():
        graph = getattr(module, "graph", None)
        if not isinstance(module, fx.GraphModule) or not isinstance(graph, fx.Graph):
            continue
        for node in graph.nodes:
            found += [(prefix, op, False) for op in program_float_ops(node)]
            namespace = getattr(node.target, "namespace", "")
            float_kernel = namespace == "quantree" and _name(node) in FLOAT_KERNELS
            if node.op != "call_function" or not (namespace == "aten" or float_kernel):
                continue
            if not _is_float(node):
                continue
            if _name(node) in DATA_MOVEMENT:
                continue
            constant = any(_dequantizes_constant(a) for a in node.all_input_nodes)
            found.append((prefix, node, constant))
    return found


@dataclasses.dataclass(frozen=True)
class ProgramOp:
    """A float op a native region program computes (``passes/regions.py``): float still,
    though no longer a node of the graph."""

    target: str
    name: str
    scope: str
    program: str  # the program node


def program_float_ops(node: fx.Node) -> list[ProgramOp]:
    """The float ops computed inside ``node`` if it is a region program, else none."""
    recorded = node.meta.get(FLOAT_OPS_KEY, ()) if node.op == "call_function" else ()
    return [ProgramOp(target, name, scope, node.name) for target, name, scope in recorded]


def _describe(items: list[tuple[str, fx.Node | ProgramOp, bool]]) -> str:
    by_op: dict[str, list[str]] = collections.defaultdict(list)
    for prefix, node, _ in items:
        if isinstance(node, ProgramOp):
            scope, inside = node.scope, f" in native program {node.program}"
        else:
            scope, inside = module_scope(node), ""
        where = f"{prefix}." if prefix else ""
        label = f"{where}{node.name}" + (f" ({scope})" if scope else "") + inside
        by_op[str(node.target)].append(label)
    parts = []
    for op, names in sorted(by_op.items(), key=lambda kv: -len(kv[1])):
        more = f", +{len(names) - SHOWN} more" if len(names) > SHOWN else ""
        parts.append(f"{op} x{len(names)} ({', '.join(names[:SHOWN])}{more})")
    return "; ".join(parts)


def warn_float_ops(root: torch.nn.Module, backend: str, named: set[fx.Node] | None = None) -> None:
    """One warning for float ops that dequantize int8 constants each call, one for the rest
    but those already ``named`` (``simulated.warn_simulated``'s ops beside quantize/dequantize
    nodes of activations)."""
    found = float_ops(root)
    costly = [f for f in found if f[2]]
    rest = [f for f in found if not f[2] and f[1] not in (named or set())]
    if costly:
        warnings.warn(
            f"lowering for {backend}: {len(costly)} float op(s) dequantize an int8 constant "
            f"(a weight) on every call, since no native kernel reads it: {_describe(costly)}. "
            "Add a lowering rule for them, or leave their weights float in the recipe",
            QuantreeWarning,
            stacklevel=3,
        )
    if rest:
        warnings.warn(
            f"lowering for {backend}: {len(rest)} {'other ' if named else ''}op(s) compute "
            f"in float: {_describe(rest)}",
            QuantreeWarning,
            stacklevel=3,
        )
