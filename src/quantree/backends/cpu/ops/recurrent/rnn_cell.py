"""One recurrent step (``aten.lstm_cell`` / ``gru_cell`` / ``rnn_*_cell``) as one native call.

A cell is one time step of a one-layer, one-direction layer: the whole-layer kernel
(``qt_rnn_layer``) runs it with ``T = 1``, reading the incoming hidden state on its own int8
grid as the first step of a layer does, and writing the new hidden state as int8 on its
output grid. The LSTM cell state comes in and goes out int8 and is float inside.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.args import NativeArgs
from quantree.backends.cpu.native.loader import F32, I64, INT, PTR
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.packing import packed_depth
from quantree.backends.cpu.native.registry import op
from quantree.backends.cpu.ops.elementwise import dequantize, quantize
from quantree.backends.cpu.ops.recurrent.rnn import RNN_KINDS

SIGNATURES: dict[str, list[type]] = {
    "qt_rnn_layer": [INT, I64, I64, I64, I64, INT, PTR, F32, F32, PTR, I64, PTR,
                     PTR, PTR, PTR, I64, PTR, PTR, PTR, F32, F32, F32, F32, INT,
                     PTR, I64, F32, F32, PTR, PTR, PTR, I64, PTR, PTR, PTR, PTR],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)


@op(
    "rnn_cell(str kind, Tensor x, Tensor[] hx, Tensor[] params, int hidden, float[] qparams) "
    "-> (Tensor, Tensor)"
)
def rnn_cell(
    kind: str, x: Tensor, hx: list[Tensor], params: list[Tensor], hidden: int, qparams: list[float]
) -> tuple[Tensor, Tensor]:
    """``(h', c')`` int8 from int8 ``x [B, K]`` and states ``[B, hidden]`` (``c'`` empty
    unless ``kind`` is ``"lstm"``).

    ``qparams``: (scale, zero point) of x, h, c, h' and c' (c's and c''s unused without a
    cell state). ``params``: ``w_ih, rowsum_ih, scale_ih, b_ih, w_hh, rowsum_hh, scale_hh,
    b_hh`` as the whole-layer op takes them (packed int8, int32 row sums, per-channel
    scales, float biases).
    """
    check.rnn_cell(kind, x, hx, params, hidden)
    x_s, x_z, h_s, h_z, c_s, c_z, y_s, y_z, cn_s, cn_z = qparams
    unbatched = x.dim() == 1
    x = (x.unsqueeze(0) if unbatched else x).contiguous()
    batch, k_in = x.shape
    h = dequantize(hx[0].reshape(batch, hidden), h_s, int(h_z))
    lstm = kind == "lstm"
    c = dequantize(hx[1].reshape(batch, hidden), c_s, int(c_z)) if lstm else None
    y = torch.empty(batch, hidden, dtype=torch.int8)
    w_ih, sum_ih, sc_ih, b_ih, w_hh, sum_hh, sc_hh, b_hh = params
    a = NativeArgs("rnn_cell")  # every address below points into a tensor ``a`` holds
    kernels().qt_rnn_layer(
        RNN_KINDS[kind], 1, batch, k_in, hidden, 0, a.input("x", x), x_s, x_z,
        a.input("w_ih", w_ih), packed_depth(w_ih), a.input("rowsum_ih", sum_ih),
        a.input("scale_ih", sc_ih), a.input("b_ih", b_ih), a.input("w_hh", w_hh),
        packed_depth(w_hh), a.input("rowsum_hh", sum_hh), a.input("scale_hh", sc_hh),
        a.input("b_hh", b_hh), h_s, h_z, h_s, h_z, 0, a.output("y", y), hidden, y_s, y_z,
        a.output("h", h), a.optional_output("c", c), None, 0, None, None, None, None,
    )  # fmt: skip
    c_n = quantize(c, cn_s, int(cn_z)) if c is not None else x.new_empty((0,))
    if unbatched:
        return y.reshape(hidden), c_n.reshape(-1)
    return y, c_n


@torch.library.register_fake("quantree::rnn_cell")
def _(kind, x, hx, params, hidden, qparams):
    shape = (*x.shape[:-1], hidden)
    c_n = x.new_empty(shape, dtype=torch.int8) if kind == "lstm" else x.new_empty((0,))
    return x.new_empty(shape, dtype=torch.int8), c_n
