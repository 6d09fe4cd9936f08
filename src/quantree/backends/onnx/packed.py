"""Packed sequences for ONNX: ``pack -> <layer>.data -> pad`` as padded layers with lengths.

``qt.capture`` leaves a packed model as ``aten._pack_padded_sequence(x, lengths,
batch_first)`` -> one ``aten.<kind>.data`` per layer on the packed rows (quantize/dequantize
pairs between) -> ``aten._pad_packed_sequence``. The packed rows (their count depends on the
lengths' values) have no ONNX form, but ONNX's ``LSTM``/``GRU``/``RNN`` take the padded batch
with ``sequence_lens`` and compute what PyTorch's packed layer computes: each sequence runs
its own steps (the reverse direction from its last one), its final state is the one after its
last step, and ``Y`` is zero past its length. So the pack becomes its padded input itself
(seq-first, in the sorted order the pack was given) with the lengths as int32
``sequence_lens``; each packed layer becomes the padded layer given them
(``recurrent._Layer``); the pad becomes the layer's padded output (a ``Where`` for a non-zero
``padding_value``, sliced to the longest length when ``total_length`` is left out, transposed
back for ``batch_first``). Sorting and unsorting around them
(``index_select`` by the sorted indices, final states permuted by ``nn.RNNBase``) are
ordinary ops and stay as they are.

Refused with the fix: a packed value read by anything else than a per-tensor
quantize/dequantize, a layer or the pad (the rows' layout has no padded equivalent), and a pad
to a ``total_length`` other than the padded input's.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from quantree.core.errors import QuantreeError
from quantree.core.qdq import DEQUANTIZE_PER_TENSOR, QUANTIZE_PER_TENSOR
from quantree.recurrent.call import PACKED_OPS

aten = torch.ops.aten
PACK = aten._pack_padded_sequence.default
PAD = aten._pad_packed_sequence.default
_ELEMENTWISE = (QUANTIZE_PER_TENSOR, DEQUANTIZE_PER_TENSOR)
_NEW = (
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_ones.default,
    aten.new_full.default,
)
"""Read only their first argument's dtype and device (nn.RNNBase's zero initial state), which
the padded batch shares with the packed rows."""

LayerRewrite = Callable[[fx.Node, fx.Node], None]
"""Rewrites one packed layer call given its (already padded) input and ``sequence_lens``."""


def unpack_sequences(gm: fx.GraphModule, rewrite_layer: LayerRewrite) -> int:
    """Rewrite every packed sequence of ``gm`` in place; the number of layers rewritten."""
    packs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is PACK]
    return sum(_Unpack(gm, pack).rewrite(rewrite_layer) for pack in packs)


def _getitems(node: fx.Node, index: int) -> list[fx.Node]:
    return [
        u
        for u in node.users
        if u.op == "call_function" and u.target is operator.getitem and u.args[1] == index
    ]


def _scalar_check(node: fx.Node) -> bool:
    """A node of the size checks ``torch.export`` leaves on a size (Python arithmetic and
    comparisons on it, ``_assert_scalar``)."""
    if node.op != "call_function":
        return False
    target = node.target
    if getattr(target, "__module__", None) in ("_operator", "operator"):
        return True
    name = str(target)
    return "_assert_scalar" in name or "sym_constrain_range" in name


class _Unpack:
    def __init__(self, gm: fx.GraphModule, pack: fx.Node) -> None:
        self.gm, self.graph, self.pack = gm, gm.graph, pack
        x, lengths, batch_first = pack.args[:3]
        assert isinstance(x, fx.Node) and isinstance(lengths, fx.Node)
        self.x, self.lengths, self.batch_first = x, lengths, bool(batch_first)
        self.rows = set(_getitems(pack, 0))  # the packed rows and what q/dq makes of them
        self.sizes = set(_getitems(pack, 1))  # batch_sizes
        self.layers: list[fx.Node] = []
        self.pads: list[fx.Node] = []
        self.size_reads: list[fx.Node] = []
        self._trace()

    def _refuse(self, node: fx.Node, why: str) -> QuantreeError:
        return QuantreeError(
            f"node {node.name} ({node.target}) {why}; the ONNX export writes a packed sequence "
            f"(from {self.pack.name}) as its padded batch with sequence_lens, which holds for "
            "pack_padded_sequence -> LSTM/GRU/RNN -> pad_packed_sequence (to the padded "
            "input's length or the longest) and nothing else between them. Pad the batch "
            "(pad_packed_sequence) before the other op to export it"
        )

    def _trace(self) -> None:
        """Every node reading the packed rows or batch sizes, sorted by what it is."""
        watched = self.rows | self.sizes
        for node in self.graph.nodes:
            read = [a for a in node.all_input_nodes if a in watched]
            if not read:
                continue
            if node.op == "call_function" and node.target is aten.sym_size.int:
                self.size_reads.append(node)
            elif node.target in _NEW and read == [node.args[0]]:
                continue
            elif node.target in _ELEMENTWISE and node.args[0] in self.rows:
                self.rows.add(node)
            elif node.target in PACKED_OPS and node.args[0] in self.rows:
                if node.args[1] not in self.sizes:
                    raise self._refuse(node, "reads packed rows with other batch sizes")
                self.layers.append(node)
                self.rows.update(_getitems(node, 0))
            elif node.target is PAD and node.args[0] in self.rows and node.args[1] in self.sizes:
                self.pads.append(node)
            else:
                what = ", ".join(a.name for a in read)
                raise self._refuse(node, f"reads the packed sequence ({what}) directly")
            watched = self.rows | self.sizes

    def _steps(self) -> object:
        val = self.x.meta.get("val")
        return None if val is None else val.shape[1 if self.batch_first else 0]

    def _to_longest(self, pad: fx.Node) -> bool:
        """Whether ``pad`` pads to the longest length (``total_length`` left out: the number
        of packed steps, read from the batch sizes)."""
        total = pad.args[4] if len(pad.args) > 4 else None
        return (
            isinstance(total, fx.Node)
            and total.target is aten.sym_size.int
            and total.args[0] in self.sizes
        )

    def _check_pads(self) -> None:
        steps = self._steps()
        for pad in self.pads:
            if self._to_longest(pad):
                continue
            total = pad.args[4] if len(pad.args) > 4 else None
            if isinstance(total, fx.Node):
                total = total.meta.get("val")
            if steps is None or total is None or not statically_known_true(total == steps):
                raise self._refuse(
                    pad,
                    f"pads to {total} steps, neither the padded input's {steps} nor the "
                    "longest length (ONNX's layers give the input's length, sliced to the "
                    "longest when total_length is left out); pass total_length=x.shape[1] "
                    "(batch_first) or x.shape[0], or leave it out",
                )

    def _drop_size_reads(self) -> None:
        """The row count and number of steps are read only by ``torch.export``'s own checks
        on them, which have no meaning for the padded batch: dropped with them."""
        doomed: dict[fx.Node, None] = {}
        stack = list(self.size_reads)
        while stack:
            node = stack.pop()
            if node in doomed:
                continue
            doomed[node] = None
            for user in node.users:
                if user.target is PAD:
                    continue  # the pad's total length, checked and replaced
                if not _scalar_check(user):
                    raise self._refuse(user, "reads the packed sequence's size")
                stack.append(user)
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        for node in sorted(doomed, key=order.__getitem__, reverse=True):
            if not node.users:
                self.graph.erase_node(node)

    def _call(self, target: object, *args: object, **kwargs: object) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)  # type: ignore[arg-type]

    def rewrite(self, rewrite_layer: LayerRewrite) -> int:
        self._check_pads()
        for pad in self.pads:
            self._rewrite_pad(pad)
        self._drop_size_reads()
        with self.graph.inserting_after(self.pack):  # after both the input and the lengths
            lens = self._call(aten.to.dtype, self.lengths, torch.int32)
        with self.graph.inserting_after(lens):
            padded = self._call(aten.transpose.int, self.x, 0, 1) if self.batch_first else self.x
        for item in _getitems(self.pack, 0):
            item.replace_all_uses_with(padded)
            self.graph.erase_node(item)
        for layer in self.layers:
            rewrite_layer(layer, lens)
        for item in _getitems(self.pack, 1):
            if item.users:
                raise self._refuse(next(iter(item.users)), "reads the batch sizes")
            self.graph.erase_node(item)
        if not self.pack.users:
            self.graph.erase_node(self.pack)
        return len(self.layers)

    def _steps_of(self, data: fx.Node) -> fx.Node:
        return self._call(aten.sym_size.int, data, 0)

    def _rewrite_pad(self, pad: fx.Node) -> None:
        """``(padded, lengths)``: the layer's seq-first output, ``padding_value`` where it is
        past a length (ONNX gives zeros there), transposed back for ``batch_first``."""
        data, _, batch_first, padding_value = pad.args[:4]
        assert isinstance(data, fx.Node)
        with self.graph.inserting_before(pad):
            out = data
            if self._to_longest(pad):  # the longest length: the lengths' largest value
                longest = self._call(aten.max.default, self.lengths)
                n = self._call(aten._local_scalar_dense.default, longest)
                self._call(torch._check, self._call(operator.ge, n, 1))
                self._call(torch._check, self._call(operator.le, n, self._steps_of(data)))
                out = self._call(aten.slice.Tensor, out, 0, 0, n)
            if float(padding_value) != 0.0:  # type: ignore[arg-type]
                steps = self._call(aten.sym_size.int, data, 0)
                t = self._call(aten.arange.default, steps, dtype=torch.int64)
                live = self._call(
                    aten.lt.Tensor,
                    self._call(aten.unsqueeze.default, t, 1),
                    self._call(aten.unsqueeze.default, self.lengths, 0),
                )
                mask = self._call(aten.unsqueeze.default, live, 2)
                out = self._call(aten.where.ScalarOther, mask, data, float(padding_value))  # type: ignore[arg-type]
            if batch_first:
                out = self._call(aten.transpose.int, out, 0, 1)
        for item in _getitems(pad, 0):
            item.replace_all_uses_with(out)
            self.graph.erase_node(item)
        for item in _getitems(pad, 1):
            item.replace_all_uses_with(self.lengths)
            self.graph.erase_node(item)
        if pad.users:
            raise self._refuse(next(iter(pad.users)), "reads pad_packed_sequence's result whole")
        self.graph.erase_node(pad)
