"""How the built-in recipes quantize the named points of cell bodies.

Every Value of a cell body is quantized once, where it is produced; the elementwise gate
arithmetic reads its inputs as they are (no input specs), so an int16 gate output reaches the
cell update without being squeezed through int8 on the way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.fx as fx

from quantree.errors import QuantreeError
from quantree.points import CellsOptions, Point
from quantree.quantizer import Annotation, Rule
from quantree.specs import FixedSpec, QDtype, QuantSpec, SharedSpec, Spec
from quantree.values import Value

aten = torch.ops.aten

RECURRENT_OPS = (aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input)


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


def cells_rules(
    act: QuantSpec,
    weight: QuantSpec,
    cell_state: QuantSpec,
    gate_dtype: QDtype,
    options: CellsOptions,
    points: Mapping[str, Spec],
    scope: str | None = None,
) -> tuple[Rule, ...]:
    """Decompose recurrent layers (under ``scope``) into cells and annotate their points.

    ``points`` pins specs by point name (``{"cell": FixedSpec(2**-11, 0, QDtype.INT16)}``).
    """

    def output(spec: Spec) -> Callable[[fx.Node], Annotation]:
        return lambda node: Annotation(outputs=spec, name=node.name)

    def carried(name: str) -> Callable[[fx.Node], Annotation]:
        """A step's incoming state shares its parameters with the state the step produces."""
        return lambda node: Annotation(
            outputs=SharedSpec(Value(_point_node(node.graph, name))), name=node.name
        )

    sigmoid, tanh = fixed_sigmoid(gate_dtype), fixed_tanh(gate_dtype)
    gate_pre = (
        "gates",
        "i_pre",
        "f_pre",
        "g_pre",
        "o_pre",
        "reset_pre",
        "update_pre",
        "candidate_pre",
        "pre",
    )
    by_point: dict[str, Spec] = {
        "x": act,
        **dict.fromkeys(gate_pre, act),
        **dict.fromkeys(("i", "f", "o", "reset", "update"), sigmoid),
        **dict.fromkeys(("g", "cell_tanh", "candidate"), tanh),
        **dict.fromkeys(("forget_cell", "input_cell", "cell"), cell_state),
        **dict.fromkeys(
            ("candidate_hidden", "hidden_delta", "update_hidden", "hidden_unprojected"), act
        ),
    }
    by_point.update({k: v for k, v in points.items() if k != "hidden"})
    rules = [
        Rule(RECURRENT_OPS, lambda node: Annotation(cells=options), scope),
        Rule((Point("h_prev"),), carried("hidden"), scope),
        Rule((Point("c_prev"),), carried("cell"), scope),
        *(Rule((Point(name),), output(spec), scope) for name, spec in by_point.items()),
    ]
    rules.append(Rule((Point("hidden"),), _hidden_rule(act, weight, points.get("hidden")), scope))
    return tuple(rules)


def _hidden_rule(
    act: QuantSpec, weight: QuantSpec, pinned: Spec | None
) -> Callable[[fx.Node], Annotation]:
    """``hidden`` is o * tanh(c), a projection (proj_size), or an RNN's tanh/relu."""

    def annotate(node: fx.Node) -> Annotation:
        if node.target is aten.linear.default:
            return Annotation(
                outputs=pinned or act, inputs={(0,): act, (1,): weight}, name=node.name
            )
        if node.target is aten.tanh.default and pinned is None:
            return Annotation(outputs=fixed_tanh(act.dtype), name=node.name)
        return Annotation(outputs=pinned or act, name=node.name)

    return annotate
