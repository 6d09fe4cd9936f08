"""GRU and RNN for ONNX Runtime in int8: integer matrix products inside a ``Scan``.

ONNX Runtime has an int8 LSTM (``DynamicQuantizeLSTM``) and nothing for GRU or RNN. Per
direction, the decomposition is:

- the input projection of every step at once: one ``com.microsoft.DynamicQuantizeMatMul``
  (the float input quantized once per call, int8 ``W^T`` stored once with quantree's per-row
  scales, the input bias added in its epilogue): ``[seq, batch, G*H]``;
- a ``Scan`` over time whose body multiplies the hidden state by int8 ``R^T`` with the same
  operator and applies the gates (ONNX's GRU with ``linear_before_reset=1``, which is
  PyTorch's formulation: ``n = tanh(x_n + r * (h R_n^T + Rb_n))``);
- a reverse direction scans backwards (``scan_input_directions``/``scan_output_directions``);
- given ``sequence_lens`` (a packed sequence, ``packed``), one more scanned input says which
  sequences are still running at each step: past its length a sequence keeps its state and
  outputs zeros. Forwards its final state is then the one after its last step; backwards it
  keeps its initial state until its last step and runs from there: both PyTorch's packed
  layer (and ONNX's ``sequence_lens``).

Outputs keep the layer's shapes: ``Y [seq, dirs, batch, H]``, ``Y_h [dirs, batch, H]``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper

from quantree.backends.onnx.ort_constants import QuantizedConstant
from quantree.backends.onnx.ort_weights import per_tensor


class Rewriter(Protocol):
    """What a recurrence takes from ``ort_target.Rewriter`` (named here, not imported: that
    module calls this one)."""

    def initializer(self, base: str, value: np.ndarray) -> str: ...

    def unquantized(self, name: str) -> str: ...


MS_DOMAIN = "com.microsoft"


def _attr(node: onnx.NodeProto, name: str, default: object) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


SCAN_MIN_STEP_MACS = {"GRU": 3 * 256 * 256, "RNN": 256 * 256}
"""Fewest multiply-adds per time step (batch x gates x hidden x hidden) for which a layer
becomes the int8 ``Scan``. Each step of a ``Scan`` runs its body's nodes one by one, a
fixed cost per step that ONNX Runtime's fused float ``GRU``/``RNN`` kernel does not pay;
on a small product the int8 arithmetic saves less than that, and the float kernel is the
faster of the two (the crossover is measured in benchmarks/README.md, issue 25's sections).
Such a layer stays float, named in the export's warning. The GRU's body has four times the
RNN's nodes, hence its higher bar."""


def scan_is_slower(node: onnx.NodeProto, batch: int | None) -> str | None:
    """Why the float kernel would beat the int8 ``Scan`` for ``node`` at ``batch`` (None
    when the ``Scan`` is worth it). A free batch is judged at 1: the latency case, where a
    small layer's ``Scan`` loses most, against a small gain at the batches where it wins."""
    hidden = int(_attr(node, "hidden_size", 0))  # type: ignore[call-overload]
    gates = 3 if node.op_type == "GRU" else 1
    macs = (batch or 1) * gates * hidden * hidden
    if macs >= SCAN_MIN_STEP_MACS[node.op_type]:
        return None
    at = f"batch {batch}" if batch else "batch free, judged at 1"
    return (
        f"{at}, hidden {hidden}: an int8 Scan step costs more in ONNX Runtime than its "
        f"float {node.op_type} kernel below {SCAN_MIN_STEP_MACS[node.op_type]} multiply-adds "
        "a step"
    )


def can_scan(node: onnx.NodeProto) -> str | None:
    """Why ``node`` cannot be decomposed (None when it can)."""
    if len(node.input) <= 5 or not node.input[5]:
        return "no initial_h"
    if node.op_type == "GRU" and _attr(node, "linear_before_reset", 0) != 1:
        return "linear_before_reset=0"
    if _attr(node, "clip", None) is not None:
        return "clip"
    if node.op_type == "RNN":
        acts = _attr(node, "activations", [b"Tanh"])
        if not isinstance(acts, list) or len({bytes(a) for a in acts}) != 1:
            return "mixed activations"
        if bytes(acts[0]) not in (b"Tanh", b"Relu"):
            return f"activation {acts[0]!r}"
    return None


def scan_recurrence(
    rw: Rewriter,
    node: onnx.NodeProto,
    W: QuantizedConstant,
    R: QuantizedConstant,
    B: np.ndarray | None,
) -> list[onnx.NodeProto]:
    """The nodes replacing the ``GRU``/``RNN`` ``node``; their outputs are the node's."""
    name = node.name or node.output[0]
    hidden = int(_attr(node, "hidden_size", R.values.shape[-1]))  # type: ignore[call-overload]
    gates = W.values.shape[1] // hidden
    dirs = W.values.shape[0]
    if B is None:
        B = np.zeros((dirs, 2 * gates * hidden), np.float32)
    x = rw.unquantized(node.input[0])
    R = per_tensor(R) or R  # layouts: see ort_weights
    nodes: list[onnx.NodeProto] = []
    ys, hs = [], []
    act = b"Relu" if node.op_type == "RNN" and _relu(node) else b"Tanh"
    reverse_dir = _attr(node, "direction", b"forward") == b"reverse"
    lens = node.input[4] if len(node.input) > 4 else ""
    running = _running(rw, name, x, lens, nodes) if lens else None
    for d in range(dirs):
        p = f"{name}_d{d}"
        # the input projection, split by rows into what the step adds before the sigmoid
        # (z and r) and the candidate's part, so the step needs no Split of it
        cut = [(0, gates * hidden)] if gates == 1 else [(0, 2 * hidden), (2 * hidden, 3 * hidden)]
        xps = []
        for k, (lo, hi) in enumerate(cut):
            xp = f"{p}_xp{k}"
            nodes.append(
                helper.make_node(
                    "DynamicQuantizeMatMul",
                    [
                        x,
                        rw.initializer(
                            f"{p}_Wt{k}_int8", np.ascontiguousarray(W.values[d, lo:hi].T)
                        ),
                        rw.initializer(f"{p}_W{k}_scale", W.scale[d, lo:hi].astype(np.float32)),
                        rw.initializer(
                            f"{p}_W{k}_zero_point", W.zero_point[d, lo:hi].astype(np.int8)
                        ),
                        rw.initializer(f"{p}_Wb{k}", B[d, lo:hi].astype(np.float32)),
                    ],
                    [xp],
                    domain=MS_DOMAIN,
                )
            )
            xps.append(xp)
        rt = rw.initializer(f"{p}_Rt_int8", np.ascontiguousarray(R.values[d].T))
        r_bias = B[d, gates * hidden :].astype(np.float32)
        rows = np.atleast_1d(R.scale[d]).astype(np.float32)
        col = None
        if rows.size > 1 and np.all(np.isfinite(rows)) and np.all(rows > 0):
            # per-row scales kept (ort_weights): the product runs on one scale of 1 and a Mul
            # applies the rows' scales after it, s * (h R^T + b / s): the same values up to
            # float rounding, and the per-step product stays on MLAS's one-scale path
            col = rw.initializer(f"{p}_R_row_scale", rows)
            r_bias, rows = r_bias / rows, np.ones(1, np.float32)
        r_scale = rw.initializer(f"{p}_R_scale", rows)
        r_zp = rw.initializer(f"{p}_R_zero_point", np.zeros(rows.size, np.int8))
        rb = rw.initializer(f"{p}_Rb", r_bias.astype(np.float32))
        h0_index = rw.initializer(f"{p}_h0_index", np.array(d, np.int64))
        h0, y, hT = f"{p}_h0", f"{p}_y", f"{p}_hT"
        nodes.append(helper.make_node("Gather", [node.input[5], h0_index], [h0], axis=0))
        body = _body(p, gates, hidden, act, rt, r_scale, r_zp, rb, col, running is not None)
        backwards = int(reverse_dir or d == 1)
        scanned = [*xps, running] if running else xps
        nodes.append(
            helper.make_node(
                "Scan",
                [h0, *scanned],
                [hT, y],
                name=f"{p}_scan",
                body=body,
                num_scan_inputs=len(scanned),
                scan_input_directions=[backwards] * len(scanned),
                scan_output_directions=[backwards],
            )
        )
        axis1 = rw.initializer(f"{p}_axis1", np.array([1], np.int64))
        axis0 = rw.initializer(f"{p}_axis0", np.array([0], np.int64))
        ys.append(f"{p}_y4")
        hs.append(f"{p}_hT3")
        nodes.append(helper.make_node("Unsqueeze", [y, axis1], [ys[-1]]))
        nodes.append(helper.make_node("Unsqueeze", [hT, axis0], [hs[-1]]))
    outputs = list(node.output) + [""] * (2 - len(node.output))
    for parts, out, axis in ((ys, outputs[0], 1), (hs, outputs[1], 0)):
        if not out:
            continue
        if len(parts) == 1:
            nodes.append(helper.make_node("Identity", parts, [out]))
        else:
            nodes.append(helper.make_node("Concat", parts, [out], axis=axis))
    return nodes


def _running(rw: Rewriter, name: str, x: str, lens: str, nodes: list[onnx.NodeProto]) -> str:
    """``[seq, batch, 1]`` bool: whether step ``t`` is within each sequence's length."""
    p = f"{name}_running"
    zero = rw.initializer(f"{p}_zero", np.array(0, np.int64))
    one = rw.initializer(f"{p}_one", np.array(1, np.int64))
    first = rw.initializer(f"{p}_first", np.array([0], np.int64))
    axes_t = rw.initializer(f"{p}_axes_t", np.array([1, 2], np.int64))
    axes_b = rw.initializer(f"{p}_axes_b", np.array([0, 2], np.int64))
    nodes += [
        helper.make_node("Shape", [x], [f"{p}_shape"], start=0, end=1),
        helper.make_node("Squeeze", [f"{p}_shape", first], [f"{p}_steps"]),
        helper.make_node("Range", [zero, f"{p}_steps", one], [f"{p}_t"]),
        helper.make_node("Unsqueeze", [f"{p}_t", axes_t], [f"{p}_t3"]),
        helper.make_node("Cast", [lens], [f"{p}_lens64"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", [f"{p}_lens64", axes_b], [f"{p}_lens3"]),
        helper.make_node("Less", [f"{p}_t3", f"{p}_lens3"], [p]),
    ]
    return p


def _relu(node: onnx.NodeProto) -> bool:
    acts = _attr(node, "activations", [b"Tanh"])
    return isinstance(acts, list) and bytes(acts[0]) == b"Relu"


def _body(
    p: str,
    gates: int,
    hidden: int,
    act: bytes,
    rt: str,
    r_scale: str,
    r_zp: str,
    rb: str,
    col: str | None = None,
    masked: bool = False,
) -> onnx.GraphProto:
    """One time step: ``(h, x_t...) -> (h', h')``; the weights are read from the outer graph.
    ``masked``: a last scanned input ``[batch, 1]`` says which rows still run; the others
    keep ``h`` and output zeros.

    Few nodes: each costs about as much as the step's arithmetic at small sizes."""
    h, rp = f"{p}_h", f"{p}_rp"
    h_next = f"{p}_hc" if masked else f"{p}_hn"
    product = f"{p}_rp_unscaled" if col else rp
    nodes = [
        helper.make_node(
            "DynamicQuantizeMatMul", [h, rt, r_scale, r_zp, rb], [product], domain=MS_DOMAIN
        )
    ]
    if col:
        nodes.append(helper.make_node("Mul", [product, col], [rp]))
    if gates == 1:
        xs = [f"{p}_xt"]
        nodes += [
            helper.make_node("Add", [xs[0], rp], [f"{p}_pre"]),
            helper.make_node(act.decode(), [f"{p}_pre"], [h_next]),
        ]
    else:
        xs = [f"{p}_xzr", f"{p}_xn"]
        sizes = helper.make_tensor(f"{p}_sizes", TensorProto.INT64, [2], [2 * hidden, hidden])
        halves = helper.make_tensor(f"{p}_halves", TensorProto.INT64, [2], [hidden, hidden])
        nodes += [
            helper.make_node("Constant", [], [f"{p}_s"], value=sizes),
            helper.make_node("Constant", [], [f"{p}_s2"], value=halves),
            helper.make_node("Split", [rp, f"{p}_s"], [f"{p}_rzr", f"{p}_rn"], axis=1),
            helper.make_node("Add", [xs[0], f"{p}_rzr"], [f"{p}_zr_pre"]),
            helper.make_node("Sigmoid", [f"{p}_zr_pre"], [f"{p}_zr_act"]),
            helper.make_node("Split", [f"{p}_zr_act", f"{p}_s2"], [f"{p}_z", f"{p}_r"], axis=1),
            helper.make_node("Mul", [f"{p}_r", f"{p}_rn"], [f"{p}_rrn"]),
            helper.make_node("Add", [xs[1], f"{p}_rrn"], [f"{p}_n_pre"]),
            helper.make_node("Tanh", [f"{p}_n_pre"], [f"{p}_n"]),
            helper.make_node("Sub", [h, f"{p}_n"], [f"{p}_h_n"]),
            helper.make_node("Mul", [f"{p}_z", f"{p}_h_n"], [f"{p}_zh"]),
            helper.make_node("Add", [f"{p}_n", f"{p}_zh"], [h_next]),
        ]
    scanned = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, w])
        for n, w in zip(xs, widths_of(gates, hidden), strict=True)
    ]
    if masked:
        m, zero = f"{p}_m", f"{p}_yzero"
        scanned.append(helper.make_tensor_value_info(m, TensorProto.BOOL, [None, 1]))
        nodes += [
            helper.make_node("Constant", [], [zero], value_float=0.0),
            helper.make_node("Where", [m, h_next, h], [f"{p}_hn"]),
            helper.make_node("Where", [m, h_next, zero], [f"{p}_yt"]),
        ]
        h_next = f"{p}_hn"
    else:
        nodes.append(helper.make_node("Identity", [h_next], [f"{p}_yt"]))
    state = helper.make_tensor_value_info(h, TensorProto.FLOAT, [None, hidden])
    outs = [
        helper.make_tensor_value_info(v, TensorProto.FLOAT, [None, hidden])
        for v in (h_next, f"{p}_yt")
    ]
    return helper.make_graph(nodes, f"{p}_step", [state, *scanned], outs)


def widths_of(gates: int, hidden: int) -> list[int]:
    """The widths of a step's scanned projections: ``z|r`` and ``n`` for a GRU."""
    return [2 * hidden, hidden] if gates == 3 else [gates * hidden]
