"""The whole-layer recurrent op: LSTM / GRU / RNN, one native call per layer and direction."""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native import library, ptr
from quantree.backends.cpu.ops_elementwise import dequantize, quantize
from quantree.backends.cpu.packing import packed_depth
from quantree.backends.cpu.registry import op

RNN_KINDS = {"lstm": 0, "gru": 1, "rnn_tanh": 2, "rnn_relu": 3}
PER_LAYER = 8  # w_ih and w_hh: packed int8, int32 row sums, per-channel scale, float bias
PER_PROJECTION = 3  # w_hr (LSTM proj_size): packed int8, int32 row sums, per-channel scale


@op(
    "rnn(str kind, Tensor x, Tensor[] hx, Tensor[] params, int hidden, int num_layers, "
    "bool bidirectional, bool batch_first, float[] qparams, int hidden_bits, int proj_size) "
    "-> (Tensor, Tensor, Tensor)"
)
def rnn(
    kind: str,
    x: Tensor,
    hx: list[Tensor],
    params: list[Tensor],
    hidden: int,
    num_layers: int,
    bidirectional: bool,
    batch_first: bool,
    qparams: list[float],
    hidden_bits: int,
    proj_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """A whole int8 LSTM/GRU/RNN: ``(output, h_n, c_n)``, all int8 (``c_n`` empty if no cell).

    ``qparams``: (scale, zero point) of the input, the inner int8 grid (where the hidden
    states of the layers before the last lie), the output, the h state, the c state, the
    int16 step of the inner grid, the last layer's grid and its int16 step, then the grids of
    h_n and c_n. The hidden
    state fed back is requantized on its layer's grid: int8 when ``hidden_bits`` is 8,
    symmetric int16 when 16 (and always for the layers before the last). Outputs passed
    between stacked layers are quantized per call on their own range, as int16.
    ``params``: per layer and direction, ``w_ih, rowsum_ih, scale_ih, b_ih`` and the same for
    ``hh``: packed int8 weights, their int32 row sums, per-channel scales, float biases;
    with ``proj_size``, then ``w_hr, rowsum_hr, scale_hr``.
    """
    x_s, x_z, inner_s, inner_z, y_s, y_z, h_s, h_z, c_s, c_z, inner_fb, last_s, last_z, last_fb = (
        qparams[:14]
    )
    hn_s, hn_z, cn_s, cn_z = qparams[14:18]
    wide = hidden_bits == 16
    lib, code, dirs = library(), RNN_KINDS[kind], 2 if bidirectional else 1
    inp = (x.transpose(0, 1) if batch_first else x).contiguous()
    steps, batch = inp.shape[0], inp.shape[1]
    h = dequantize(hx[0], h_s, int(h_z)).contiguous()
    c = dequantize(hx[1], c_s, int(c_z)).contiguous() if kind == "lstm" else None
    per_layer = PER_LAYER + (PER_PROJECTION if proj_size else 0)
    width = proj_size or hidden  # of the hidden state and the output
    in_s, in_z, inp16 = x_s, x_z, None
    for layer in range(num_layers):
        last = layer == num_layers - 1
        # the last layer writes int8 on the output's grid; the others float, quantized
        # below on the range they actually took (never observed, so not known in advance)
        y = torch.empty(steps, batch, dirs * width, dtype=torch.int8 if last else torch.float32)
        out_q, out_f = (y.data_ptr(), None) if last else (None, y.data_ptr())
        grid = (last_s, last_z, last_fb) if last else (inner_s, inner_z, inner_fb)
        grid_s, grid_z, grid_fb = grid
        # the layers before the last feed back int16 whatever hidden_bits says: their grid is
        # a bound on states never observed, too coarse for int8 where the states are small
        layer_wide = wide or not last
        fb_s, fb_z = (grid_fb, 0.0) if layer_wide else (grid_s, grid_z)
        k_in, x8 = (inp.shape[2], ptr(inp)) if inp16 is None else (inp16.shape[2], None)
        for d in range(dirs):
            i = layer * dirs + d
            layer_params = params[i * per_layer : (i + 1) * per_layer]
            w_ih, sum_ih, sc_ih, b_ih, w_hh, sum_hh, sc_hh, b_hh = layer_params[:PER_LAYER]
            w_hr, sum_hr, sc_hr = layer_params[PER_LAYER:] or (None, None, None)
            lib.qt_rnn_layer(
                code, steps, batch, k_in, hidden, d, x8, in_s, in_z, ptr(w_ih),
                packed_depth(w_ih), ptr(sum_ih), ptr(sc_ih), ptr(b_ih), ptr(w_hh),
                packed_depth(w_hh), ptr(sum_hh), ptr(sc_hh), ptr(b_hh), h_s, h_z, fb_s, fb_z,
                int(layer_wide), out_q and out_q + d * width, dirs * width, y_s, y_z, ptr(h[i]),
                None if c is None else ptr(c[i]), ptr(w_hr), proj_size, ptr(sum_hr), ptr(sc_hr),
                out_f and out_f + 4 * d * width, ptr(inp16),
            )  # fmt: skip
        if not last:  # the next layer's input: int16 on the range it took, as two byte planes
            low, high = torch.aminmax(y) if y.numel() else (y.new_zeros(()), y.new_zeros(()))
            in_s, in_z = max(-float(low), float(high), 1e-8) / 32767.0, 0
            inp16 = torch.empty(y.shape, dtype=torch.int16)
            lib.qt_quantize16(ptr(y), y.numel(), 1.0 / in_s, ptr(inp16))
    out = y
    out = out.transpose(0, 1).contiguous() if batch_first else out
    h_n = quantize(h, hn_s, int(hn_z))
    c_n = quantize(c, cn_s, int(cn_z)) if c is not None else x.new_empty((0,))
    return out, h_n, c_n


@torch.library.register_fake("quantree::rnn")
def _(
    kind, x, hx, params, hidden, num_layers, bidirectional, batch_first, qparams, hidden_bits,
    proj_size,
):  # fmt: skip
    dirs = 2 if bidirectional else 1
    out = x.new_empty((*x.shape[:2], dirs * (proj_size or hidden)), dtype=torch.int8)
    c_n = hx[1].new_empty(hx[1].shape) if kind == "lstm" else x.new_empty((0,))
    return out, hx[0].new_empty(hx[0].shape), c_n
