"""Whole-mode recurrent layers rewritten for ONNX: one ``LSTM``/``GRU``/``RNN`` per layer.

torch's exporter translates ``aten.lstm``/``aten.gru`` itself, but it reorders the gates of the
*dequantized* weights with ``Slice``/``Concat`` between ``DequantizeLinear`` and the layer, and
it unrolls ``aten.rnn_*`` into ``MatMul``s. Here each layer reads its weights straight from a
``DequantizeLinear`` whose integer initializer and per-channel scales are already in ONNX's gate
order and layout (``[dirs, G*H, in]``, per-channel along axis 1), and becomes one ONNX
operator (``quantree_onnx`` custom ops, see ``ops``). The quantize/dequantize pairs that the
reference graph puts on the input, the initial states and every output leaf stay where they
are: the initial state is read through a ``Slice`` per layer, and the outputs are assembled from
the layers' ``Y``/``Y_h``/``Y_c`` before those pairs. A layer on a packed sequence becomes the
same operator on the padded batch with ``sequence_lens`` (``packed``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from quantree.backends.onnx import ops
from quantree.backends.onnx.packed import unpack_sequences
from quantree.core.errors import QuantreeError
from quantree.core.graphs import fetch_attr, register_constant
from quantree.core.qdq import DEQUANTIZE_PER_CHANNEL, DEQUANTIZE_PER_TENSOR, is_dequantize
from quantree.core.values import arg_at
from quantree.recurrent.call import PACKED_OPS, PADDED_OPS, RecurrentCall
from quantree.recurrent.loop import RecurrentCells

aten = torch.ops.aten
_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
_TO_ONNX = {
    "lstm": ops.LSTM_TO_ONNX,
    "gru": ops.GRU_TO_ONNX,
    "rnn_tanh": ops.RNN_ORDER,
    "rnn_relu": ops.RNN_ORDER,
}


def rewrite_recurrent(gm: fx.GraphModule) -> int:
    """Replace every whole-mode recurrent call of ``gm`` in place; the number replaced."""
    for node in gm.graph.nodes:
        if _packed_cells(gm, node):
            _refuse_packed(node, f"cells-mode {node.target}")
    count = unpack_sequences(gm, lambda node, lens: _Layer(gm, node, lens).rewrite())
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in PACKED_OPS:
            _refuse_packed(node, node.target)
        if node.target in PADDED_OPS:
            _Layer(gm, node).rewrite()
            count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return count


def _packed_cells(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A ``RecurrentCells`` call given ``batch_sizes``: its loop slices rows by data-dependent
    sizes, which ``torch.export`` traces only as far as a ``new_zeros`` of a symbolic float."""
    if node.op != "call_module":
        return False
    if not isinstance(gm.get_submodule(str(node.target)), RecurrentCells):
        return False
    batch_sizes = node.args[2] if len(node.args) > 2 else node.kwargs.get("batch_sizes")
    return batch_sizes is not None


def _refuse_packed(node: fx.Node, what: object) -> None:
    raise QuantreeError(
        f"node {node.name} ({what}) runs on a packed sequence the ONNX export cannot write: "
        "it writes whole-mode layers on a sequence packed inside the model "
        "(pack_padded_sequence -> LSTM/GRU/RNN -> pad_packed_sequence) as ONNX layers with "
        "sequence_lens; cells mode's loop over packed rows has no such form. Quantize with "
        "qt.Int8Quantizer(recurrent=qt.RecurrentMode.WHOLE), or pad the batch "
        "(pad_packed_sequence before the layer), to export it"
    )


class _Layer:
    def __init__(
        self, gm: fx.GraphModule, node: fx.Node, sequence_lens: fx.Node | None = None
    ) -> None:
        self.gm = gm
        self.sequence_lens = sequence_lens  # a packed call: its input is already padded
        self.graph = gm.graph
        self.node = node
        self.call = RecurrentCall.parse(node)
        if any(p.w_hr is not None for p in self.call.layers):
            raise QuantreeError(
                f"node {node.name} ({node.target}) is an LSTM with proj_size, which ONNX's LSTM "
                "operator cannot express; export it in cells mode "
                "(qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS)) or without proj_size"
            )
        out = node.meta["val"]
        self.hidden = int(out[1].shape[-1])
        self.dirs = 2 if self.call.bidirectional else 1
        self.kind = self.call.kind

    def _call(self, target: Any, *args: Any) -> fx.Node:
        return self.graph.call_function(target, args)

    def rewrite(self) -> None:
        node, call = self.node, self.call
        with self.graph.inserting_before(node):
            x = node.args[0]
            assert isinstance(x, fx.Node)
            if call.batch_first:
                x = self._call(aten.transpose.int, x, 0, 1)
            states = [arg_at(node, p) for p in call.state_paths]
            finals: list[list[fx.Node]] = [[] for _ in states]
            for layer in range(call.num_layers):
                y, layer_finals = self._layer(layer, x, states)
                for k, f in enumerate(layer_finals):
                    finals[k].append(f)
                if self.dirs == 1:  # [seq, 1, batch, H]: a squeeze, not a transposing copy
                    x = self._call(aten.squeeze.dim, y, 1)
                else:
                    seq_first = self._call(aten.permute.default, y, [0, 2, 1, 3])
                    x = self._call(aten.flatten.using_ints, seq_first, 2, 3)  # [seq, batch, 2H]
            if call.batch_first:
                x = self._call(aten.transpose.int, x, 0, 1)
            results = [x] + [
                f[0] if len(f) == 1 else self._call(aten.cat.default, f, 0) for f in finals
            ]
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(results[int(user.args[1])])  # type: ignore[arg-type]
                self.graph.erase_node(user)
            else:
                raise QuantreeError(
                    f"node {node.name} ({node.target}): its output is read as a whole by "
                    f"{user.name}; the ONNX export expects each output leaf read by a getitem "
                    "(as quantree.capture leaves it)"
                )
        self.graph.erase_node(node)

    def _layer(self, layer: int, x: fx.Node, states: list[Any]) -> tuple[fx.Node, list[fx.Node]]:
        dirs, hidden = self.dirs, self.hidden
        params = [p for p in self.call.layers if p.layer == layer]
        W = self._stack([self._weight(p.w_ih) for p in params], 0)
        R = self._stack([self._weight(p.w_hh) for p in params], 0)
        biases = []
        for p in params:
            if p.b_ih is None or p.b_hh is None:
                gates = _GATES[self.kind] * hidden
                zeros = torch.zeros(1, 2 * gates)
                biases.append(
                    self.graph.get_attr(register_constant(self.gm, "_onnx_zero_b_", zeros))
                )
            else:
                b = [self._weight(p.b_ih), self._weight(p.b_hh)]
                biases.append(self._call(aten.cat.default, b, 1))
        B = self._stack(biases, 0)
        initial = [
            self._call(aten.slice.Tensor, s, 0, layer * dirs, (layer + 1) * dirs) for s in states
        ]
        rest: list[Any] = [hidden]
        if self.kind == "lstm":
            op = torch.ops.quantree_onnx.lstm.default
            n_out = 3
        elif self.kind == "gru":
            op = torch.ops.quantree_onnx.gru.default
            n_out = 2
        else:
            activation = "Relu" if self.kind == "rnn_relu" else "Tanh"
            op = torch.ops.quantree_onnx.rnn.default
            rest.append(activation)
            n_out = 2
        if self.sequence_lens is not None:
            rest.append(self.sequence_lens)
        out = self._call(op, x, W, R, B, *initial, *rest)
        items = [self._call(operator.getitem, out, i) for i in range(n_out)]
        return items[0], items[1:]

    def _stack(self, parts: list[fx.Node], dim: int) -> fx.Node:
        return parts[0] if len(parts) == 1 else self._call(aten.cat.default, parts, dim)

    def _weight(self, path: Any) -> fx.Node:
        """The weight or bias at ``path`` in ONNX gate order with a leading direction axis.

        A dequantized integer constant is reordered as integers (with its per-channel
        parameters) and dequantized again; anything else is reordered in the graph.
        """
        arg = arg_at(self.node, path)
        assert isinstance(arg, fx.Node)
        index = ops.block_index(_TO_ONNX[self.kind], self.hidden)
        source = arg.args[0] if is_dequantize(arg) else None
        if isinstance(source, fx.Node) and source.op == "get_attr":
            return self._dequantized_reordered(arg, source, index)
        if arg.op == "get_attr":
            value = fetch_attr(self.gm, str(arg.target)).index_select(0, index).unsqueeze(0)
            return self.graph.get_attr(register_constant(self.gm, "_onnx_w_", value))
        idx = self.graph.get_attr(register_constant(self.gm, "_onnx_gate_index_", index))
        picked = self._call(aten.index_select.default, arg, 0, idx)
        return self._call(aten.unsqueeze.default, picked, 0)

    def _dequantized_reordered(self, dq: fx.Node, source: fx.Node, index: torch.Tensor) -> fx.Node:
        stored = fetch_attr(self.gm, str(source.target)).index_select(0, index).unsqueeze(0)
        q = self.graph.get_attr(register_constant(self.gm, "_onnx_quantized_", stored))
        kwargs = dict(dq.kwargs)
        if dq.target == DEQUANTIZE_PER_TENSOR:
            return self.graph.call_function(DEQUANTIZE_PER_TENSOR, (q, *dq.args[1:]), kwargs)
        _, scale, zp, axis, *bounds = dq.args
        assert isinstance(scale, fx.Node) and isinstance(zp, fx.Node)
        if axis != 0:
            raise QuantreeError(
                f"node {self.node.name} ({self.node.target}): weight {dq.name} is quantized per "
                f"channel along axis {axis}; ONNX export needs recurrent weights per output row "
                "(axis 0) or per tensor"
            )
        scales = fetch_attr(self.gm, str(scale.target)).index_select(0, index)
        zps = fetch_attr(self.gm, str(zp.target)).index_select(0, index)
        s = self.graph.get_attr(register_constant(self.gm, "_onnx_scale_", scales))
        z = self.graph.get_attr(register_constant(self.gm, "_onnx_zero_point_", zps))
        return self.graph.call_function(DEQUANTIZE_PER_CHANNEL, (q, s, z, 1, *bounds), kwargs)
