"""Would the lowered model be slower than the float model it replaces? Said once, at lowering.

Kernels win on arithmetic; a model loses where it pays per call instead: ops left float
between quantize/dequantize, a step run op by op in Python, a weight dequantized every call.
All of it is visible in the graphs, so the answer is a static estimate, not a timing: the same
on every machine and run (a timing at lowering flips under load, costs every lowering a few
forwards, and needs inputs ``lower`` does not have). A ``CostModel`` prices each op: a fixed
cost per call plus its arithmetic. The float side is the reference graph less its q/dq, priced
as eager ops by ``note_float_costs``, the CPU backend's first rule (a ``Backend`` has no hook
before its rules; it rewrites nothing). The lowered side is what ``finish`` left, each kernel
priced at int8 by the reference op it replaced (``REPLACES_KEY``). At ``CostModel.threshold``
one ``QuantreeWarning`` names the biggest causes and the options; the estimate is on the
model's ``meta`` either way (``speed_of``); ``cpu_backend(speed_check=False)`` turns it off.
Figures: benchmarks/README.md, "Slower than float, said at lowering".
"""

from __future__ import annotations

import collections
import dataclasses
import math
import warnings

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from quantree.backends.cpu.passes.float_report import DATA_MOVEMENT
from quantree.backends.cpu.passes.regions import FLOAT_OPS_KEY
from quantree.core.errors import QuantreeWarning
from quantree.core.graphs import fetch_attr
from quantree.core.lower import LoweringContext
from quantree.core.qdq import DEQUANTIZE_OPS, QUANTIZE_OPS
from quantree.core.stages import REPLACES_KEY
from quantree.core.values import is_getitem
from quantree.recurrent.loop import CellLoop, RecurrentCells
from quantree.recurrent.unrolled.step_loop import StepLoop

FLOAT_COSTS_KEY = "quantree_float_costs"  # meta, first rule to ``finish``: a ``Priced``
SPEED_KEY = "quantree_speed"  # meta of a CPU-lowered model: its ``SpeedEstimate``

_MATMULS = {"mm", "bmm", "matmul", "addmm", "baddbmm", "linear", "addbmm", "einsum"}
_CONVS = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution"}
_RECURRENT = {"lstm", "gru", "rnn_tanh", "rnn_relu"}
_NATIVE_QDQ, SHOWN = {"quantize", "dequantize"}, 3  # SHOWN: causes named in the warning


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Microseconds per call and work rates; one thread. Fitted, not exact: what matters is
    the ratio of the two sides, both priced by the same model."""

    eager_op_us: float = 3.0  # an ATen op of the float model (eager runs no export copies)
    graph_op_us: float = 4.0  # an ATen op of the lowered graph's generated forward
    view_op_us: float = 4.0  # a view, either side (getitem: free)
    native_op_us: float = 4.0  # a quantree op (a direct native call: guards, ctypes)
    python_step_op_us: float = 6.0  # an op of a step a Python loop runs, per step
    native_step_us: float = 0.3  # a native loop's per-step overhead
    float_macs_per_us: float = 40_000.0
    int8_macs_per_us: float = 120_000.0
    float_elems_per_us: float = 1_000.0
    int8_elems_per_us: float = 2_000.0
    threshold: float = 0.8  # estimate at which it says so (estimates ran 0.2-0.5 low)
    min_float_us: float = 200.0  # below: a toy, priced by per-call constants alone; unsaid


DEFAULT_COSTS = CostModel()


@dataclasses.dataclass(frozen=True)
class Work:
    macs: float = 0.0
    elems: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.macs + other.macs, self.elems + other.elems)

    def scaled(self, k: float) -> Work:
        return Work(self.macs * k, self.elems * k)


@dataclasses.dataclass(frozen=True)
class Priced:
    """The reference graph, priced as the float model: its total, each op's work by
    ``(graph path, node name)``, each loop's steps and work per step by module path."""

    float_us: float
    nodes: dict[tuple[str, str], Work]
    loops: dict[str, tuple[int, Work]]


@dataclasses.dataclass(frozen=True)
class Cause:
    """One thing the lowered model pays that float does not, summed over a forward."""

    what: str  # "python loop", "float op", "quantize/dequantize", "weight dequantized per call"
    name: str  # the loop's module path, the op; "" for the conversions
    count: int  # calls per forward
    us: float


@dataclasses.dataclass(frozen=True)
class SpeedEstimate:
    """What ``speed_of`` returns: estimated microseconds per forward of the float model and
    of the lowered one, and the lowered side's costs that float does not pay (biggest first)."""

    float_us: float
    lowered_us: float
    causes: tuple[Cause, ...]

    @property
    def ratio(self) -> float:
        return self.lowered_us / self.float_us if self.float_us > 0 else math.inf

    def summary(self) -> str:
        shown = "; ".join(_describe(c, self.lowered_us) for c in self.causes[:SHOWN])
        head = f"estimated {self.ratio:.2f}x float ({self.lowered_us:.0f} / {self.float_us:.0f} us)"
        return f"{head}; most of it: {shown}" if shown else head


def speed_of(gm: torch.nn.Module) -> SpeedEstimate | None:
    """The CPU backend's estimate for ``gm`` (None: not CPU-lowered, or no speed check)."""
    meta = getattr(gm, "meta", None)
    found = meta.get(SPEED_KEY) if isinstance(meta, dict) else None
    return found if isinstance(found, SpeedEstimate) else None


def _name(node: fx.Node) -> str:
    return str(getattr(node.target, "__name__", node.target)).split(".")[0]


def _namespace(node: fx.Node) -> str:  # "aten", "quantree", or "" (operator, Python)
    return str(getattr(node.target, "namespace", ""))


def _shape_of(arg: object, gm: torch.nn.Module) -> tuple[int, ...] | None:
    if not isinstance(arg, fx.Node):
        return None
    val = arg.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(_size(s) for s in val.shape)
    if arg.target in DEQUANTIZE_OPS and arg.args:  # a weight's dequantize
        return _shape_of(arg.args[0], gm)
    if arg.op == "get_attr":
        try:
            found = fetch_attr(gm, str(arg.target))
        except Exception:  # an attribute path this module does not hold
            return None
        if isinstance(found, torch.Tensor):
            return tuple(found.shape)
    return None


def _size(s: object) -> int:
    """A dimension; a symbolic one at its example's size (``int()`` would add a guard)."""
    hint = s if isinstance(s, int) else getattr(getattr(s, "node", None), "hint", None)
    return hint if isinstance(hint, int) else 1


def _numel(shape: tuple[int, ...] | None) -> int:
    return math.prod(shape) if shape is not None else 0


def work_of(node: fx.Node, gm: torch.nn.Module) -> Work:
    """The arithmetic of one ATen op: multiply-adds for products, convolutions and
    recurrent layers (from the shapes of its inputs), elements written for the rest."""
    try:
        leaves = tree_leaves(node.meta.get("val"))
        out = sum(math.prod(map(_size, t.shape)) for t in leaves if isinstance(t, torch.Tensor))
    except Exception:  # symbolic sizes: a dynamic dimension priced as 1
        out = 0
    name = _name(node)
    args = node.args
    if name in _MATMULS and args:
        first = args[1] if name in ("addmm", "baddbmm", "addbmm") and len(args) > 1 else args[0]
        shape = _shape_of(first, gm)
        if name == "einsum":
            return Work(elems=out)
        return Work(macs=out * (shape[-1] if shape else 1), elems=out)
    if name in _CONVS and len(args) > 1:
        weight = _shape_of(args[1], gm)
        per_out = _numel(weight) // weight[0] if weight else 1
        return Work(macs=out * per_out, elems=out)
    if name in _RECURRENT and len(args) > 2 and isinstance(args[2], list | tuple):
        x = _shape_of(args[0], gm)
        rows = _numel(x) // x[-1] if x else 1
        weights = sum(_numel(_shape_of(w, gm)) for w in args[2] if w is not None)
        return Work(macs=rows * weights, elems=out)
    if name == "scaled_dot_product_attention" and len(args) > 1:
        q, k = _shape_of(args[0], gm), _shape_of(args[1], gm)
        if q and k:
            return Work(macs=2 * _numel(q) * k[-2], elems=out)
    return Work(elems=out)


def _is_qdq(node: fx.Node) -> bool:
    if node.target in QUANTIZE_OPS or node.target in DEQUANTIZE_OPS:
        return True
    return _namespace(node) == "quantree" and _name(node) in _NATIVE_QDQ


def _is_view(node: fx.Node) -> bool:
    return is_getitem(node) or _name(node) in DATA_MOVEMENT or node.target in (getattr, len)


def _loop_steps(module: torch.nn.Module, node: fx.Node) -> int:
    """Steps a loop module runs per call, as captured."""
    if isinstance(module, StepLoop):
        return module.steps_captured
    steps = getattr(module, "steps_captured", None)
    if isinstance(steps, int):
        return steps
    shape = _shape_of(node.args[0], module) if node.args else None
    if not shape:
        return 1
    return shape[1] if getattr(module, "batch_first", False) and len(shape) > 1 else shape[0]


def _bodies(module: torch.nn.Module) -> list[tuple[str, fx.GraphModule]]:
    """The outermost graphs a loop module runs each step (a cells layer: each loop's)."""
    found = [(n, m) for n, m in module.named_modules() if isinstance(m, fx.GraphModule)]
    return [(n, m) for n, m in found if not any(n.startswith(f"{o}.") for o, _ in found if o)]


def price_float(root: fx.GraphModule, costs: CostModel = DEFAULT_COSTS) -> Priced:
    """The reference graph ``root`` priced as the float model it came from: every op but
    quantize/dequantize, at eager cost and float rates, nested loops times their steps."""
    nodes: dict[tuple[str, str], Work] = {}
    loops: dict[str, tuple[int, Work]] = {}

    def walk(gm: fx.GraphModule, path: str) -> tuple[float, Work]:
        us, total = 0.0, Work()
        for node in gm.graph.nodes:
            if node.op == "call_module":
                module = gm.get_submodule(str(node.target))
                where = f"{path}.{node.target}" if path else str(node.target)
                bodies = _bodies(module)
                if not bodies:  # no graph to run: export's shape guards
                    continue
                steps = _loop_steps(module, node)
                step_us, step_work = 0.0, Work()
                for name, body in bodies:
                    b_us, b_work = walk(body, f"{where}.{name}" if name else where)
                    step_us, step_work = step_us + b_us, step_work + b_work
                loops[where] = (steps, step_work)
                us += costs.eager_op_us + steps * step_us
                total = total + step_work.scaled(steps)
                continue
            if node.op != "call_function" or _is_qdq(node):
                continue
            if _is_view(node):
                us += 0.0 if is_getitem(node) else costs.view_op_us
                continue
            w = work_of(node, gm)
            nodes[(path, node.name)] = w
            total = total + w
            us += costs.eager_op_us + w.macs / costs.float_macs_per_us
            us += w.elems / costs.float_elems_per_us
        return us, total

    float_us, _ = walk(root, "")
    return Priced(float_us, nodes, loops)


def note_float_costs(ctx: LoweringContext, node: fx.Node) -> bool:
    """Not a rewrite (always False): prices the reference once, before any rule changes it."""
    if FLOAT_COSTS_KEY not in ctx.gm.meta:
        ctx.gm.meta[FLOAT_COSTS_KEY] = price_float(ctx.gm)
    return False


def _reads_constant(node: fx.Node) -> list[fx.Node]:
    found = []
    for a in node.all_input_nodes:
        source = a.args[0] if a.target in DEQUANTIZE_OPS and a.args else None
        if isinstance(source, fx.Node) and source.op == "get_attr":
            found.append(a)
    return found


def price_lowered(
    root: fx.GraphModule, priced: Priced, costs: CostModel = DEFAULT_COSTS
) -> SpeedEstimate:
    """``root`` (as ``finish`` leaves it) priced call by call, against ``priced``'s float."""
    causes: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])

    def note(what: str, name: str, count: float, us: float) -> None:
        causes[(what, name)][0] += count
        causes[(what, name)][1] += us

    def op_us(node: fx.Node, gm: fx.GraphModule, path: str, per_call: float, k: float) -> float:
        """One call of ``node`` (``per_call`` its fixed cost), ``k`` times a forward."""
        if is_getitem(node):
            return 0.0
        if _is_view(node):
            return costs.view_op_us * k
        if _is_qdq(node):
            shape = _shape_of(node.args[0] if node.args else None, gm)
            us = (per_call + _numel(shape) / costs.int8_elems_per_us) * k
            note("quantize/dequantize", "", k, us)
            return us
        if _namespace(node) == "quantree":
            inside = node.meta.get(FLOAT_OPS_KEY, ())
            if inside:  # a region program: its float ops in one native call
                w = sum((priced.nodes.get((path, n), Work()) for _, n, _ in inside), Work())
                rate = costs.float_elems_per_us
                return (costs.native_op_us + w.macs / costs.float_macs_per_us + w.elems / rate) * k
            replaced = node.meta.get(REPLACES_KEY)
            known = priced.nodes.get((path, replaced[0])) if replaced else None
            w = known if known is not None else work_of(node, gm)
            us = costs.native_op_us + w.macs / costs.int8_macs_per_us
            return (us + w.elems / costs.int8_elems_per_us) * k
        w = work_of(node, gm)
        us = (per_call + w.macs / costs.float_macs_per_us + w.elems / costs.float_elems_per_us) * k
        for dq in _reads_constant(node):  # each call dequantizes the weight again
            extra = _numel(_shape_of(dq, gm)) / costs.int8_elems_per_us * k
            note("weight dequantized per call", _name(node), k, extra)
            us += extra
        note("float op", f"{_namespace(node)}.{_name(node)}", k, us)
        return us

    def walk(gm: fx.GraphModule, path: str, per_call: float, k: float) -> float:
        us = 0.0
        for node in gm.graph.nodes:
            if node.op == "call_function":
                us += op_us(node, gm, path, per_call, k)
            elif node.op == "call_module":
                us += module_us(gm, node, path, per_call, k)
        return us

    def module_us(gm: fx.GraphModule, node: fx.Node, path: str, per_call: float, k: float) -> float:
        module = gm.get_submodule(str(node.target))
        where = f"{path}.{node.target}" if path else str(node.target)
        if where not in priced.loops:  # no graph of the reference's: export's shape guards
            return 0.0
        steps, step_work = priced.loops[where]
        if isinstance(module, StepLoop | CellLoop | RecurrentCells | fx.GraphModule):
            interpreted = not isinstance(module, fx.GraphModule)
            inner = costs.python_step_op_us if interpreted else per_call
            us = sum(
                walk(body, f"{where}.{name}" if name else where, inner, k * steps)
                for name, body in _bodies(module)
            )
            if interpreted:
                note("python loop", where, k * steps, us)
            return per_call * k + us
        # a native loop: one call, its steps' arithmetic at int8 rates
        step = costs.native_step_us + step_work.macs / costs.int8_macs_per_us
        step += step_work.elems / costs.int8_elems_per_us
        return (costs.native_op_us + steps * step) * k

    lowered_us = walk(root, "", costs.graph_op_us, 1.0)
    found = [Cause(what, name, int(c), us) for (what, name), (c, us) in causes.items()]
    found.sort(key=lambda c: -c.us)
    return SpeedEstimate(priced.float_us, lowered_us, tuple(found))


def _describe(cause: Cause, total: float) -> str:
    share = f"{100 * cause.us / total:.0f}%" if total > 0 else "?"
    if cause.what == "python loop":
        return f"loop {cause.name} stepped in Python ({share}, {cause.count} step-runs)"
    if cause.what == "quantize/dequantize":
        return f"{cause.count} quantize/dequantize calls ({share})"
    if cause.what == "weight dequantized per call":
        return f"{cause.name} dequantizes its int8 weight every call ({share})"
    return f"{cause.name} x{cause.count} in float ({share})"


def _options(estimate: SpeedEstimate) -> str:
    kinds = {c.what for c in estimate.causes[:SHOWN]}
    options = ["fold_loops=False (the unrolled steps, fused)"] if "python loop" in kinds else []
    if "quantize/dequantize" in kinds:
        options.append("Int8Quantizer(activations=ActivationPoints.WEIGHTED_INPUTS)")
    if kinds & {"float op", "weight dequantized per call"}:
        options.append("leave those modules float in the recipe (points=...)")
    options.append("keep the float model, or deploy the QDQ export (qt.export_onnx)")
    return "; ".join(options)


def check_speed(
    lowered: fx.GraphModule, priced: Priced | None, costs: CostModel = DEFAULT_COSTS
) -> SpeedEstimate | None:
    """Price ``lowered`` against ``priced``, keep the estimate on its ``meta``, and say once,
    with the causes and the options, if it is not faster than float."""
    if priced is None:
        return None
    estimate = price_lowered(lowered, priced, costs)
    lowered.meta[SPEED_KEY] = estimate
    if estimate.ratio < costs.threshold or estimate.float_us < costs.min_float_us:
        return estimate
    warnings.warn(
        f"lowering for the CPU backend: the lowered model would be no faster than the float "
        f"model, {estimate.summary()}. Options: {_options(estimate)}. The estimate is "
        "quantree.backends.cpu.speed_of(model); cpu_backend(speed_check=False) leaves it "
        "unchecked and unsaid",
        QuantreeWarning,
        stacklevel=4,
    )
    return estimate
