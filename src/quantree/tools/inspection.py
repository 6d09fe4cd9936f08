"""inspection: what a quantized graph quantizes and how, read from the graph alone.

Works on any GraphModule with ``quantized_decomposed`` quantize/dequantize ops, or with the
native int8 ones of ``quantree.backends.CPU``, including one loaded back from a ``.pt2`` file
(no quantree metadata needed): each quantization point with
its dtype, range and scale/zero-point (or per-channel axis), then every compute op with how
many of its float inputs and outputs go through q/dq, so the ops left in float stand out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from quantree.core.graphs import attr_at
from quantree.core.qdq import DEQUANTIZE_OPS, PER_CHANNEL_OPS, QUANTIZE_OPS
from quantree.core.values import is_getitem, leaves_with_paths

# The CPU backend's own int8 quantize/dequantize: (x, scale, zero_point), range [-128, 127].
# Matched by name so that inspecting a file never needs the native kernels built.
_NATIVE_QUANTIZE, _NATIVE_DEQUANTIZE = "quantree.quantize.default", "quantree.dequantize.default"


def _is_quantize(node: fx.Node) -> bool:
    return node.target in QUANTIZE_OPS or str(node.target) == _NATIVE_QUANTIZE


def _is_dequantize(node: fx.Node) -> bool:
    return node.target in DEQUANTIZE_OPS or str(node.target) == _NATIVE_DEQUANTIZE


def _bounds(node: fx.Node) -> tuple[int, int, str]:
    """(quant_min, quant_max, dtype) of a quantize or dequantize node."""
    if str(node.target) in (_NATIVE_QUANTIZE, _NATIVE_DEQUANTIZE):
        return -128, 127, "int8"
    bounds: Any = node.args[4:7] if node.target in PER_CHANNEL_OPS else node.args[3:6]
    qmin, qmax, dtype = bounds
    return int(qmin), int(qmax), str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class QuantPoint:
    """One quantize (or folded integer constant) and the dequantize that reads it."""

    tensor: str  # the float tensor quantized: a node, a leaf "lstm[1]", or a constant
    read_by: tuple[str, ...]  # consumers of the dequantized tensor, "linear.args[1]"
    dtype: str
    quant_min: int
    quant_max: int
    scheme: str  # "per-tensor scale 0.0123 zero_point -3" / "per-channel axis 0 (98 ch), ..."
    constant: bool


@dataclass(frozen=True)
class OpStatus:
    node: str
    op: str
    inputs_quantized: int
    inputs_float: int
    outputs_quantized: int
    outputs_float: int
    lowered: bool

    @property
    def status(self) -> str:
        if self.lowered:
            return "integer kernel"
        if self.inputs_float == 0 and self.outputs_float == 0:
            return "quantized" if self.inputs_quantized or self.outputs_quantized else "float"
        if self.inputs_quantized or self.outputs_quantized:
            return "partly float"
        return "float"


def tensor_name(node: fx.Node) -> str:
    """``lstm[1]`` for a getitem chain, the node's own name otherwise."""
    path = []
    while is_getitem(node) and isinstance(node.args[0], fx.Node):
        path.append(node.args[1])
        node = node.args[0]
    return node.name + "".join(f"[{p!r}]" for p in reversed(path))


def _scheme(gm: torch.nn.Module, node: fx.Node) -> str:
    args: Any = node.args
    if node.target in PER_CHANNEL_OPS:
        scale: Any = attr_at(gm, str(args[1].target))
        zp: Any = attr_at(gm, str(args[2].target))
        axis = args[3]
        return (
            f"per-channel axis {axis} ({scale.numel()} ch), scale {float(scale.min()):.3g}.."
            f"{float(scale.max()):.3g}, zero_point {int(zp.min())}..{int(zp.max())}"
        )
    return f"per-tensor scale {float(args[1]):.6g} zero_point {int(args[2])}"  # type: ignore[arg-type]


def _consumers(node: fx.Node) -> tuple[str, ...]:
    found = []
    for user in node.users:
        if user.op == "output":
            found.append("output")
            continue
        for head, root in [*enumerate(user.args), *user.kwargs.items()]:
            for path, leaf in leaves_with_paths(root):
                if leaf is node:
                    where = "".join(f"[{p!r}]" for p in path)
                    found.append(f"{user.name}.args[{head}]{where}")
    return tuple(found)


def quant_points(gm: fx.GraphModule) -> list[QuantPoint]:
    """Every quantization point in graph order: each quantize (with the dequantizes that read
    it), and each dequantize of something else (an integer constant, an integer kernel's
    output)."""
    points = []
    for node in gm.graph.nodes:
        if _is_quantize(node):
            source = node.args[0]
            assert isinstance(source, fx.Node)
            tensor, constant = tensor_name(source), False
            readers = [u for u in node.users if not _is_dequantize(u)]
            read_by = [f"{u.name} (integer)" for u in readers]
            for dq in node.users:
                if _is_dequantize(dq):
                    read_by.extend(_consumers(dq))
        elif _is_dequantize(node):
            source = node.args[0]
            assert isinstance(source, fx.Node)
            if _is_quantize(source):
                continue  # listed with its quantize
            constant = source.op == "get_attr"
            if constant:
                value = attr_at(gm, str(source.target))
                shape = f" {list(value.shape)}" if isinstance(value, torch.Tensor) else ""
                tensor = f"constant {source.target}{shape}"
            else:
                tensor = f"integer {tensor_name(source)}"
            read_by = list(_consumers(node))
        else:
            continue
        qmin, qmax, dtype = _bounds(node)
        points.append(
            QuantPoint(tensor, tuple(read_by), dtype, qmin, qmax, _scheme(gm, node), constant)
        )
    return points


def _is_float_value(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return val.is_floating_point()
    return isinstance(node, fx.Node) and node.op == "call_function" and val is None


def op_statuses(gm: fx.GraphModule) -> list[OpStatus]:
    """Each compute op with how many float inputs/outputs pass through q/dq."""
    rows = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_getitem(node):
            continue
        if _is_quantize(node) or _is_dequantize(node):
            continue
        namespace = getattr(node.target, "namespace", "")
        lowered = namespace not in ("", "aten", "quantized_decomposed", "prims")
        inputs = [
            leaf
            for root in [*node.args, *node.kwargs.values()]
            for _, leaf in leaves_with_paths(root)
            if isinstance(leaf, fx.Node)
        ]
        in_q = sum(1 for a in inputs if _is_dequantize(a))
        in_f = sum(
            1 for a in inputs if not _is_dequantize(a) and a.op != "get_attr" and _is_float_value(a)
        )
        in_f += sum(
            1
            for a in inputs
            if a.op == "get_attr"
            and isinstance(v := attr_at(gm, str(a.target)), torch.Tensor)
            and v.is_floating_point()
        )
        carriers = [node] if not any(is_getitem(u) for u in node.users) else _leaves(node)
        float_carriers = [c for c in carriers if _is_float_value(c)]
        out_q = sum(1 for c in float_carriers if any(_is_quantize(u) for u in c.users))
        rows.append(
            OpStatus(
                node.name,
                _op_name(node),
                in_q,
                in_f,
                out_q,
                len(float_carriers) - out_q,
                lowered,
            )
        )
    return rows


def _leaves(node: fx.Node) -> list[fx.Node]:
    found = []
    for user in node.users:
        if is_getitem(user):
            nested = [u for u in user.users if is_getitem(u)]
            found.extend(_leaves(user) if nested else [user])
    return found


def _op_name(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    namespace = getattr(target, "namespace", "")
    return f"{namespace}.{name}" if namespace else str(name)


def summary(gm: fx.GraphModule, title: str = "model") -> str:
    """The text ``quantree inspect`` prints."""
    points = quant_points(gm)
    ops = op_statuses(gm)
    left = [op for op in ops if op.status in ("float", "partly float")]
    lines = [
        f"{title}: {len(points)} quantization point(s) "
        f"({sum(p.constant for p in points)} constant), {len(ops)} op(s), "
        f"{len(left)} computing in float",
    ]
    if points:
        lines += ["", "quantized tensors (graph order):"]
        tw = max(len(p.tensor) for p in points)
        for p in points:
            lines.append(
                f"  {p.tensor:<{tw}}  {p.dtype:<6} [{p.quant_min}, {p.quant_max}]  {p.scheme}"
                f"  -> {', '.join(p.read_by) or '(unused)'}"
            )
    elif not any(op.lowered for op in ops):
        lines += ["", "no quantize/dequantize ops: the model is float"]
    if ops:
        lines += ["", "ops:"]
        nw = max(len(o.node) for o in ops)
        ow = max(len(o.op) for o in ops)
        for o in ops:
            counts = (
                "reads and writes integer tensors"
                if o.lowered
                else f"inputs {o.inputs_quantized} dequantized / {o.inputs_float} float, "
                f"outputs {o.outputs_quantized} quantized / {o.outputs_float} float"
            )
            lines.append(f"  {o.node:<{nw}}  {o.op:<{ow}}  {o.status:<14}  {counts}")
    if left:
        lines += ["", "stay in float: " + ", ".join(f"{o.node} ({o.op})" for o in left)]
    return "\n".join(lines)
