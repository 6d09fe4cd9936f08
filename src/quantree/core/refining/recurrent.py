"""The inputs each recurrent weight matrix multiplies, for refining it like a linear layer.

Whole mode keeps ``aten.lstm``/``aten.gru``/``aten.rnn_*`` as one op, yet each of its weight
matrices is a linear map of a tensor the graph shows: ``W_ih`` (every gate's rows) reads the
layer's input at every step, ``W_hh`` the previous hidden state, which is the initial state
at the first step and the output sequence after (shifted by one step, the other way for a
reverse direction). So refining needs no change inside the op: a recorder after it collects
both inputs' moments per direction, and each matrix's integers are rounded against its float
rows' outputs (each gate's rows on its own grid rows) exactly as a linear layer's.
GRU's candidate gate scales ``W_hn h`` by the reset gate, so its ``b_hh`` is not moved by
bias correction (the mean shift there is not additive); its rounding still holds as a
linear map's. Stacked calls are split per layer at prepare (``split_layers``); a stacked
call kept whole is left as convert made it.
"""

from __future__ import annotations

import torch
from torch import nn

from quantree.core.refining.statistics import InputMoments

_aten = torch.ops.aten
RECURRENT = {
    _aten.lstm.input: "lstm",
    _aten.gru.input: "gru",
    _aten.rnn_tanh.input: "rnn",
    _aten.rnn_relu.input: "rnn",
}


class RecurrentInputs(nn.Module):
    """Identity on a recurrent op's results; records what ``W_ih`` and ``W_hh`` read.

    Called as ``(input, h0, output sequence)``; ``h0`` is ``[directions, batch, hidden]``.
    Keys: ``"ih"`` (both directions read the same input), ``"hh0"``, ``"hh1"``.
    """

    def __init__(self, batch_first: bool, directions: int) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.directions = directions
        self.moments = {"ih": InputMoments(None)}
        for d in range(directions):
            self.moments[f"hh{d}"] = InputMoments(None)

    def forward(self, x: torch.Tensor, h0: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.batch_first and x.dim() == 3:
                x, out = x.transpose(0, 1), out.transpose(0, 1)  # [steps, batch, ...]
            if x.dim() == 2:  # unbatched
                x, out, h0 = x.unsqueeze(1), out.unsqueeze(1), h0.unsqueeze(1)
            self.moments["ih"].add(x.reshape(-1, x.shape[-1]).double())
            hidden = out.shape[-1] // self.directions
            for d in range(self.directions):
                seq = out[..., d * hidden : (d + 1) * hidden]
                before = seq[:-1] if d == 0 else seq[1:]  # the state each step read
                rows = torch.cat((h0[d].unsqueeze(0), before)).reshape(-1, hidden)
                self.moments[f"hh{d}"].add(rows.double())
        return out
