"""Capturing recurrent layers without pinning their sequence length (or batch).

torch.export (2.13) traces ``aten.lstm.input`` (``gru``, ``rnn_tanh``, ``rnn_relu``) through
its fake kernel, which unrolls the time loop and so specializes the sequence length to the
example's: a model exported at length 50 refuses every other length, and asking for a
dynamic length with ``dynamic_shapes`` fails at export. While capturing, ``free_length``
routes each padded (not packed) recurrent call through an op whose fake kernel states the
output shapes in terms of the input's, so the length and batch stay symbolic. After export
``restore`` turns the op back into the ATen op it stands for, with the same arguments; the
graph then computes what the model computes and reads like any ATen graph. ``as_capture_op``
is the inverse, for re-exporting a graph that holds the ATen op again (saving a model).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from quantree.core.errors import QuantreeWarning

aten = torch.ops.aten
VF = torch._C._VariableFunctions  # the unpatched functions: the capture op's real kernel
KINDS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
INPUT_OPS = {kind: getattr(aten, kind).input for kind in KINDS}


def _define(kind: str) -> Any:
    """``quantree_capture::<kind>``: one op per kind, so export names its nodes as it names
    the ATen op's (``lstm``, ``gru_1``), and rows and errors read the same either way."""

    def real(
        input: Tensor,
        hx: list[Tensor],
        params: list[Tensor],
        has_biases: bool,
        num_layers: int,
        dropout: float,
        train: bool,
        bidirectional: bool,
        batch_first: bool,
    ) -> list[Tensor]:
        state = hx if kind == "lstm" else hx[0]
        out = getattr(VF, kind)(input, state, params, has_biases, num_layers, dropout, train,
                                bidirectional, batch_first)  # fmt: skip
        return [t.clone() for t in out]  # a custom op may not return its inputs' storage

    op = torch.library.custom_op(f"quantree_capture::{kind}", real, mutates_args=())

    @op.register_fake
    def _(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        width = hx[0].shape[-1] * (2 if bidirectional else 1)
        out = input.new_empty((*input.shape[:-1], width))
        return [out, *(h.new_empty(h.shape) for h in hx)]

    return op


CAPTURE_OPS = {kind: _define(kind) for kind in KINDS}
BY_TARGET = {getattr(torch.ops.quantree_capture, kind).default: kind for kind in KINDS}


def call(kind: str) -> Any:
    """What ``torch._VF.<kind>`` does on a padded input, through the capture op."""
    op = CAPTURE_OPS[kind]

    def run(input, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first):
        states = list(hx) if isinstance(hx, list | tuple) else [hx]
        out = op(input, states, list(params), has_biases, layers, dropout, train,
                 bidirectional, batch_first)  # fmt: skip
        return tuple(out)

    return run


def restore(node: fx.Node) -> bool:
    """Turn a capture op back into ``aten.<kind>.input``; False if ``node`` is not one."""
    kind = BY_TARGET.get(node.target)  # type: ignore[arg-type]
    if kind is None:
        return False
    input, hx, *rest = node.args
    assert isinstance(hx, list | tuple)
    node.target = INPUT_OPS[kind]
    node.args = (input, list(hx) if kind == "lstm" else hx[0], *rest)
    val = node.meta.get("val")
    if isinstance(val, list):
        node.meta["val"] = tuple(val)
    return True


def as_capture_op(node: fx.Node) -> bool:
    """The inverse of ``restore``; False if ``node`` is no padded recurrent ATen op."""
    kind = next((k for k, op in INPUT_OPS.items() if op == node.target), None)
    if kind is None:
        return False
    input, hx, *rest = node.args
    states = list(hx) if kind == "lstm" else [hx]  # type: ignore[arg-type]
    node.target = getattr(torch.ops.quantree_capture, kind).default
    node.args = (input, states, *rest)
    return True


def warn_pinned_lengths(model: torch.nn.Module, gm: fx.GraphModule) -> None:
    """One ``QuantreeWarning`` naming the padded recurrent layers whose sequence length the
    captured graph fixed (the model's code pins it, or the example's length is 0 or 1, which
    torch.export always fixes), with the fix that works for each cause."""
    pinned = []
    for node in gm.graph.nodes:
        if node.target not in INPUT_OPS.values():
            continue
        val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if not isinstance(val, Tensor) or val.dim() < 2:
            continue
        batch_first = bool(node.args[-1])
        length = val.shape[1] if batch_first and val.dim() == 3 else val.shape[0]
        if isinstance(length, int):
            scope = node.meta.get("nn_module_stack") or {}
            where = next(reversed(scope.values()))[0] if scope else node.name
            pinned.append((where or node.name, length))
    if not pinned:
        return
    short = any(length <= 1 for _, length in pinned)
    layers = ", ".join(f"{name} (length {length})" for name, length in pinned[:6])
    fix = (
        "give an example whose sequences are 2 or more steps long"
        if short
        else "compute the length from the input in forward (x.shape[1], -1 in a reshape) "
        "instead of a constant, or pass dynamic_shapes= naming the length dimension"
    )
    warnings.warn(
        f"{type(model).__name__} was captured with the sequence length of {layers} fixed: "
        f"a call at another length raises a QuantreeError. Fix: {fix}",
        QuantreeWarning,
        stacklevel=4,
    )
