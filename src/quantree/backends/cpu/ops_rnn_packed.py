"""The whole-layer recurrent op on a packed sequence (``aten.lstm.data`` and kin).

The native kernel runs a padded batch step by step and has no notion of a sequence that
ended early. Packing sorts sequences longest first, so the sequences of one length are
contiguous: each such group is a padded batch with no padding, and one ``quantree::rnn``
call per distinct length computes exactly the packed semantics (every layer and direction
of a group starts and ends where its sequences do). The cost is one native call per
distinct length instead of per-step masking inside the kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from quantree.backends.cpu.ops_rnn import rnn
from quantree.backends.cpu.registry import op


@op(
    "rnn_packed_sequence(str kind, Tensor x, Tensor batch_sizes, Tensor[] hx, Tensor[] params, "
    "int hidden, int num_layers, bool bidirectional, float[] qparams, int hidden_bits, "
    "int proj_size) -> (Tensor, Tensor, Tensor)"
)
def rnn_packed_sequence(
    kind: str,
    x: Tensor,
    batch_sizes: Tensor,
    hx: list[Tensor],
    params: list[Tensor],
    hidden: int,
    num_layers: int,
    bidirectional: bool,
    qparams: list[float],
    hidden_bits: int,
    proj_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``quantree::rnn`` on packed int8 rows ``x``; the output rows are packed the same way."""

    def run(xs: Tensor, states: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        y, h_n, c_n = rnn(
            kind, xs, states, params, hidden, num_layers, bidirectional, False, qparams,
            hidden_bits, proj_size,
        )  # fmt: skip
        return y, [h_n, c_n] if kind == "lstm" else [h_n]

    out, finals = by_length(x, batch_sizes, hx, 1, run)
    return out, finals[0], finals[1] if kind == "lstm" else x.new_empty((0,))


def by_length(
    x: Tensor,
    batch_sizes: Tensor | list[int],
    states: list[Tensor],
    batch_dim: int,
    run: Callable[[Tensor, list[Tensor]], tuple[Tensor, list[Tensor]]],
) -> tuple[Tensor, list[Tensor]]:
    """``run(xs [T, n, ...], states) -> (ys [T, n, ...], final states)`` once per group of
    sequences of one length, on packed rows ``x``; returns packed ``ys`` and final states.

    ``states`` hold the batch on ``batch_dim``.
    """
    sizes = torch.as_tensor(batch_sizes, dtype=torch.int64)
    batch = int(sizes[0])
    # row-major (step, sequence) order of the mask is the packed order of the rows
    mask = torch.arange(batch) < sizes[:, None]
    padded = x.new_zeros((len(sizes), batch, *x.shape[1:]))
    padded[mask] = x
    lengths = mask.sum(0).tolist()
    out: Tensor | None = None
    finals = [s.clone() for s in states]
    start = 0
    while start < batch:
        length = lengths[start]
        end = start + lengths.count(length)
        group = [s.narrow(batch_dim, start, end - start).contiguous() for s in states]
        y, group_finals = run(padded[:length, start:end].contiguous(), group)
        if out is None:
            out = y.new_zeros((len(sizes), batch, *y.shape[2:]))
            finals = [f.to(g.dtype) for f, g in zip(finals, group_finals, strict=True)]
        out[:length, start:end] = y
        for final, g in zip(finals, group_finals, strict=True):
            final.narrow(batch_dim, start, end - start).copy_(g)
        start = end
    assert out is not None
    return out[mask], finals


@torch.library.register_fake("quantree::rnn_packed_sequence")
def _(
    kind, x, batch_sizes, hx, params, hidden, num_layers, bidirectional, qparams, hidden_bits,
    proj_size,
):  # fmt: skip
    width = (proj_size or hidden) * (2 if bidirectional else 1)
    c_n = hx[1].new_empty(hx[1].shape) if kind == "lstm" else x.new_empty((0,))
    return x.new_empty((x.shape[0], width), dtype=torch.int8), hx[0].new_empty(hx[0].shape), c_n
