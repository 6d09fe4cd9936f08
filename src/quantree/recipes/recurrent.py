"""How the built-in recipes quantize the named points of cell bodies.

Every Value of a cell body is quantized once, where it is produced; the elementwise gate
arithmetic reads its inputs as they are (no input specs), so an int16 gate output reaches the
cell update without being squeezed through int8 on the way.
"""

from __future__ import annotations

import collections
import operator
import warnings
import weakref
from collections.abc import Callable, Mapping

import torch
import torch.fx as fx

from quantree.core.errors import QuantreeError, QuantreeWarning
from quantree.core.points import Point
from quantree.core.quantizer import Annotation, Rule
from quantree.core.specs import FixedSpec, QDtype, QuantSpec, SharedSpec, Spec
from quantree.core.values import Value, tensor_meta
from quantree.recipes.weighted import weighted_annotation
from quantree.recurrent.call import CELL_OPS, RECURRENT_OPS
from quantree.recurrent.cell_graph import point_names
from quantree.recurrent.decompose import CellsOptions
from quantree.recurrent.loop import RecurrentCells
from quantree.recurrent.state_observer import state_spec
from quantree.recurrent.whole import recurrent_cell_annotation

aten = torch.ops.aten


def fixed_sigmoid(dtype: QDtype) -> FixedSpec:
    """Parameters covering [0, 1) exactly for a dtype."""
    specs = {
        QDtype.INT8: FixedSpec(1.0 / 256.0, -128, QDtype.INT8),
        QDtype.UINT8: FixedSpec(1.0 / 256.0, 0, QDtype.UINT8),
        QDtype.INT16: FixedSpec(2.0**-15, 0, QDtype.INT16),
    }
    return _pick(specs, dtype, "sigmoid")


def fixed_tanh(dtype: QDtype) -> FixedSpec:
    """Parameters covering [-1, 1) exactly for a dtype."""
    specs = {
        QDtype.INT8: FixedSpec(1.0 / 128.0, 0, QDtype.INT8),
        QDtype.UINT8: FixedSpec(1.0 / 128.0, 128, QDtype.UINT8),
        QDtype.INT16: FixedSpec(2.0**-15, 0, QDtype.INT16),
    }
    return _pick(specs, dtype, "tanh")


def _pick(specs: dict[QDtype, FixedSpec], dtype: QDtype, what: str) -> FixedSpec:
    if dtype not in specs:
        raise QuantreeError(f"no fixed {what} parameters for {dtype.value}; use int8/uint8/int16")
    return specs[dtype]


def _point_node(graph: fx.Graph, name: str) -> fx.Node:
    for node in graph.nodes:
        if node.name == name:
            return node
    raise QuantreeError(f"cell body has no point named {name!r}")


SPLITS = ("gates_split", "input_split", "hidden_split")
"""The chunks of fused projections: data movement, so their pieces keep the source's grid."""
FUSED_GATE_PRE = ("i_pre", "f_pre", "g_pre", "o_pre")


def cells_rules(
    act: QuantSpec,
    weight: QuantSpec,
    cell_state: QuantSpec,
    gate_dtype: QDtype,
    options: CellsOptions,
    points: Mapping[str, Spec],
    scope: str | None = None,
    sums: QuantSpec | None = None,
) -> tuple[Rule, ...]:
    """Decompose recurrent layers (under ``scope``) into cells and annotate their points.

    ``sums`` quantizes the sums inside a cell: the projections, the gate pre-activations and
    a GRU's candidate and update products (``act`` when None).

    ``points`` pins specs by point name (``{"cell": FixedSpec(2**-11, 0, QDtype.INT16)}``).
    A pinned projection keeps its int8 weight and int32 bias; a pinned ``gates`` carries to
    the four gate pre-activations unless they are pinned too.
    """
    known = point_names(options.split_gates)
    unknown = sorted(set(points) - known)
    if unknown:
        mode = "split_gates=True" if options.split_gates else "fused gates"
        raise QuantreeError(
            f"no cell point named {', '.join(map(repr, unknown))} with {mode}; "
            f"the points are: {', '.join(sorted(known))}"
        )

    def output(spec: Spec | None) -> Callable[[fx.Node], Annotation]:
        def annotate(node: fx.Node) -> Annotation:
            if node.target is aten.linear.default:
                return weighted_annotation(node, act, weight, spec, name=node.name)
            return Annotation(outputs=spec, name=node.name)

        return annotate

    def shared_with(name: str) -> Callable[[fx.Node], Annotation]:
        """Same parameters as point ``name`` (a carried state, a chunk of a pinned gates)."""
        return lambda node: Annotation(
            outputs=SharedSpec(Value(_point_node(node.graph, name))), name=node.name
        )

    def split(node: fx.Node) -> Annotation:
        """Each piece of a chunk carries exactly the parameters of what it splits."""
        source = node.args[0]
        assert isinstance(source, fx.Node)
        pieces = tuple(SharedSpec(Value(source)) for _ in tensor_meta(node))
        return Annotation(outputs=pieces, name=node.name)

    sigmoid, tanh = fixed_sigmoid(gate_dtype), fixed_tanh(gate_dtype)
    # tanh(c) of an int16 cell state stays 16-bit: squeezing it to 8 bits right away would
    # spend the cell state's precision (the integer-LSTM convention).
    cell_tanh = fixed_tanh(cell_state.dtype) if cell_state.dtype == QDtype.INT16 else tanh
    gate_pre = (*FUSED_GATE_PRE, "gates", "reset_pre", "update_pre", "candidate_pre", "pre")
    inner = sums or act
    projections = sorted(n for n in known if n.startswith(("input_proj", "hidden_proj")))
    by_point: dict[str, Spec] = {
        "x": act,
        **dict.fromkeys(gate_pre, inner),
        **dict.fromkeys(projections, inner),
        **dict.fromkeys(("i", "f", "o", "reset", "update"), sigmoid),
        **dict.fromkeys(("g", "candidate"), tanh),
        "cell_tanh": cell_tanh,
        # the cell state keeps the observer asked for (``state_observer``: its resolution)
        **dict.fromkeys(("forget_cell", "input_cell", "cell"), cell_state),
        **dict.fromkeys(("candidate_hidden", "hidden_delta", "update_hidden"), inner),
        "hidden_unprojected": act,
    }
    # ``h_prev`` has a grid of its own: at the first step it holds the initial state, which
    # may span far more than the (-1, 1) of the states the cell makes (an h0 ~ N(0, 1));
    # shared with ``hidden``, that range would set the grid of every output step too.
    # Each later step requantizes ``hidden`` onto it, as whole mode's kernel does. A pinned
    # ``hidden`` (a fixed integer-LSTM grid) is carried as it is.
    carried = {"c_prev": "cell"}
    if "hidden" in points:
        carried["h_prev"] = "hidden"
    else:
        by_point["h_prev"] = state_spec(act)
    if "gates" in points:
        carried |= dict.fromkeys(FUSED_GATE_PRE, "gates")
    carried = {name: source for name, source in carried.items() if name not in points}
    by_point.update({k: v for k, v in points.items() if k != "hidden"})
    rules = [
        Rule(RECURRENT_OPS, lambda node: Annotation(decompose=options), scope),
        Rule(CELL_OPS, _cell_op_stays_whole(act, weight), scope),
        Rule(tuple(Point(name) for name in SPLITS), split, scope),
        *(Rule((Point(name),), output(spec), scope) for name, spec in by_point.items()),
        *(Rule((Point(name),), shared_with(source), scope) for name, source in carried.items()),
    ]
    hidden = _hidden_rule(act, state_spec(act), weight, points.get("hidden"))
    rules.append(Rule((Point("hidden"),), hidden, scope))
    rules.append(
        Rule((operator.getitem,), _output_sequence(points.get("hidden") or state_spec(act)))
    )
    return tuple(rules)


def _output_sequence(spec: Spec) -> Callable[[fx.Node], Annotation | None]:
    """A one-direction cell loop's output sequence is its ``hidden`` states stacked, each on the
    ``hidden`` grid: calibrated as that point is (``state_observer``), the sequence's grid is
    the one its steps were on, and reading it adds no second rounding. Left to its reader's
    spec (a range search on a linear's input), it was requantized onto another grid, and a
    one-layer loop's output no longer matched its hidden state step for step."""

    def annotate(node: fx.Node) -> Annotation | None:
        loop, index = node.args[0], node.args[1]
        if not (isinstance(loop, fx.Node) and loop.op == "call_module" and index == 0):
            return None
        owner = node.graph.owning_module
        cells = owner.get_submodule(str(loop.target)) if owner is not None else None
        if not isinstance(cells, RecurrentCells) or cells.directions != 1:
            return None  # both directions side by side: two grids, neither the sequence's
        if all(user.op == "output" for user in node.users):
            return None  # returned as it is: nothing reads it on a grid
        return Annotation(outputs=spec, name=node.name)

    return annotate


def _cell_op_stays_whole(act: QuantSpec, weight: QuantSpec) -> Callable[[fx.Node], Annotation]:
    """``nn.LSTMCell`` & co. are quantized at their boundary in cells mode too: say so, since
    the cell points (int16 cell state, pinned gates) of the recipe do not reach them."""

    warned: weakref.WeakSet[fx.Graph] = weakref.WeakSet()  # one warning per graph

    def annotate(node: fx.Node) -> Annotation:
        if node.graph not in warned:
            warned.add(node.graph)
            targets = collections.Counter(
                str(n.target) for n in node.graph.nodes if n.target in CELL_OPS
            )
            calls = ", ".join(f"{t} x{k}" for t, k in sorted(targets.items()))
            warnings.warn(
                "cells mode decomposes nn.LSTM/GRU/RNN layers; nn.LSTMCell/GRUCell/RNNCell "
                f"calls ({calls}) are quantized at their boundary, without the cell points "
                "of the recipe",
                QuantreeWarning,
                stacklevel=2,
            )
        return recurrent_cell_annotation(node, act, weight)

    return annotate


def _hidden_rule(
    act: QuantSpec, state: QuantSpec, weight: QuantSpec, pinned: Spec | None
) -> Callable[[fx.Node], Annotation]:
    """``hidden`` is o * tanh(c), a projection (proj_size), or an RNN's tanh/relu; carried to
    the next step, it is calibrated as ``state`` (``state_observer``) unless ``pinned``."""

    def annotate(node: fx.Node) -> Annotation:
        if node.target is aten.linear.default:
            return weighted_annotation(node, act, weight, pinned or state, name=node.name)
        if node.target is aten.tanh.default and pinned is None:
            return Annotation(outputs=fixed_tanh(act.dtype), name=node.name)
        return Annotation(outputs=pinned or state, name=node.name)

    return annotate
