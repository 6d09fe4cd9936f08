"""inspection: what a quantized graph quantizes and how, read from the graph alone.

Over 400 lines: the quantization points and the op statuses read the same q/dq vocabulary
(reference and native) from a bare graph; split along that line when it grows.

Works on any GraphModule with ``quantized_decomposed`` quantize/dequantize ops, or with the
native int8 ones of ``quantree.backends.CPU``, including one loaded back from a ``.pt2`` file
(no quantree metadata needed): each quantization point with
its dtype, range and scale/zero-point (or per-channel axis), then every compute op with how
many of its float inputs and outputs go through q/dq, so the ops left in float stand out.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

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


# One vocabulary for ``quantree inspect``, the report's "What is quantized" block and the demo.
INT8_KERNEL = "int8 kernel"  # a backend's native op: reads and writes integer tensors
# a native linear/conv whose input is int16 (quantized inside the op, int8 weights)
INT16_KERNEL = "int16-input kernel"
# a native 1-d conv with int16 weights (int8 or int16 input): 16-bit products, exact int32 sums
INT16_WEIGHT_KERNEL = "int16-weight kernel"
INT8_MOVE = "int8 data movement"  # transpose/view/... of int8 values: exact on the integers
INT8_CONSTANT = "int8 constant"  # a tensor made from nothing (zeros) and quantized
SIMULATED = "simulated (q/dq)"  # a float op between dequantize and quantize
PARTLY_FLOAT = "partly float"
NATIVE_FLOAT = "float, native program"  # a backend program or kernel computing float ops
FLOAT = "float"
INT8_STATUSES = (
    INT8_KERNEL, INT16_KERNEL, INT16_WEIGHT_KERNEL, INT8_MOVE, INT8_CONSTANT, SIMULATED
)  # fmt: skip
_INT16_INPUT_OPS = ("quantree.linear16.default", "quantree.conv16.default")
_INT16_WEIGHT_OPS = ("quantree.conv1d_w16.default",)
_FLOAT_KERNEL_OPS = {  # float in, float out
    "quantree.group_norm.default": "group_norm",
    "quantree.norm_block.default": "norm_block",
    "quantree.attention.default": "attention",
}

# Ops that only move, select or reshape elements: on int8 values they are exact, so one
# reading and writing int8 (or between a dequantize and a quantize with the same parameters)
# runs in int8, not in float.
DATA_MOVEMENT = frozenset(
    {
        "transpose", "t", "permute", "view", "_unsafe_view", "reshape", "flatten",
        "unflatten", "squeeze", "unsqueeze", "expand", "expand_as", "contiguous", "clone",
        "select", "slice", "narrow", "index_select", "repeat", "flip", "roll", "alias",
        "detach", "_to_copy", "chunk", "split", "split_with_sizes", "unbind", "movedim",
        "swapaxes", "swapdims", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle",
        "max_pool1d", "max_pool2d", "max_pool2d_with_indices", "cat", "stack", "pad",
        "constant_pad_nd", "embedding", "gather",
    }
)  # fmt: skip

# Activations a backend fuses into the conv/linear before them (one int8 kernel).
FUSED_ACTIVATIONS = frozenset({"relu", "relu_", "hardtanh", "hardtanh_", "relu6", "clamp"})
_FUSING = frozenset({"conv1d", "conv2d", "conv3d", "linear", "convolution", "addmm", "matmul"})
_CONSTANT_MAKERS = frozenset({"zeros", "ones", "full", "empty", "zeros_like", "ones_like",
                              "full_like", "scalar_tensor", "arange"})  # fmt: skip


@dataclass(frozen=True)
class OpStatus:
    node: str
    op: str
    inputs_quantized: int  # dequantized from int8, or integer tensors
    inputs_float: int
    outputs_quantized: int  # quantized, or integer tensors
    outputs_float: int
    lowered: bool  # a backend's native op
    status: str = FLOAT  # one of INT8_STATUSES, PARTLY_FLOAT, FLOAT
    native: bool = False  # runs on integer tensors (no float op between q/dq)
    fused_with: str = ""  # the conv/linear or activation it is fused with
    detail: str = ""  # NATIVE_FLOAT: the float ops inside, by op


def _target(node: fx.Node) -> Any:
    """The op a node calls: a backend's direct-call wrapper (``.op``) unwrapped."""
    wrapped = getattr(node.target, "op", None)
    return wrapped if isinstance(wrapped, torch._ops.OpOverload) else node.target


def node_name(node: fx.Node) -> str:
    """The node's name as ``torch.export`` writes it, so the model in memory, its saved
    ``.pt2`` and the report name a node alike: a node a backend inserted as
    ``linear_default`` (op ``quantree.linear.default``) is ``linear``, ``transpose_int``
    is ``transpose``."""
    target = _target(node)
    packet = getattr(target, "_opname", None) or getattr(
        getattr(target, "overloadpacket", None), "__name__", None
    )
    overload = getattr(target, "_overloadname", None)
    if node.op == "call_function" and packet and overload:
        match = re.fullmatch(rf"(.*)_{re.escape(overload)}(_\d+)?", node.name)
        if match and match.group(1) == packet:
            return packet + (match.group(2) or "")
    return node.name


def tensor_name(node: fx.Node) -> str:
    """``lstm[1]`` for a getitem chain, the node's own name otherwise."""
    path = []
    while is_getitem(node) and isinstance(node.args[0], fx.Node):
        path.append(node.args[1])
        node = node.args[0]
    return node_name(node) + "".join(f"[{p!r}]" for p in reversed(path))


def _constant(gm: torch.nn.Module, arg: object) -> torch.Tensor | None:
    """The tensor a qparam argument holds: a ``get_attr``'s attribute, or the value the graph
    recorded for a node that computes it (a folded or shared constant); None if neither."""
    if not isinstance(arg, fx.Node):
        return None
    found = attr_at(gm, str(arg.target)) if arg.op == "get_attr" else arg.meta.get("val")
    if not isinstance(found, torch.Tensor) or isinstance(found, FakeTensor) or found.is_meta:
        return None
    return found.detach()  # a loaded scale parameter requires grad: read it as a number


def _scheme(gm: torch.nn.Module, node: fx.Node) -> str:
    args: Any = node.args
    if node.target in PER_CHANNEL_OPS:
        scale, zp, axis = _constant(gm, args[1]), _constant(gm, args[2]), args[3]
        if scale is None or zp is None or scale.numel() == 0 or zp.numel() == 0:
            # computed at run time (or a fake value): name where it comes from instead
            where = [node_name(a) if isinstance(a, fx.Node) else repr(a) for a in args[1:3]]
            return f"per-channel axis {axis}, scale from {where[0]}, zero_point from {where[1]}"
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
                    found.append(f"{node_name(user)}.args[{head}]{where}")
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
            read_by = [f"{node_name(u)} (integer)" for u in readers]
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


def _is_native(node: fx.Node) -> bool:
    namespace = getattr(node.target, "namespace", "")
    return node.op == "call_function" and namespace not in (
        "",
        "aten",
        "quantized_decomposed",
        "prims",
    )


def _base_name(node: fx.Node) -> str:
    """``transpose`` for ``aten.transpose.int``, the function's name otherwise."""
    target = _target(node)
    packet = getattr(getattr(target, "overloadpacket", None), "__name__", None)
    return str(packet or getattr(target, "__name__", str(target)))


def _is_integer(node: Any) -> bool:
    """Whether ``node`` yields integer (quantized) tensors. Read from its ``val`` when there
    is one; a graph a backend rewrote may have none: then a native op's output is integer
    (its dequantize's is float), data movement keeps its input's kind, anything else is
    float."""
    if not isinstance(node, fx.Node):
        return False
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return not val.is_floating_point() and val.dtype != torch.bool
    if _is_dequantize(node):
        return False
    if _is_quantize(node):
        return True
    if is_getitem(node) and isinstance(node.args[0], fx.Node):
        return _is_integer(node.args[0])
    if _is_native(node):
        return True
    if node.op == "call_function" and _base_name(node) in DATA_MOVEMENT:
        first = next((a for a in _tensor_inputs(node)), None)
        return first is not None and _is_integer(first)
    return False


def _is_float_value(node: Any) -> bool:
    if not isinstance(node, fx.Node):
        return False
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.is_floating_point()
    if val is not None or node.op not in ("call_function", "placeholder"):
        return False
    return not _is_integer(node)


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [
        leaf
        for root in [*node.args, *node.kwargs.values()]
        for _, leaf in leaves_with_paths(root)
        if isinstance(leaf, fx.Node)
    ]


def _qparams(node: fx.Node) -> tuple[Any, ...]:
    """A quantize or dequantize node's parameters (scale, zero point, range, dtype)."""
    return tuple(a.target if isinstance(a, fx.Node) else a for a in node.args[1:])


def _counts(gm: fx.GraphModule, node: fx.Node) -> tuple[int, int, list[fx.Node], int]:
    """(inputs quantized, inputs float, float output carriers, outputs quantized)."""
    inputs = _tensor_inputs(node)
    in_q = sum(1 for a in inputs if _is_dequantize(a) or (a.op != "get_attr" and _is_integer(a)))
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
    out_q += sum(1 for c in carriers if _is_integer(c))
    return in_q, in_f, float_carriers, out_q


def _same_params_movement(node: fx.Node, carriers: list[fx.Node]) -> bool:
    """Data movement read through a dequantize and written through a quantize with the same
    parameters: the integers only move."""
    data = [leaf for _, leaf in leaves_with_paths(node.args[0]) if isinstance(leaf, fx.Node)]
    if not data or not all(_is_dequantize(a) for a in data):
        return False
    dqs = data
    qs = [u for c in carriers for u in c.users if _is_quantize(u)]
    if not dqs or not qs:
        return False
    params = {_qparams(n) for n in [*dqs, *qs]}
    return len(params) == 1


def op_statuses(gm: fx.GraphModule) -> list[OpStatus]:
    """Each compute op with how many float inputs/outputs pass through q/dq, and its status:
    an int8 kernel, int8 data movement, an int8 constant, simulated (q/dq), or (partly)
    float. A conv/linear whose only float output feeds a relu (or clamp) whose output is
    quantized is one fused op, not a float edge."""
    nodes = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and not is_getitem(n)
        and not _is_quantize(n)
        and not _is_dequantize(n)
    ]
    counts = {n: _counts(gm, n) for n in nodes}
    fused: dict[fx.Node, fx.Node] = {}  # both ends of a fused conv/linear -> activation edge
    for n in nodes:
        in_q, in_f, carriers, _ = counts[n]
        if _base_name(n) not in _FUSING or in_f or len(carriers) != 1 or len(n.users) != 1:
            continue
        (act,) = n.users
        if act not in counts or _base_name(act) not in FUSED_ACTIVATIONS:
            continue
        _, a_in_f, a_carriers, a_out_q = counts[act]
        if a_in_f == 1 and a_out_q == len(a_carriers) and a_carriers:
            fused[n], fused[act] = act, n
    rows = []
    for n in nodes:
        in_q, in_f, carriers, out_q = counts[n]
        out_f = len(carriers) - sum(1 for c in carriers if any(_is_quantize(u) for u in c.users))
        lowered = _is_native(n)
        partner = fused.get(n)
        if partner is not None and _base_name(n) in FUSED_ACTIVATIONS:
            in_f -= 1  # the edge inside a fused pair is not a float tensor
        elif partner is not None:
            out_f -= 1
        data = [leaf for _, leaf in leaves_with_paths(n.args[0]) if isinstance(leaf, fx.Node)]
        integer_in = bool(data) and all(_is_integer(a) for a in data)  # not indices
        inside = _program_float_ops(gm, n) if lowered else None
        if lowered and _op_name(n) in _FLOAT_KERNEL_OPS:
            inside = collections.Counter([_FLOAT_KERNEL_OPS[_op_name(n)]])
        if inside:
            status, native = NATIVE_FLOAT, False
        elif lowered and _op_name(n) in _INT16_INPUT_OPS:
            status, native = INT16_KERNEL, True
        elif lowered and _op_name(n) in _INT16_WEIGHT_OPS:
            status, native = INT16_WEIGHT_KERNEL, True
        elif lowered:
            status, native = INT8_KERNEL, True
        elif (
            _base_name(n) in DATA_MOVEMENT
            and not in_f
            and not out_f
            and (integer_in or _same_params_movement(n, carriers))
        ):
            status, native = INT8_MOVE, integer_in
        elif in_f == 0 and out_f == 0:
            if not (in_q or out_q):
                status, native = FLOAT, False
            elif in_q == 0 and _base_name(n) in _CONSTANT_MAKERS:
                status, native = INT8_CONSTANT, False
            else:
                status, native = SIMULATED, False
        else:
            status = PARTLY_FLOAT if in_q or out_q else FLOAT
            native = False
        rows.append(
            OpStatus(
                node_name(n),
                _op_name(n),
                in_q,
                in_f,
                out_q,
                out_f,
                lowered,
                status,
                native,
                node_name(partner) if partner is not None else "",
                ", ".join(f"{op} {k}" for op, k in inside.most_common()) if inside else "",
            )
        )
    return rows


def _program_float_ops(gm: fx.GraphModule, node: fx.Node) -> collections.Counter[str] | None:
    """The float ops a backend's region program computes, read from its code tensor."""
    if _op_name(node) != "quantree.program.default" or len(node.args) < 3:
        return None
    code = node.args[2]
    table = attr_at(gm, str(code.target)) if isinstance(code, fx.Node) else None
    if not isinstance(table, torch.Tensor):
        return None
    from quantree.backends.cpu.passes.regions import float_ops_of_code

    return float_ops_of_code(table)


def _leaves(node: fx.Node) -> list[fx.Node]:
    found = []
    for user in node.users:
        if is_getitem(user):
            nested = [u for u in user.users if is_getitem(u)]
            found.extend(_leaves(user) if nested else [user])
    return found


def _op_name(node: fx.Node) -> str:
    target = _target(node)
    namespace = getattr(target, "namespace", "")
    name = getattr(target, "_opname", None)
    overload = getattr(target, "_overloadname", None)
    if namespace and name and overload:
        return f"{namespace}.{name}.{overload}"
    name = getattr(target, "__name__", str(target))
    return f"{namespace}.{name}" if namespace else str(name)


def summary(gm: fx.GraphModule, title: str = "model") -> str:
    """The text ``quantree inspect`` prints (and the report's "What is quantized" block)."""
    points = quant_points(gm)
    ops = op_statuses(gm)
    left = [op for op in ops if op.status in (FLOAT, PARTLY_FLOAT, NATIVE_FLOAT)]
    by_status = {s: sum(1 for o in ops if o.status == s) for s in (*INT8_STATUSES, PARTLY_FLOAT)}
    counted = ", ".join(f"{s} {n}" for s, n in by_status.items() if n)
    lines = [
        f"{title}: {len(points)} quantization point(s) "
        f"({sum(p.constant for p in points)} constant), {len(ops)} op(s)"
        + (f": {counted}" if counted else "")
        + f", {len(left)} computing in float",
        f"run natively on int8: {sum(o.native for o in ops)} of {len(ops)} op(s) "
        f"({INT8_KERNEL} {by_status[INT8_KERNEL]}, "
        + "".join(
            f"{s} {by_status[s]}, " for s in (INT16_KERNEL, INT16_WEIGHT_KERNEL) if by_status[s]
        )
        + f"{INT8_MOVE} {sum(o.native and o.status == INT8_MOVE for o in ops)})",
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
        sw = max(len(o.status) for o in ops)
        for o in ops:
            if o.detail:
                counts = f"computes in float: {o.detail}"
            elif o.lowered:
                counts = "reads and writes integer tensors"
            elif o.native:
                counts = "moves int8 values"
            else:
                counts = (
                    f"inputs {o.inputs_quantized} int8 / {o.inputs_float} float, "
                    f"outputs {o.outputs_quantized} int8 / {o.outputs_float} float"
                )
            if o.fused_with:
                counts += f"; fused with {o.fused_with}"
            lines.append(f"  {o.node:<{nw}}  {o.op:<{ow}}  {o.status:<{sw}}  {counts}")
    if left:
        lines += ["", "stay in float: " + ", ".join(f"{o.node} ({o.op})" for o in left)]
    return "\n".join(lines)
