"""refine: a reference graph whose weight integers and int32 biases answer to the float layers.

    prepared = prepare(capture(model, args), quantizer)
    calibrate(prepared, data)
    ref = refine(prepared, convert(prepared), data, Refine(seconds=60))

Between convert and lower: convert rounds each weight to its nearest grid point on its own;
``refine`` re-chooses the integers of each linear and 1-d or 2-d convolution layer (a grouped
one group by group), and of each whole-mode recurrent layer's ``W_ih`` and ``W_hh``
(``recurrent.py``), against that float layer's output on the inputs the quantized graph gives
it (``rounding.py``), then moves its int32 bias by the mean output shift left over (empirical
bias correction). The float weights come from the prepared model (convert keeps only their
integers); node names match between the two. Scales, zero points and the graph stay as they
were, so lowering, saving and export take the result like any reference graph. The caller's
graphs are not changed; layers are refined in graph order until the time budget runs out, and
the result says in ``meta[REFINED_KEY]`` what each layer gained.
"""

from __future__ import annotations

import copy
import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from quantree.core.calibrate import as_args
from quantree.core.errors import QuantreeError
from quantree.core.observing.grouped import GROUP_SIZE_KEY
from quantree.core.refining.recurrent import RECURRENT, RecurrentInputs
from quantree.core.refining.rounding import output_error, round_against_output
from quantree.core.refining.statistics import InputMoments
from quantree.core.stages import CONVERTED, PREPARED, STAGE_KEY

REFINED_KEY = "quantree_refined"
"""``meta`` key of a refined graph: a tuple of :class:`RefinedLayer`, in graph order."""

ROWS_PER_COLUMN = 4
"""Rounding against the output needs this many input rows per weight column: with fewer,
``X^T X`` is nearly singular and the integers fit the calibration's few rows, not new ones
(bias correction still runs; it moves a bias only where the mean shift exceeds twice its
standard error over the rows seen)."""

_ops = torch.ops
DEQUANTIZE = {
    _ops.quantized_decomposed.dequantize_per_channel.default,
    _ops.quantized_decomposed.dequantize_per_tensor.default,
}
LAYERS = {_ops.aten.linear.default, _ops.aten.conv2d.default, _ops.aten.conv1d.default}
CONVOLUTIONS = {_ops.aten.conv2d.default, _ops.aten.conv1d.default}


@dataclass(frozen=True)
class Refine:
    """What ``refine`` does: ``rounding`` (weights' integers against the float layer's
    output), ``bias_correction`` (the mean output shift moved into the int32 bias), and
    ``seconds``, a budget after which the remaining layers keep convert's integers."""

    rounding: bool = True
    bias_correction: bool = True
    seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("rounding", "bias_correction"):
            if not isinstance(getattr(self, name), bool):
                raise QuantreeError(f"Refine.{name} must be True or False")
        if self.seconds is not None and not self.seconds > 0:
            raise QuantreeError(f"Refine.seconds must be positive or None, got {self.seconds}")


@dataclass(frozen=True)
class RefinedLayer:
    """One layer's outcome: output error (summed squares over calibration) before and after."""

    node: str
    error_before: float
    error_after: float
    rounded: bool
    bias_corrected: bool
    skipped: str = ""  # why a layer was left as convert made it


@dataclass
class _Layer:
    label: str  # the node's name; a recurrent matrix's adds which ("lstm w_hh dir 0")
    node: fx.Node
    weight: fx.Node  # the dequantize of the integer weight
    bias: fx.Node | None  # the dequantize of the int32 bias, or a float bias convert kept
    float_weight: torch.Tensor
    conv: tuple[list[int], list[int], list[int], list[int]] | None
    key: str = ""  # a recurrent matrix's input in its op's ``RecurrentInputs``
    groups: int = 1  # a grouped convolution's: each group's rows are rounded on their own


def refine(
    prepared: fx.GraphModule,
    reference: fx.GraphModule,
    calibration: Iterable[Any],
    options: Refine | None = None,
) -> fx.GraphModule:
    """A copy of ``reference`` (``convert(prepared)``) with refined weights and biases."""
    options = options or Refine()
    if not isinstance(options, Refine):
        raise QuantreeError(f"options must be a quantree.Refine, got {type(options).__name__}")
    if reference.meta.get(STAGE_KEY) != CONVERTED or prepared.meta.get(STAGE_KEY) != PREPARED:
        raise QuantreeError(
            "refine takes the calibrated prepared model and convert's output of it: "
            "refine(prepared, convert(prepared), calibration)"
        )
    start = time.monotonic()
    layers, skipped = _layers(prepared, reference)
    moments = _input_moments(reference, layers, calibration)
    result = copy.deepcopy(reference)
    report = list(skipped)
    for layer in layers:
        stats = moments[layer.label]
        if stats.gram is None:
            report.append(RefinedLayer(layer.label, 0.0, 0.0, False, False, "never ran"))
            continue
        if options.seconds is not None and time.monotonic() - start > options.seconds:
            report.append(RefinedLayer(layer.label, 0.0, 0.0, False, False, "time budget"))
            continue
        report.append(_refine_layer(result, layer, stats, options))
    result.meta[REFINED_KEY] = tuple(report)
    return result


def _attr(gm: torch.nn.Module, target: str) -> torch.Tensor:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _set_attr(gm: torch.nn.Module, target: str, value: torch.Tensor) -> None:
    *path, name = target.split(".")
    owner: Any = gm
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, name, value)


def _integer_constant(node: Any) -> bool:
    """A dequantize of a get_attr that only it reads (a tied weight is left alone)."""
    return (
        isinstance(node, fx.Node)
        and node.target in DEQUANTIZE
        and isinstance(node.args[0], fx.Node)
        and node.args[0].op == "get_attr"
        and len(node.args[0].users) == 1
        and len(node.users) == 1
    )


def _bias(node: Any) -> fx.Node | None:
    """A bias refine may move: an integer or float constant (a too-wide bias) of its own."""
    own_float = isinstance(node, fx.Node) and node.op == "get_attr" and len(node.users) == 1
    return node if _integer_constant(node) or own_float else None  # type: ignore[no-any-return]


def _layers(
    prepared: fx.GraphModule, reference: fx.GraphModule
) -> tuple[list[_Layer], list[RefinedLayer]]:
    by_name = {n.name: n for n in prepared.graph.nodes}
    layers, skipped = [], []
    for node in reference.graph.nodes:
        if node.op == "call_function" and node.target in RECURRENT:
            found, reason = _recurrent_layers(prepared, node, by_name.get(node.name))
            layers += found
            if reason:
                skipped.append(RefinedLayer(node.name, 0.0, 0.0, False, False, reason))
            continue
        if node.op != "call_function" or node.target not in LAYERS:
            continue
        weight = node.args[1] if len(node.args) > 1 else None
        bias = node.args[2] if len(node.args) > 2 else None
        twin = by_name.get(node.name)
        source = twin.args[1] if twin is not None and len(twin.args) > 1 else None
        reason = ""
        if not _integer_constant(weight):
            reason = "weight not an integer constant of its own"
        elif not (isinstance(source, fx.Node) and source.op == "get_attr"):
            reason = "no float weight in the prepared model"
        elif (
            isinstance(weight, fx.Node)
            and weight.target == _ops.quantized_decomposed.dequantize_per_channel.default
            and weight.args[3] != 0
        ):
            reason = "per-channel axis is not the output channel"
        if reason:
            skipped.append(RefinedLayer(node.name, 0.0, 0.0, False, False, reason))
            continue
        assert isinstance(weight, fx.Node) and isinstance(source, fx.Node)
        conv, groups = None, 1
        if node.target in CONVOLUTIONS:
            groups = int(node.args[6]) if len(node.args) > 6 else 1  # type: ignore[arg-type]
            shape = node.args[1].meta["val"].shape if "val" in node.args[1].meta else None
            w = _attr(prepared, str(source.target))
            kernel = list(shape[2:] if shape is not None else w.shape[2:])
            args = list(node.args) + [None] * (7 - len(node.args))
            one = len(kernel) == 1  # a 1-d convolution: the 2-d one of height 1
            conv = (
                [1, *kernel] if one else kernel,
                [1, *(args[3] or [1])] if one else list(args[3] or [1, 1]),
                [0, *(args[4] or [0])] if one else list(args[4] or [0, 0]),
                [1, *(args[5] or [1])] if one else list(args[5] or [1, 1]),
            )
        layers.append(
            _Layer(
                node.name,
                node,
                weight,
                _bias(bias),
                _attr(prepared, str(source.target)).detach(),
                conv,
                groups=groups,
            )
        )
    return layers, skipped


def _input_moments(
    reference: fx.GraphModule, layers: list[_Layer], calibration: Iterable[Any]
) -> dict[str, InputMoments]:
    """Run a copy of ``reference`` with a recorder before each layer's input."""
    probe = copy.deepcopy(reference)
    _fold_constant_dequantizes(probe)
    found = {n.name: n for n in probe.graph.nodes}
    moments: dict[str, InputMoments] = {}
    recurrent: dict[str, RecurrentInputs] = {}
    for layer in layers:
        node = found[layer.node.name]
        name = f"_refine_moments_{len(moments)}"
        if layer.key:
            if node.name not in recurrent:
                recurrent[node.name] = _record_recurrent(probe, node, name)
            moments[layer.label] = recurrent[node.name].moments[layer.key]
            continue
        recorder = InputMoments(layer.conv, layer.groups)
        probe.add_module(name, recorder)
        with probe.graph.inserting_before(node):
            recorded = probe.graph.call_module(name, (node.args[0],))
        node.args = (recorded, *node.args[1:])
        moments[layer.label] = recorder
    probe.recompile()
    with torch.no_grad():
        for batch in calibration:
            probe(*as_args(batch))
    return moments


def _fold_constant_dequantizes(probe: fx.GraphModule) -> None:
    """Each dequantize of a constant in ``probe`` replaced by its float result, computed once:
    the probe runs every calibration batch, and dequantizing each weight and table again per
    batch was most of its time on a transformer (a token table is the largest constant)."""
    for node in list(probe.graph.nodes):
        if node.op != "call_function" or node.target not in DEQUANTIZE:
            continue
        inputs = [a for a in node.args if isinstance(a, fx.Node)]
        if not inputs or any(a.op != "get_attr" for a in inputs):
            continue
        args = [_attr(probe, str(a.target)) if isinstance(a, fx.Node) else a for a in node.args]
        name = f"_refine_constant_{node.name}"
        probe.register_buffer(name, node.target(*args, **node.kwargs))
        with probe.graph.inserting_before(node):
            node.replace_all_uses_with(probe.graph.get_attr(name))
        probe.graph.erase_node(node)
    probe.graph.eliminate_dead_code()


def _quantized(
    gm: fx.GraphModule, dq: fx.Node
) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(buffer target, integers, scale, zero point, qmin, qmax) of a dequantize node."""
    target = str(dq.args[0].target)  # type: ignore[union-attr]
    if dq.target == _ops.quantized_decomposed.dequantize_per_channel.default:
        scale, zp = (
            a if not isinstance(a, fx.Node) else _attr(gm, str(a.target)) for a in dq.args[1:3]
        )
        qmin, qmax = int(dq.args[4]), int(dq.args[5])  # type: ignore[arg-type]
    else:
        scale, zp = (
            a if not isinstance(a, fx.Node) else _attr(gm, str(a.target)) for a in dq.args[1:3]
        )
        qmin, qmax = int(dq.args[3]), int(dq.args[4])  # type: ignore[arg-type]
    return target, _attr(gm, target), torch.as_tensor(scale), torch.as_tensor(zp), qmin, qmax


def _refine_layer(
    result: fx.GraphModule, layer: _Layer, stats: InputMoments, options: Refine
) -> RefinedLayer:
    assert stats.gram is not None
    target, ints, scale, zp, qmin, qmax = _quantized(result, layer.weight)
    out = ints.shape[0]
    w_float = layer.float_weight.reshape(out, -1).double()
    s = scale.double().reshape(-1, 1).expand(out, 1)
    z = zp.double().reshape(-1, 1).expand(out, 1)
    q = ints.reshape(out, -1).double()
    # (rows of the weight, their input's x^T x, its mean): one block, or one per group of a
    # grouped convolution (its output channels read only their group's input channels)
    grams = stats.gram.reshape(-1, w_float.shape[1], w_float.shape[1])
    per = out // grams.shape[0]
    blocks = [
        (slice(g * per, (g + 1) * per), grams[g], stats.mean.reshape(grams.shape[0], -1)[g])
        for g in range(grams.shape[0])
    ]

    def error(ints: torch.Tensor) -> float:
        delta = w_float - (ints - z) * s
        return sum(output_error(delta[rows], gram) for rows, gram, _ in blocks)

    before = error(q)
    rounded = options.rounding and stats.rows >= ROWS_PER_COLUMN * w_float.shape[1]
    if rounded:
        group = layer.weight.args[0].meta.get(GROUP_SIZE_KEY)  # type: ignore[union-attr]
        q = q.clone()
        for rows, gram, _ in blocks:
            q[rows] = round_against_output(w_float[rows], s[rows], z[rows], qmin, qmax, gram, group)
        _set_attr(result, target, q.reshape(ints.shape).to(ints.dtype))
    after = error(q)
    corrected = False
    if options.bias_correction and layer.bias is not None:
        delta = w_float - (q - z) * s
        shift = torch.zeros(out, dtype=torch.float64)
        spread = torch.zeros(out, dtype=torch.float64)
        for rows, gram, mean in blocks:
            shift[rows] = delta[rows] @ mean  # float output minus quantized, on average
            covariance = gram / stats.rows - torch.outer(mean, mean)
            spread[rows] = ((delta[rows] @ covariance) * delta[rows]).sum(1).clamp(min=0.0)
        spread = spread / stats.rows
        shift = torch.where(shift.abs() > 2 * spread.sqrt(), shift, torch.zeros_like(shift))
        _move_bias(result, layer.bias, shift)
        corrected = True
    return RefinedLayer(layer.label, before, after, rounded, corrected)


def _move_bias(result: fx.GraphModule, bias: fx.Node, shift: torch.Tensor) -> None:
    """``shift`` added to the bias: in float, or on its grid in the channels it keeps in range."""
    if bias.op == "get_attr":
        _attr(result, str(bias.target)).data.add_(shift.reshape(-1).float())
        return
    b_target, b_ints, b_scale, _, b_min, b_max = _quantized(result, bias)
    moved = b_ints.double() + torch.round(shift / b_scale.double())
    moved = torch.where((moved >= b_min) & (moved <= b_max), moved, b_ints.double())
    _set_attr(result, b_target, moved.to(b_ints.dtype))


def _recurrent_layers(
    prepared: fx.GraphModule, node: fx.Node, twin: fx.Node | None
) -> tuple[list[_Layer], str]:
    """One entry per weight matrix of a single-layer recurrent op (see ``recurrent.py``)."""
    args = list(node.args)
    has_biases, layers_count, bidirectional = args[3], args[4], args[7]
    if layers_count != 1 or twin is None:
        return [], "stacked recurrent call kept whole" if twin is not None else "no float op"
    per_direction = 4 if has_biases else 2
    params, floats = list(args[2]), list(twin.args[2])  # type: ignore[arg-type]
    found: list[_Layer] = []
    for d in range(2 if bidirectional else 1):
        chunk = params[d * per_direction : (d + 1) * per_direction]
        sources = floats[d * per_direction : (d + 1) * per_direction]
        for i, which in enumerate(("ih", "hh")):
            weight, source = chunk[i], sources[i]
            bias = chunk[2 + i] if has_biases else None
            if node.target == _ops.aten.gru.input and which == "hh":
                bias = None  # scaled by the reset gate: not an additive shift
            if not _integer_constant(weight) or not (
                isinstance(source, fx.Node) and source.op == "get_attr"
            ):
                continue
            found.append(
                _Layer(
                    f"{node.name} w_{which} dir {d}",
                    node,
                    weight,
                    _bias(bias),
                    _attr(prepared, str(source.target)).detach(),
                    None,
                    "ih" if which == "ih" else f"hh{d}",
                )
            )
    return found, ""


def _record_recurrent(probe: fx.GraphModule, node: fx.Node, name: str) -> RecurrentInputs:
    """A ``RecurrentInputs`` after ``node`` in ``probe``, fed its input, h0 and output."""
    args = list(node.args)
    hx = args[1]
    h0 = hx[0] if isinstance(hx, list | tuple) else hx
    recorder = RecurrentInputs(bool(args[8]), 2 if args[7] else 1)
    probe.add_module(name, recorder)
    with probe.graph.inserting_after(node):
        out = probe.graph.call_function(operator.getitem, (node, 0))
    with probe.graph.inserting_after(out):
        probe.graph.call_module(name, (args[0], h0, out))
    return recorder
