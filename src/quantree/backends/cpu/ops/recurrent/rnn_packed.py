"""The whole-layer recurrent op on a packed sequence (``aten.lstm.data`` and kin).

One native call (``qt_rnn_packed``) runs every layer and direction on the packed rows as
they are: step t runs on the ``batch_sizes[t]`` sequences still running, which packing puts
first, so a finished sequence keeps its final state and, in reverse, a sequence starts at
its own last step from its initial state. A sequence's rows are computed as they are when
it runs alone through the padded kernel. The outputs handed between stacked layers are
quantized (int16) on the range they took over the call's real rows, as a padded call does
over its batch; one call per group of equal lengths, as before, made that range each
group's own and cost a call per distinct length (a 2-layer bidirectional LSTM on 29 lengths:
29 calls).
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native.registry import op
from quantree.backends.cpu.ops.recurrent.rnn import RnnRunner


@op(
    "rnn_packed_sequence(str kind, Tensor x, Tensor batch_sizes, Tensor[] hx, Tensor[] params, "
    "int hidden, int num_layers, bool bidirectional, float[] qparams, int hidden_bits, "
    "int proj_size, bool float_input=False, bool float_output=False, int x_bits=8, "
    "int y_bits=8) -> (Tensor, Tensor, Tensor)"
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
    float_input: bool = False,
    float_output: bool = False,
    x_bits: int = 8,
    y_bits: int = 8,
) -> tuple[Tensor, Tensor, Tensor]:
    """``quantree::rnn`` on packed int8 rows ``x``; the output rows are packed the same way.
    ``float_input`` / ``float_output``: the graph's quantize before the op and dequantize
    after it, done inside the kernel (see ``rnn``).

    Through the dispatcher each call builds its argument block; a lowered graph calls one
    ``PackedRnnRunner`` per node, which builds it once."""
    return PackedRnnRunner()(
        kind, x, batch_sizes, hx, params, hidden, num_layers, bidirectional, qparams,
        hidden_bits, proj_size, float_input, float_output, x_bits, y_bits,
    )  # fmt: skip


class PackedRnnRunner:
    """``rnn_packed_sequence`` through one ``RnnRunner`` (its plan built at the first call)."""

    def __init__(self) -> None:
        self.runner = RnnRunner()

    def __call__(
        self,
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
        float_input: bool = False,
        float_output: bool = False,
        x_bits: int = 8,
        y_bits: int = 8,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return self.runner.packed(
            kind, x, batch_sizes, hx, params, hidden, num_layers, bidirectional, qparams,
            hidden_bits, proj_size, float_input=float_input, float_output=float_output,
            x_bits=x_bits, y_bits=y_bits,
        )  # fmt: skip

    def __getstate__(self) -> dict:  # a copied graph builds its own plan from its own weights
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]


@torch.library.register_fake("quantree::rnn_packed_sequence")
def _(
    kind, x, batch_sizes, hx, params, hidden, num_layers, bidirectional, qparams, hidden_bits,
    proj_size, float_input=False, float_output=False, x_bits=8, y_bits=8,
):  # fmt: skip
    width = (proj_size or hidden) * (2 if bidirectional else 1)
    c_n = hx[1].new_empty(hx[1].shape) if kind == "lstm" else x.new_empty((0,))
    out_dtype = torch.float32 if float_output else torch.int8
    return x.new_empty((x.shape[0], width), dtype=out_dtype), hx[0].new_empty(hx[0].shape), c_n
