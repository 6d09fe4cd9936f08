"""Lowering rule for whole-mode LSTM / GRU / RNN layers onto ``torch.ops.quantree.rnn``.

Pattern: ``aten.lstm|gru|rnn_*`` whose input and initial states are read through int8
dequantize, whose weights are folded int8 and biases folded int32, and whose every used
output leaf is quantized. Inside, the kernel keeps the cell state in float. The hidden state
fed back each step is requantized: for the last layer on the range observed for its output
and the state (clipped to [-1, 1] where the state is bounded: LSTM, tanh RNN), to int8 by
default or int16 (``hidden_bits=16``: closer to the reference, at the cost of a second
byte plane); for the layers before the last, whose states were never
observed, as int16 on a bound that holds for any input (``_hidden_ranges``). Outputs passed
between stacked layers are quantized per call, as int16, on the range they took. The first
step reads the initial state on its own int8 grid, as the reference does. (``Int8Quantizer``
splits stacked calls per layer by default, so the inner int16 path serves
``split_layers=False`` and other recipes' graphs.)
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

from quantree.backends.cpu import ops  # noqa: F401  (registers torch.ops.quantree.*)
from quantree.backends.cpu.saved.derived import bias_recipe, derived_constant, packed_and_sums
from quantree.backends.patterns import (
    Activation,
    activation,
    float_constant,
    is_int8_per_tensor,
    mark_provenance,
    weight,
)
from quantree.core.errors import QuantreeError
from quantree.core.graphs import fetch_attr
from quantree.core.lower import LoweringContext, LoweringRule, Quantized
from quantree.core.qdq import DEQUANTIZE_PER_TENSOR, QUANTIZE_OPS, QUANTIZE_PER_TENSOR
from quantree.core.specs import QDtype, QParams
from quantree.core.stages import OUTPUT_GRID_KEY
from quantree.core.values import Path, arg_at
from quantree.recurrent.call import RECURRENT_OPS, RecurrentCall

aten = torch.ops.aten
# Kinds whose every computed hidden state lies in (-1, 1) whatever the initial state:
# LSTM h = o * tanh(c) and tanh RNN h = tanh(...). A GRU's h = (1 - z) * n + z * h_prev is
# a convex mix with the previous state, so an initial state outside [-1, 1] carries over.
BOUNDED = ("lstm", "rnn_tanh")
ZEROS = (aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default)


def inner_params(ranges: list[tuple[float, float]]) -> tuple[float, int]:
    """int8 affine (scale, zero point) covering every (low, high) range and zero."""
    lo = min(0.0, *(r[0] for r in ranges))
    hi = max(0.0, *(r[1] for r in ranges))
    scale = max(hi - lo, 1e-8) / 255.0
    zero_point = int(max(-128, min(127, round(-128 - lo / scale))))
    return scale, zero_point


def _hidden_ranges(
    ctx: LoweringContext,
    node: fx.Node,
    call: RecurrentCall,
    output: tuple[float, int, int],
    initial: tuple[float, int],
    returned: tuple[float, int] | None = None,
) -> list[tuple[float, float]]:
    """Ranges the grid of the layers before the last must cover: all their hidden states.

    The last layer's states are observed (its output) and so is the initial state; the
    states of the others were never observed, so their grid also covers a
    bound that holds for any input: |h| < 1 for an LSTM and a tanh RNN, max(1, |h0|) for a
    GRU (a convex mix of tanh and the previous state), the largest row L1 norm of W_hr for a
    projected LSTM (|o * tanh(c)| < 1). A stacked ReLU RNN has no such bound and is not
    lowered (``Int8Quantizer`` splits it per layer first: ``recurrent/split_layers.py``).
    """
    ranges = _observed_ranges(call, output, initial, returned)
    if call.num_layers == 1:
        return ranges
    projected = any(p.w_hr is not None for p in call.layers)
    if projected:
        bound = max(_projection_bound(ctx, node, p.w_hr) for p in call.layers if p.w_hr)
    elif call.kind == "gru":
        bound = max(1.0, *(abs(v) for v in _range(*initial)))
    else:
        bound = 1.0
    return [*ranges, (-bound, bound)]


def _observed_ranges(
    call: RecurrentCall,
    output: tuple[float, int, int],
    initial: tuple[float, int],
    returned: tuple[float, int] | None = None,
) -> list[tuple[float, float]]:
    """The last layer's hidden states: its observed output, the initial state and, when it
    has a grid of its own, the returned state (every layer's final state)."""
    ranges = [_range(*output), _range(*initial)]  # output: (scale, zero point, bits)
    if returned is not None:
        ranges.append(_range(*returned))
    projected = any(p.w_hr is not None for p in call.layers)
    if call.kind in BOUNDED and not projected:  # a wide initial state must not widen the grid
        ranges = [(max(lo, -1.0), min(hi, 1.0)) for lo, hi in ranges]
    return ranges


def _projection_bound(ctx: LoweringContext, node: fx.Node, path: Path) -> float:
    w_hr = weight(ctx, arg_at(node, path))
    assert w_hr is not None
    values = w_hr.values.float() * w_hr.scale.reshape(-1, 1)
    return float(values.abs().sum(1).max())


def _range(scale: float, zero_point: int, bits: int = 8) -> tuple[float, float]:
    low, high = (-32768, 32767) if bits == 16 else (-128, 127)
    return (low - zero_point) * scale, (high - zero_point) * scale


def is_int16_symmetric(p: QParams) -> bool:
    """A symmetric int16 per-tensor grid: what the kernel reads and writes as int16."""
    return (
        p.axis is None
        and p.dtype == QDtype.INT16
        and (p.quant_min, p.quant_max) == (-32768, 32767)
        and int(p.zero_point) == 0
    )


def _outputs(ctx: LoweringContext, node: fx.Node) -> dict[int, Quantized] | None:
    """The quantize of each output leaf; None if some used leaf is not int8-quantized."""
    found: dict[int, Quantized] = {}
    for user in node.users:
        if user.target is not operator.getitem:
            return None
        q = ctx.quantized_output(user)
        leaf = int(user.args[1])  # type: ignore[arg-type]
        # the output sequence may be int16 (the kernel writes it as float on that grid)
        if q is None or not (
            is_int8_per_tensor(q.params) or (leaf == 0 and is_int16_symmetric(q.params))
        ):
            return None
        found[leaf] = q
    return found if 0 in found else None


def _is_zeros(ctx: LoweringContext, state: Activation) -> bool:
    """Whether an initial state is all zeros: ``quantize(zeros)`` (what ``nn.LSTM`` without
    ``hx`` exports to), or a folded constant of zero points. Either dequantizes to exact
    zeros (a zero point is on the int8 grid), which is what the kernel starts from when it
    is given no state; the state's grid still sets the first step's arithmetic."""
    source = state.node
    if source.op == "get_attr":
        values = fetch_attr(ctx.gm, str(source.target))
        return bool((values == state.zero_point).all())
    if source.target not in QUANTIZE_OPS or not isinstance(source.args[0], fx.Node):
        return False
    made = source.args[0]
    return made.target in ZEROS


def _float_input(x: Activation, node: fx.Node) -> fx.Node | None:
    """The float tensor the layer's int8 input is quantized from, when that quantize and its
    dequantize exist for this layer alone: the kernel then quantizes it itself, on the same
    grid, and the graph makes one op call fewer."""
    q, dq = x.node, node.args[0]
    if q.target != QUANTIZE_PER_TENSOR or not isinstance(q.args[0], fx.Node):
        return None
    if list(q.users) != [dq] or not isinstance(dq, fx.Node) or list(dq.users) != [node]:
        return None
    same_grid = float(q.args[1]) == x.scale and int(q.args[2]) == x.zero_point  # type: ignore[arg-type]
    return q.args[0] if same_grid else None


def _int16_input(ctx: LoweringContext, node: fx.Node) -> tuple[fx.Node, float] | None:
    """The float tensor and the step of the layer's input when it is read through a
    symmetric int16 quantize and dequantize of its own: the kernel quantizes that float to
    int16 itself (two byte planes), on the same grid."""
    dq = ctx.dequantized(node.args[0])
    if dq is None or dq.is_constant or not is_int16_symmetric(dq.params):
        return None
    q = dq.source
    if q.target != QUANTIZE_PER_TENSOR or not isinstance(q.args[0], fx.Node):
        return None
    if list(q.users) != [dq.node] or list(dq.node.users) != [node]:
        return None
    if q.args[1:] != dq.node.args[1:]:
        return None
    return q.args[0], float(dq.params.scale)


def _float_readers(output: Quantized) -> list[fx.Node]:
    """The dequantizes reading the layer's output, when nothing else reads it, they
    dequantize on the grid it is quantized on and only the graph's outputs read them: the
    kernel then writes float, exactly what they compute. Any other reader of a dequantize
    may be an int8 kernel's pattern (a second LSTM, a linear), which must still find it."""
    q = output.node
    readers = list(q.users)
    if not readers or any(
        r.target != DEQUANTIZE_PER_TENSOR
        or r.args[1:] != q.args[1:]
        or r.kwargs.get("out_dtype", torch.float32) != torch.float32
        or any(u.op != "output" for u in r.users)
        for r in readers
    ):
        return []
    return readers


def _layer_params(
    ctx: LoweringContext,
    node: fx.Node,
    call: RecurrentCall,
) -> list[fx.Node] | None:
    params: list[fx.Node] = []
    for p in call.layers:
        w_ih, w_hh = weight(ctx, arg_at(node, p.w_ih)), weight(ctx, arg_at(node, p.w_hh))
        if w_ih is None or w_hh is None:
            return None
        n = w_ih.values.shape[0]
        b_ih = float_constant(ctx, None if p.b_ih is None else arg_at(node, p.b_ih), n)
        b_hh = float_constant(ctx, None if p.b_hh is None else arg_at(node, p.b_hh), n)
        if b_ih is None or b_hh is None:
            return None
        tensors = [
            *packed_and_sums(w_ih.values),
            w_ih.scale,
            b_ih,
            *packed_and_sums(w_hh.values),
            w_hh.scale,
            b_hh,
        ]
        if p.w_hr is not None:
            w_hr = weight(ctx, arg_at(node, p.w_hr))
            if w_hr is None:
                return None
            tensors += [*packed_and_sums(w_hr.values), w_hr.scale]
        # each call site's biases sit on its own input grid: saved as their recipe
        recipes = {
            i: None if path is None else bias_recipe(ctx, arg_at(node, path))
            for i, path in ((3, p.b_ih), (7, p.b_hh))
        }
        params += [
            derived_constant(ctx, f"_cpu_{call.kind}_", t, node, recipes.get(i))
            for i, t in enumerate(tensors)
        ]
    return params


def recurrent_rule(hidden_bits: int = 8) -> LoweringRule:
    """The rule, feeding the hidden state back as int8 (default) or int16."""
    if hidden_bits not in (8, 16):
        raise QuantreeError(f"hidden_bits must be 8 or 16, got {hidden_bits}")
    return functools.partial(lower_recurrent, hidden_bits=hidden_bits)


def lower_recurrent(ctx: LoweringContext, node: fx.Node, hidden_bits: int = 8) -> bool:
    if node.target not in RECURRENT_OPS:
        return False
    call = RecurrentCall.parse(node)
    x = activation(ctx, node.args[0])
    wide_x = None if x is not None else _int16_input(ctx, node)
    if wide_x is not None:  # x read at int16: the kernel quantizes the float it comes from
        x = Activation(wide_x[0], wide_x[1], 0)
    states = [activation(ctx, arg_at(node, path), True) for path in call.state_paths]
    outputs = _outputs(ctx, node)
    if x is None or outputs is None or any(s is None for s in states):
        return False
    h0 = states[0]
    assert h0 is not None
    c0 = states[1] if len(states) > 1 else h0
    assert c0 is not None
    y = outputs[0].params
    y_s, y_z = float(y.scale), int(y.zero_point)
    y_bits = 16 if y.dtype == QDtype.INT16 else 8
    if call.kind == "rnn_relu" and call.num_layers > 1:
        return False  # no bound on the unobserved layers' states: stays as the reference
    params = _layer_params(ctx, node, call)
    if params is None:
        return False
    initial = (h0.scale, h0.zero_point)
    h_n = outputs.get(1)
    returned = None if h_n is None else (float(h_n.params.scale), int(h_n.params.zero_point))
    y_range = (y_s, y_z, y_bits)
    inner = inner_params(_hidden_ranges(ctx, node, call, y_range, initial, returned))
    last = inner_params(_observed_ranges(call, y_range, initial, returned))
    first = call.layers[0]
    w_hh = weight(ctx, arg_at(node, first.w_hh))
    assert w_hh is not None
    hidden = int(w_hh.values.shape[0]) // {"lstm": 4, "gru": 3}.get(call.kind, 1)
    w_hr = None if first.w_hr is None else weight(ctx, arg_at(node, first.w_hr))
    proj_size = 0 if w_hr is None else int(w_hr.values.shape[0])
    qparams = [x.scale, x.zero_point, *inner, y_s, y_z, h0.scale, h0.zero_point, c0.scale]
    qparams += [c0.zero_point, max(abs(v) for v in _range(*inner)) / 32767.0]
    qparams += [*last, max(abs(v) for v in _range(*last)) / 32767.0]
    for index, state in ((1, h0), (2, c0)):  # h_n and c_n on their own grids when used
        out = outputs.get(index)
        qparams += (
            [float(out.params.scale), int(out.params.zero_point)]
            if out
            else [state.scale, state.zero_point]
        )
    hx = [s.node for s in states if s is not None]
    if call.batch_sizes_path is None and all(_is_zeros(ctx, s) for s in states if s):
        hx = []  # zero initial states: the kernel starts from zeros, no tensor is made for them
    graph = ctx.gm.graph
    float_x = wide_x[0] if wide_x is not None else _float_input(x, node)
    readers = _float_readers(outputs[0])
    # an int16 output is written as float on its grid; a quantize left in place (below)
    # gives its readers the int16 values
    float_y = bool(readers) or y_bits == 16
    with graph.inserting_before(node):
        shape: tuple = (hidden, call.num_layers, call.bidirectional)
        rest: tuple = ([float(v) for v in qparams], hidden_bits, proj_size)
        rest = (*rest, float_x is not None, float_y, 16 if wide_x else 8, y_bits)
        if call.batch_sizes_path is None:
            op, args = (
                torch.ops.quantree.rnn.default,
                (float_x or x.node, hx, params, *shape, call.batch_first),
            )
        else:  # a packed sequence: one native call on its rows (ops_rnn_packed.py)
            batch_sizes = arg_at(node, call.batch_sizes_path)
            op, args = (
                torch.ops.quantree.rnn_packed_sequence.default,
                (float_x or x.node, batch_sizes, hx, params, *shape),
            )
        new = graph.call_function(op, (call.kind, *args, *rest))
        new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    for index, q in outputs.items():
        with graph.inserting_before(q.node):
            leaf = graph.call_function(operator.getitem, (new, index))
        mark_provenance(q.node, leaf)
        if index == 0 and readers:  # float out: the dequantizes that read it are the leaf
            leaf.meta.pop(OUTPUT_GRID_KEY, None)
            for dq in readers:
                dq.replace_all_uses_with(leaf)
                graph.erase_node(dq)
        elif index == 0 and float_y:  # float on the int16 grid: its quantize stays, exact
            leaf.meta.pop(OUTPUT_GRID_KEY, None)
            q.node.args = (leaf, *q.node.args[1:])
            continue
        q.node.replace_all_uses_with(leaf)
        graph.erase_node(q.node)
    for user in list(node.users):
        graph.erase_node(user)
    graph.erase_node(node)
    return True


FLOAT_OUTPUT_ARG = 12
"""Where ``quantree.rnn`` takes ``float_output``, positionally (the rule above passes every
argument so)."""


def float_outputs_read_by_dequantize(gm: fx.GraphModule) -> None:
    """A lowered layer whose int8 output only a native dequantize on its own grid reads
    writes float instead, that dequantize's arithmetic done by the kernel (one op call and
    one tensor fewer per call: the same bits).

    The rule could not decide this when it ran: a dequantize reading the output may then
    still have been an int8 kernel's pattern (a linear's, a second layer's). Once every rule
    has run, a native dequantize left is a float read, nothing else.
    """
    # packed sequences are left as they are: their rows' movement rules read int8
    for node in list(gm.graph.nodes):
        if node.target != torch.ops.quantree.rnn.default or len(node.args) <= FLOAT_OUTPUT_ARG + 2:
            continue
        if node.args[FLOAT_OUTPUT_ARG] or node.args[FLOAT_OUTPUT_ARG + 2] != 8:
            continue  # float already, or an int16 output (written float on its grid)
        qparams = node.args[FLOAT_OUTPUT_ARG - 4]
        leaves = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
        if len(leaves) != 1:
            continue
        readers = list(leaves[0].users)
        if not readers or any(
            r.target != torch.ops.quantree.dequantize.default
            or r.kwargs
            or (float(r.args[1]), int(r.args[2])) != (float(qparams[4]), int(qparams[5]))
            for r in readers
        ):
            continue
        args = list(node.args)
        args[FLOAT_OUTPUT_ARG] = True
        node.args = tuple(args)
        leaves[0].meta.pop(OUTPUT_GRID_KEY, None)
        for dq in readers:
            dq.replace_all_uses_with(leaves[0])
            gm.graph.erase_node(dq)
