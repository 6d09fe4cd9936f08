"""Capturing ``PackedSequence`` models: pack -> LSTM/GRU/RNN -> pad as ATen ops.

torch.export (2.13) cannot trace a packed sequence: the packed data has ``sum(lengths)`` rows
and ``batch_sizes`` has ``max(lengths)`` entries, both data-dependent, and the fake kernels
of ``aten._pack_padded_sequence`` / ``aten.lstm.data`` guess wrong shapes or specialize on
them (``GuardOnDataDependentSymNode``); ``nn.LSTM`` also builds its default zero state from
``batch_sizes[0]``, a tensor. While capturing, ``packed_sequences`` routes the three
``torch._VF`` calls through ops whose fake kernels give those sizes as unbacked symbols
(the real kernels call the ATen ops), and gives each packed ``nn.RNNBase`` call an explicit
zero state, which is what the module would build. After export ``restore_aten`` turns the
ops back into ``aten._pack_padded_sequence``, ``aten.lstm.data`` (``gru.data``,
``rnn_*.data``) and ``aten._pad_packed_sequence``: the graph computes what the model
computes and reads like any ATen graph.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from quantree.core.errors import QuantreeError
from quantree.recurrent import free_length

aten = torch.ops.aten
VF = torch._C._VariableFunctions
KINDS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
DATA_OPS = {kind: getattr(aten, kind).data for kind in KINDS}
FIX = (
    "pack inside forward from a padded tensor and its lengths "
    "(nn.utils.rnn.pack_padded_sequence(x, lengths, ...)), or pass the padded tensor"
)


@torch.library.custom_op("quantree_packed::pack", mutates_args=())
def _pack(x: Tensor, lengths: Tensor, batch_first: bool) -> tuple[Tensor, Tensor]:
    data, batch_sizes = VF._pack_padded_sequence(x, lengths, batch_first)
    return data.clone(), batch_sizes.clone()


@_pack.register_fake
def _(x: Tensor, lengths: Tensor, batch_first: bool) -> tuple[Tensor, Tensor]:
    ctx = torch.library.get_ctx()
    steps, batch = (x.shape[1], x.shape[0]) if batch_first else x.shape[:2]
    bound = steps * batch if isinstance(steps * batch, int) else None
    rows = ctx.new_dynamic_size(max=bound) if bound is not None else ctx.new_dynamic_size()
    count = ctx.new_dynamic_size(max=steps) if isinstance(steps, int) else ctx.new_dynamic_size()
    if not isinstance(steps, int):  # a free length: the bounds as facts about the symbols, so
        # pad_packed_sequence's `total_length < batch_sizes.size(0)` check can be decided
        torch._check(count <= steps)
        torch._check(rows <= steps * batch)
    return x.new_empty((rows, *x.shape[2:])), lengths.new_empty((count,), dtype=torch.int64)


@torch.library.custom_op("quantree_packed::rnn", mutates_args=())
def _rnn(
    kind: str,
    data: Tensor,
    batch_sizes: Tensor,
    hx: list[Tensor],
    params: list[Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
) -> list[Tensor]:
    op = getattr(VF, "lstm" if kind == "lstm" else kind)
    args = (data, batch_sizes, hx if kind == "lstm" else hx[0], params, has_biases)
    return list(op(*args, num_layers, dropout, train, bidirectional))


@_rnn.register_fake
def _(kind, data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
    width = hx[0].shape[-1] * (2 if bidirectional else 1)
    return [data.new_empty((data.shape[0], width)), *(h.new_empty(h.shape) for h in hx)]


@torch.library.custom_op("quantree_packed::pad", mutates_args=())
def _pad(
    data: Tensor, batch_sizes: Tensor, batch_first: bool, value: float, length: int, batch: int
) -> tuple[Tensor, Tensor]:
    padded, lengths = VF._pad_packed_sequence(data, batch_sizes, batch_first, value, length)
    return padded.clone(), lengths.clone()


@_pad.register_fake
def _(data, batch_sizes, batch_first, value, length, batch):
    shape = (batch, length) if batch_first else (length, batch)
    return data.new_empty((*shape, *data.shape[1:])), batch_sizes.new_empty((batch,))


@contextlib.contextmanager
def packed_sequences(model: nn.Module) -> Iterator[list[str]]:
    """While exporting ``model``, trace packed sequences through the ops above.

    Yields the names of the recurrent modules that ran on a packed sequence (empty when the
    model packs nothing), for error messages. The model and ``torch._VF`` are restored
    on exit.
    """
    batches: dict[int, int] = {}  # id(batch_sizes) -> number of sequences
    seen: list[str] = []

    def pack(x: Tensor, lengths: Tensor, batch_first: bool) -> tuple[Tensor, Tensor]:
        data, batch_sizes = _pack(x, lengths, batch_first)
        batches[id(batch_sizes)] = x.shape[0] if batch_first else x.shape[1]
        return data, batch_sizes

    def pad(data, batch_sizes, batch_first, value, length):
        return _pad(data, batch_sizes, batch_first, value, length, _batch(batch_sizes, "pad"))

    def _batch(batch_sizes: Tensor, where: str) -> int:
        if id(batch_sizes) not in batches:
            raise QuantreeError(
                f"{where}: a packed sequence reached the model from outside its forward; "
                f"torch.export cannot capture a packed sequence input. Fix: {FIX}"
            )
        return batches[id(batch_sizes)]

    def recurrent(kind: str) -> Callable[..., Any]:
        def call(data, batch_sizes, hx, params, has_biases, layers, dropout, train, bidir):
            states = list(hx) if isinstance(hx, list | tuple) else [hx]
            out = _rnn(kind, data, batch_sizes, states, list(params), has_biases, layers,
                       dropout, train, bidir)  # fmt: skip
            return tuple(out)

        return call

    patches: dict[str, Any] = {"_pack_padded_sequence": pack, "_pad_packed_sequence": pad}
    for kind in KINDS:
        patches[kind] = _by_overload(free_length.call(kind), recurrent(kind))
    wrapped = [m for m in model.modules() if isinstance(m, nn.RNNBase)]
    names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
    for module in wrapped:
        name = names[id(module)]
        module.forward = _with_zero_state(module, name, _batch, seen)  # type: ignore[method-assign,assignment]
        for method, cell in METHODS.items():
            if hasattr(module, method):
                setattr(module, method, _expected_size(module, name, _batch, cell))
    for key, fn in patches.items():
        setattr(torch._VF, key, fn)
    try:
        yield seen
    finally:
        for key in patches:
            delattr(torch._VF, key)
        for module in wrapped:
            for method in ("forward", *METHODS):
                if method in vars(module):
                    delattr(module, method)


def _by_overload(padded: Callable[..., Any], packed: Callable[..., Any]) -> Callable[..., Any]:
    """``_VF.lstm(data, batch_sizes, ...)`` is the packed overload, ``(input, hx, ...)`` not."""

    def call(*args: Any) -> Any:
        if isinstance(args[1], Tensor) and not args[1].is_floating_point():
            return packed(*args)
        return padded(*args)

    return call


def _with_zero_state(
    module: nn.RNNBase, name: str, batch: Callable[[Tensor, str], int], seen: list[str]
) -> Callable[..., Any]:
    """``module.forward`` with the zero initial state nn.RNNBase would build from a tensor."""
    forward = type(module).forward

    def call(input: Any, hx: Any = None) -> Any:
        if not isinstance(input, PackedSequence):
            return forward(module, input, hx)
        seen.append(name)
        if hx is None:
            size = batch(input.batch_sizes, name)
            count = module.num_layers * (2 if module.bidirectional else 1)
            width = module.proj_size or module.hidden_size
            like = input.data
            h = like.new_zeros(count, size, width)
            hx = (
                (h, like.new_zeros(count, size, module.hidden_size)) if module.mode == "LSTM" else h
            )
            # zeros need no sorting into the packing's order: left unpermuted, they stay
            # recognisable as the default state (cells mode builds it per call)
            module.permute_hidden = _permute_except(module, hx)  # type: ignore[method-assign,assignment]
        try:
            return forward(module, input, hx)
        finally:
            vars(module).pop("permute_hidden", None)

    return call


def _permute_except(module: nn.RNNBase, zeros: Any) -> Callable[[Any, Any], Any]:
    """``module.permute_hidden`` leaving the default zero state ``zeros`` as it is."""

    def permute(state: Any, order: Tensor | None) -> Any:
        return state if state is zeros else type(module).permute_hidden(module, state, order)

    return permute


METHODS = {"get_expected_hidden_size": False, "get_expected_cell_size": True}
"""nn.RNNBase's checks, which read the batch as ``int(batch_sizes[0])`` (data-dependent)."""


def _expected_size(
    module: nn.RNNBase, name: str, batch: Callable[[Tensor, str], int], cell: bool
) -> Callable[[Tensor, Tensor | None], tuple[int, int, int]]:
    """``module.get_expected_*_size`` with the batch of a packed sequence known at packing."""
    original = getattr(
        type(module), "get_expected_cell_size" if cell else "get_expected_hidden_size"
    )

    def get(input: Tensor, batch_sizes: Tensor | None) -> tuple[int, int, int]:
        if batch_sizes is None:
            return original(module, input, batch_sizes)
        width = module.hidden_size if cell else (module.proj_size or module.hidden_size)
        count = module.num_layers * (2 if module.bidirectional else 1)
        return count, batch(batch_sizes, name), width

    return get


def restore_aten(gm: fx.GraphModule) -> None:
    """Replace the capture-time ops by the ATen ops they stand for (same arguments)."""
    ops = torch.ops.quantree_packed
    for node in list(gm.graph.nodes):
        if free_length.restore(node):
            continue
        if node.target == ops.pack.default:
            node.target = aten._pack_padded_sequence.default
        elif node.target == ops.pad.default:
            node.target = aten._pad_packed_sequence.default
            node.args = node.args[:5]
        elif node.target == ops.rnn.default:
            kind, data, batch_sizes, hx, *rest = node.args
            node.target = DATA_OPS[kind]
            node.args = (data, batch_sizes, hx if kind == "lstm" else hx[0], *rest)
    gm.graph.lint()
    gm.recompile()


def as_capture_ops(gm: fx.GraphModule) -> None:
    """The inverse of ``restore_aten``: for exporting a graph that already holds the ATen
    ops again (``quantree.backends.save`` re-exports a lowered graph), whose fake kernels
    cannot trace them (see the module docstring). ``pad`` gets the number of sequences as
    the size of the lengths its ``pack`` read; ``restore_aten`` on the exported graph turns
    them back."""
    ops = torch.ops.quantree_packed
    packs = {}
    for node in list(gm.graph.nodes):
        if free_length.as_capture_op(node):
            continue
        if node.target == aten._pack_padded_sequence.default:
            node.target = ops.pack.default
            packs[node] = node.args[1]
        elif node.target == aten._pad_packed_sequence.default:
            pack = _producer(node.args[1], packs)
            if pack is None:
                raise QuantreeError(
                    f"{node.name}: aten._pad_packed_sequence reads batch sizes that no "
                    f"aten._pack_padded_sequence of this graph made, so its batch is unknown "
                    f"and the graph cannot be exported. Fix: {FIX}"
                )
            with gm.graph.inserting_before(node):
                batch = gm.graph.call_function(aten.sym_size.int, (packs[pack], 0))
            node.target = ops.pad.default
            node.args = (*node.args[:5], batch)
        elif node.target in DATA_OPS.values():
            kind = next(k for k, op in DATA_OPS.items() if op == node.target)
            data, batch_sizes, hx, *rest = node.args
            states = list(hx) if kind == "lstm" else [hx]
            node.target = ops.rnn.default
            node.args = (kind, data, batch_sizes, states, *rest)
    gm.graph.lint()
    gm.recompile()


def _producer(batch_sizes: Any, packs: dict[fx.Node, Any]) -> fx.Node | None:
    """The pack node whose batch sizes ``batch_sizes`` is (through ``getitem``)."""
    node = batch_sizes
    while isinstance(node, fx.Node):
        if node in packs:
            return node
        if node.target is not operator.getitem:
            return None
        node = node.args[0]
    return None
