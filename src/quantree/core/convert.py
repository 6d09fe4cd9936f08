"""convert: turn an observed graph into the reference quantize/dequantize graph.

The output uses ``torch.ops.quantized_decomposed`` q/dq ops (the representation Inductor and
ExecuTorch read). Every quantized Value gets ``quantize -> dequantize`` right after the leaf
that carries it; a Use whose group differs from its Value's is requantized on its edge.
Constant inputs (weights, biases) are quantized now and stored as integer buffers followed
by a dequantize, so the model's weights take a quarter of their float bytes.
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

import torch
import torch.fx as fx

from quantree.core.errors import QuantreeError, QuantreeWarning
from quantree.core.graphs import (
    copy_graph_module,
    drop_attr,
    fetch_attr,
    nested_graphs,
    register_constant,
    replace_submodule,
)
from quantree.core.grouping.group_params import (
    check_calibrated,
    describe_unobserved,
    resolve_params,
    unobserved_groups,
    vanishing_groups,
    with_dependents,
)
from quantree.core.grouping.overflow import describe_overflow, kept_float_warning, overflow
from quantree.core.grouping.sharing import Group
from quantree.core.normalizing.fold import own_written_state
from quantree.core.observing.grouped import GROUP_SIZE_KEY
from quantree.core.observing.qparams import SCALE_FLOOR, per_channel_mismatch
from quantree.core.qdq import (
    DEQUANTIZE_PER_CHANNEL,
    DEQUANTIZE_PER_TENSOR,
    QUANTIZE_PER_CHANNEL,
    QUANTIZE_PER_TENSOR,
    quantize_tensor,
)
from quantree.core.specs import Derivation, QDtype, QParams
from quantree.core.stages import (
    CONVERTED,
    DEQUANTIZED_GROUP_KEY,
    FOLDED_FROM_KEY,
    GROUPS_KEY,
    OBSERVER_KEY,
    PREPARED,
    STAGE_KEY,
    TRAINED_KEY,
    NodeQuant,
    node_quant,
    require_stage,
)
from quantree.core.training.qat import as_prepared, is_qat
from quantree.core.values import Path, Use, Value, arg_at, input_uses, value_carriers


class Unobserved(enum.Enum):
    """What convert does with tensors calibration ran past but never observed.

    ERROR raises a QuantreeError naming them (the default: feed data that reaches them);
    FLOAT leaves them, and what derives from them (a bias), in float with one warning.
    """

    ERROR = "error"
    FLOAT = "float"


class _Rewriter:
    """Inserts q/dq nodes, caching one pair per (source node, group)."""

    def __init__(
        self, gm: fx.GraphModule, params: dict[int, QParams], groups: dict[int, Group]
    ) -> None:
        self.gm = gm
        self.params = params
        self.groups = groups
        self.cache: dict[tuple[fx.Node, int], fx.Node] = {}
        self.kept_float: list[str] = []  # derived constants that would not fit: see below

    def _qparam_args(self, p: QParams, after: fx.Node) -> tuple[tuple[Any, ...], fx.Node]:
        """Scale/zero-point arguments; per-channel ones become buffers read after ``after``."""
        if p.axis is None:
            return (float(p.scale), int(p.zero_point)), after
        graph = self.gm.graph
        with graph.inserting_after(after):
            scale = graph.get_attr(register_constant(self.gm, "_scale_", p.scale.float()))
        with graph.inserting_after(scale):
            zp = graph.get_attr(
                register_constant(self.gm, "_zero_point_", p.zero_point.to(torch.int32))
            )
        return (scale, zp, p.axis), zp

    def dequantized(self, source: fx.Node, gid: int) -> fx.Node:
        """``source`` quantized with group ``gid``'s parameters, then dequantized (cached)."""
        key = (source, gid)
        if key in self.cache:
            return self.cache[key]
        p = self.params[gid]
        _check_fits(p, source, self.groups[gid])
        if source.op == "get_attr" and isinstance(self.groups[gid].spec, Derivation):
            too_wide = self._too_wide(source, p, gid)
            if too_wide:  # kept float: the q op would clamp it (``grouping/overflow.py``)
                self.kept_float.append(too_wide)
                self.cache[key] = source
                return source
        graph = self.gm.graph
        bounds = (p.quant_min, p.quant_max, p.dtype.torch_dtype)
        q_op, dq_op = (
            (QUANTIZE_PER_TENSOR, DEQUANTIZE_PER_TENSOR)
            if p.axis is None
            else (QUANTIZE_PER_CHANNEL, DEQUANTIZE_PER_CHANNEL)
        )
        qargs, last = self._qparam_args(p, source)
        with graph.inserting_after(last):
            if source.op == "get_attr":  # fold: store the integer tensor itself
                stored = quantize_tensor(fetch_attr(self.gm, str(source.target)), p)
                quantized = graph.get_attr(register_constant(self.gm, "_quantized_", stored))
                quantized.meta["val"] = stored
                if p.group_size is not None:
                    quantized.meta[GROUP_SIZE_KEY] = p.group_size
                if p.dtype == QDtype.INT32:
                    quantized.meta[FOLDED_FROM_KEY] = fetch_attr(self.gm, str(source.target))
            else:
                quantized = graph.call_function(q_op, (source, *qargs, *bounds))
        with graph.inserting_after(quantized):
            dequantized = graph.call_function(
                dq_op, (quantized, *qargs, *bounds), {"out_dtype": torch.float32}
            )
        dequantized.meta["val"] = source.meta.get("val")
        dequantized.meta[DEQUANTIZED_GROUP_KEY] = gid
        self.cache[key] = dequantized
        return dequantized

    def _too_wide(self, source: fx.Node, p: QParams, gid: int) -> str:
        """Why the derived constant ``source`` cannot take ``p``'s integers, or ''."""
        found = overflow(fetch_attr(self.gm, str(source.target)), p)
        if found is None:
            return ""
        return describe_overflow(source, found, p, self.groups[gid].label)


def _check_fits(p: QParams, source: fx.Node, group: Group) -> None:
    """Per-channel parameters match the tensor they quantize (derived ones come from code)."""
    val = source.meta.get("val")
    if p.axis is None or not isinstance(val, torch.Tensor):
        return
    problem = per_channel_mismatch(p.axis, p.scale.numel(), tuple(val.shape))
    if problem is not None:
        raise QuantreeError(
            f"node {source.name} ({source.target}): per-channel parameters of {group.label}: "
            f"{problem}; a derived spec must give parameters for the tensor it "
            "quantizes (a bias is 1-D: axis 0, one scale per output channel), and its sources "
            "must have that many channels"
        )


def _set_at(obj: Any, path: Path, new: Any) -> Any:
    if not path:
        return new
    head, *rest = path
    if isinstance(obj, dict):
        return {**obj, head: _set_at(obj[head], tuple(rest), new)}
    items = list(obj)
    items[head] = _set_at(items[head], tuple(rest), new)  # type: ignore[index]
    return type(obj)(items) if isinstance(obj, tuple) else items


def convert(
    prepared: fx.GraphModule, *, unobserved: Unobserved = Unobserved.ERROR
) -> fx.GraphModule:
    """The reference q/dq graph for a calibrated prepared model (``prepared`` is kept).

    Groups whose calibrated range vanished are named in one QuantreeWarning: their tensors
    convert to a constant, which calibration data that never exercised them is the likely
    cause of.
    """
    if not isinstance(unobserved, Unobserved):
        raise QuantreeError(f"unobserved must be a quantree.Unobserved, got {unobserved!r}")
    trained = is_qat(prepared)
    if trained:  # the learned parameters stand where the observers stood
        prepared = as_prepared(prepared)
    floated: list[str] = []
    kept_float: list[str] = []
    gm, vanishing = _convert(
        prepared, floated if unobserved is Unobserved.FLOAT else None, kept_float
    )
    if kept_float:
        warnings.warn(kept_float_warning(kept_float), QuantreeWarning, stacklevel=2)
    if floated:
        warnings.warn(
            f"quantree left in float what calibration never observed: {'; '.join(floated)}",
            QuantreeWarning,
            stacklevel=2,
        )
    if vanishing:
        shown = "; ".join(vanishing[:10])
        more = f"; and {len(vanishing) - 10} more" if len(vanishing) > 10 else ""
        warnings.warn(
            f"quantree: calibration gave {len(vanishing)} group(s) a zero or vanishing range, "
            f"so their scale is the floor {SCALE_FLOOR:.3g} and every value they hold converts "
            f"to the zero point: {shown}{more}. Calibrate with representative data: inputs "
            "that exercise these tensors (all-zero inputs, a ReLU that never fires or "
            "activations below the scale floor give this)",
            QuantreeWarning,
            stacklevel=2,
        )
    if trained:
        gm.meta[TRAINED_KEY] = True
    return gm


def _convert(
    prepared: fx.GraphModule, floated: list[str] | None = None, kept_float: list[str] | None = None
) -> tuple[fx.GraphModule, list[str]]:
    """convert, and the labels of the groups whose calibrated scale is at the floor.

    With ``floated`` (a list), unobserved groups stay float and are described in it.
    Derived constants kept float because they would not fit are described in ``kept_float``.
    """
    groups = require_stage(
        prepared,
        PREPARED,
        "convert",
        "the output of quantree.prepare",
        "prepare and calibrate the captured graph, then convert that",
    )
    drop: set[int] = set()
    missing = unobserved_groups(prepared, groups) if floated is not None else []
    if floated is not None and missing:
        drop = with_dependents({g.id for g in missing}, groups)
        floated.append(describe_unobserved(prepared, missing))
    else:
        check_calibrated(prepared, groups)
    gm = own_written_state(copy_graph_module(prepared))
    vanishing = _convert_nested(gm, floated, kept_float)
    observers = [g.observer for g in groups.values() if g.observer is not None]
    groups = {gid: g for gid, g in groups.items() if gid not in drop}
    params = resolve_params(groups, gm)
    graph = gm.graph
    vanishing += vanishing_groups(graph, groups, params, gm)
    for node in list(graph.nodes):
        if OBSERVER_KEY in node.meta:
            graph.erase_node(node)
    for observer in observers:
        delattr(gm, observer)

    value_group: dict[Value, int] = {}
    for node in graph.nodes:
        info = node_quant(node)
        if info is not None:
            value_group.update(
                {Value(node, p): g for p, g in info.output_groups.items() if g not in drop}
            )
    rewriter = _Rewriter(gm, params, groups)
    if kept_float is not None:
        rewriter.kept_float = kept_float
    for node in list(graph.nodes):
        info = node_quant(node)
        for use in list(input_uses(node)):
            _rewire(node, use, info, value_group, rewriter)
    # Every Value that has a group is quantized even when nobody reads it (a dropped h_n).
    carriers = value_carriers(graph)
    for value, gid in value_group.items():
        rewriter.dequantized(carriers[value], gid)

    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
            drop_attr(gm, str(node.target))
    gm.meta[STAGE_KEY] = CONVERTED
    gm.meta[GROUPS_KEY] = {
        gid: Group(g.id, g.spec, g.members, None, g.derived_from, params[gid])
        for gid, g in groups.items()
    }
    graph.lint()
    gm.recompile()
    return gm, vanishing


def _convert_nested(
    gm: fx.GraphModule, floated: list[str] | None, kept_float: list[str] | None
) -> list[str]:
    """Convert each prepared graph nested in ``gm``'s modules, on a private path to it."""
    vanishing: list[str] = []
    for name, body in nested_graphs(gm).items():
        if body.meta.get(STAGE_KEY) == PREPARED:
            converted, inner = _convert(body, floated, kept_float)
            replace_submodule(gm, name, converted)
            vanishing += [f"{name} {label}" for label in inner]
    return vanishing


def _rewire(
    user: fx.Node,
    use: Use,
    info: NodeQuant | None,
    value_group: dict[Value, int],
    rewriter: _Rewriter,
) -> None:
    source = arg_at(user, use.arg_path)
    assert isinstance(source, fx.Node)
    if source.meta.get(DEQUANTIZED_GROUP_KEY) is not None:
        return  # already reads a dequantize this pass inserted
    vg = value_group.get(use.value)
    ug = info.input_groups.get(use.arg_path) if info is not None else None
    ug = ug if ug in rewriter.params else None  # a group left in float
    if vg is None and ug is None:
        return
    new = source if vg is None else rewriter.dequantized(source, vg)
    if ug is not None and ug != vg:
        new = rewriter.dequantized(new, ug)
    head, *rest = use.arg_path
    if isinstance(head, str):
        user.kwargs = {**user.kwargs, head: _set_at(user.kwargs[head], tuple(rest), new)}
    else:
        user.args = _set_at(user.args, use.arg_path, new)
