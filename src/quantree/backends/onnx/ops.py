"""ONNX's recurrent operators as PyTorch custom ops: one call is one ONNX ``LSTM``/``GRU``/``RNN``.

The export pass (``quantree.backends.onnx.recurrent``) rewrites each whole-mode ``aten.lstm``
/ ``gru`` / ``rnn_*`` into these ops, one per layer, with weights already in ONNX's gate order
and layout; each then translates 1:1 to the ONNX operator. The eager implementations (used
while ``torch.export`` traces the rewritten graph, and to check the rewrite) put the gates back
in PyTorch's order and call PyTorch's own layer, so they compute exactly what ONNX specifies:

- LSTM: ``W [dirs, 4H, in]`` gates ``i o f c``, ``R [dirs, 4H, H]``, ``B [dirs, 8H]`` = ``Wb, Rb``
- GRU: gates ``z r h``, ``linear_before_reset=1`` (PyTorch's formulation)
- RNN: one gate, activation ``Tanh`` or ``Relu``

Outputs: ``Y [seq, dirs, batch, H]``, ``Y_h [dirs, batch, H]`` (and ``Y_c`` for LSTM).

``sequence_lens`` (int32 ``[batch]``, optional, ONNX's input of that name): each sequence runs
its own number of steps, as PyTorch's packed sequences do (``packed``): ``Y`` is zero past a
sequence's length, ``Y_h``/``Y_c`` are its state after its last step, and the reverse
direction starts at that step. The eager implementations run PyTorch's packed layer for it.
"""

from __future__ import annotations

from typing import Any

import torch

# Block permutations between PyTorch's and ONNX's gate orders, in units of the hidden size.
LSTM_TO_ONNX = (0, 3, 1, 2)  # PyTorch i f g o -> ONNX i o f c
LSTM_FROM_ONNX = (0, 2, 3, 1)
GRU_TO_ONNX = (1, 0, 2)  # PyTorch r z n -> ONNX z r h
GRU_FROM_ONNX = (1, 0, 2)
RNN_ORDER = (0,)


def block_index(order: tuple[int, ...], hidden: int) -> torch.Tensor:
    """Row indices that reorder gate blocks of ``hidden`` rows into ``order``."""
    return torch.cat([torch.arange(b * hidden, (b + 1) * hidden) for b in order])


def _torch_params(
    W: torch.Tensor, R: torch.Tensor, B: torch.Tensor, order: tuple[int, ...], hidden: int
) -> list[torch.Tensor]:
    index = block_index(order, hidden)
    gates = len(order) * hidden
    params = []
    for d in range(W.shape[0]):
        params += [
            W[d].index_select(0, index),
            R[d].index_select(0, index),
            B[d, :gates].index_select(0, index),
            B[d, gates:].index_select(0, index),
        ]
    return params


def _onnx_outputs(out: torch.Tensor, dirs: int, hidden: int) -> torch.Tensor:
    seq, batch = out.shape[0], out.shape[1]
    return out.reshape(seq, batch, dirs, hidden).permute(0, 2, 1, 3).contiguous()


def _run(
    layer: Any,
    X: torch.Tensor,
    hx: Any,
    params: list[torch.Tensor],
    dirs: int,
    sequence_lens: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """PyTorch's layer (``.input`` overload) on the padded ``X``, or, given ``sequence_lens``,
    its packed form (``.data``) on ``X`` packed by them and padded back with zeros."""
    if sequence_lens is None:
        return layer.input(X, hx, params, True, 1, 0.0, False, dirs == 2, False)
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

    packed = pack_padded_sequence(X, sequence_lens.long(), enforce_sorted=False)
    order, back = packed.sorted_indices, packed.unsorted_indices
    assert order is not None and back is not None
    states = [h.index_select(1, order) for h in hx] if isinstance(hx, list) else hx[:, order]
    out, *finals = layer.data(
        packed.data, packed.batch_sizes, states, params, True, 1, 0.0, False, dirs == 2
    )
    result = PackedSequence(out, packed.batch_sizes, order, back)
    padded, _ = pad_packed_sequence(result, total_length=X.shape[0])
    return (padded, *(f.index_select(1, back) for f in finals))


@torch.library.custom_op("quantree_onnx::lstm", mutates_args=())
def lstm(
    X: torch.Tensor,
    W: torch.Tensor,
    R: torch.Tensor,
    B: torch.Tensor,
    initial_h: torch.Tensor,
    initial_c: torch.Tensor,
    hidden_size: int,
    sequence_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dirs = W.shape[0]
    params = _torch_params(W, R, B, LSTM_FROM_ONNX, hidden_size)
    out, h, c = _run(torch.ops.aten.lstm, X, [initial_h, initial_c], params, dirs, sequence_lens)
    return _onnx_outputs(out, dirs, hidden_size), h.clone(), c.clone()


@lstm.register_fake
def _(X, W, R, B, initial_h, initial_c, hidden_size, sequence_lens=None):
    dirs, batch = W.shape[0], X.shape[1]
    y = X.new_empty((X.shape[0], dirs, batch, hidden_size))
    return y, X.new_empty((dirs, batch, hidden_size)), X.new_empty((dirs, batch, hidden_size))


@torch.library.custom_op("quantree_onnx::gru", mutates_args=())
def gru(
    X: torch.Tensor,
    W: torch.Tensor,
    R: torch.Tensor,
    B: torch.Tensor,
    initial_h: torch.Tensor,
    hidden_size: int,
    sequence_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    dirs = W.shape[0]
    params = _torch_params(W, R, B, GRU_FROM_ONNX, hidden_size)
    out, h = _run(torch.ops.aten.gru, X, initial_h, params, dirs, sequence_lens)
    return _onnx_outputs(out, dirs, hidden_size), h.clone()


@gru.register_fake
def _(X, W, R, B, initial_h, hidden_size, sequence_lens=None):
    dirs, batch = W.shape[0], X.shape[1]
    return (
        X.new_empty((X.shape[0], dirs, batch, hidden_size)),
        X.new_empty((dirs, batch, hidden_size)),
    )


@torch.library.custom_op("quantree_onnx::rnn", mutates_args=())
def rnn(
    X: torch.Tensor,
    W: torch.Tensor,
    R: torch.Tensor,
    B: torch.Tensor,
    initial_h: torch.Tensor,
    hidden_size: int,
    activation: str,
    sequence_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    dirs = W.shape[0]
    params = _torch_params(W, R, B, RNN_ORDER, hidden_size)
    layer = torch.ops.aten.rnn_relu if activation == "Relu" else torch.ops.aten.rnn_tanh
    out, h = _run(layer, X, initial_h, params, dirs, sequence_lens)
    return _onnx_outputs(out, dirs, hidden_size), h.clone()


@rnn.register_fake
def _(X, W, R, B, initial_h, hidden_size, activation, sequence_lens=None):
    dirs, batch = W.shape[0], X.shape[1]
    return (
        X.new_empty((X.shape[0], dirs, batch, hidden_size)),
        X.new_empty((dirs, batch, hidden_size)),
    )


def _direction(W) -> str:  # type: ignore[no-untyped-def]
    return "bidirectional" if W.shape[0] == 2 else "forward"


def onnx_lstm(X, W, R, B, initial_h, initial_c, hidden_size: int, sequence_lens=None):  # type: ignore[no-untyped-def]
    """The ONNX translation of ``quantree_onnx::lstm`` (onnxscript, traced)."""
    from onnxscript import opset18 as op

    return op.LSTM(
        X,
        W,
        R,
        B,
        sequence_lens=sequence_lens,
        initial_h=initial_h,
        initial_c=initial_c,
        direction=_direction(W),
        hidden_size=hidden_size,
    )


def onnx_gru(X, W, R, B, initial_h, hidden_size: int, sequence_lens=None):  # type: ignore[no-untyped-def]
    from onnxscript import opset18 as op

    return op.GRU(
        X,
        W,
        R,
        B,
        sequence_lens=sequence_lens,
        initial_h=initial_h,
        direction=_direction(W),
        hidden_size=hidden_size,
        linear_before_reset=1,
    )


def onnx_rnn(X, W, R, B, initial_h, hidden_size: int, activation: str, sequence_lens=None):  # type: ignore[no-untyped-def]
    from onnxscript import opset18 as op

    dirs = W.shape[0]
    return op.RNN(
        X,
        W,
        R,
        B,
        sequence_lens=sequence_lens,
        initial_h=initial_h,
        direction=_direction(W),
        hidden_size=hidden_size,
        activations=[activation] * dirs,
    )


def onnx_quantize_per_tensor(
    input, scale: float, zero_point: int, quant_min: int, quant_max: int, dtype: int
):  # type: ignore[no-untyped-def]
    """``QuantizeLinear`` with the zero point in the output type, clipped to a narrower range.

    onnxscript's own translation drops ``quant_min``/``quant_max``; ONNX saturates to the
    type's full range, so a range narrower than the type (``[-127, 127]``) needs a ``Clip``.
    """
    from onnxscript import ir, opset18

    op: Any = opset18

    tdtype = dtype if isinstance(dtype, torch.dtype) else _TORCH_DTYPES[dtype]
    info = torch.iinfo(tdtype)
    zp = op.Constant(value=ir.tensor(torch.tensor(zero_point, dtype=tdtype).numpy()))
    q = op.QuantizeLinear(input, op.Constant(value_float=float(scale)), zp)
    if (quant_min, quant_max) == (info.min, info.max):
        return q
    lo = op.Constant(value=ir.tensor(torch.tensor(quant_min, dtype=tdtype).numpy()))
    hi = op.Constant(value=ir.tensor(torch.tensor(quant_max, dtype=tdtype).numpy()))
    return op.Clip(q, lo, hi)


# ONNX TensorProto data types of the integer grids (the exporter passes dtypes as these).
_TORCH_DTYPES = {3: torch.int8, 2: torch.uint8, 5: torch.int16, 6: torch.int32}
