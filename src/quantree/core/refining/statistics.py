"""What the refining of one layer needs from calibration: the second moments of its input.

Rounding a layer's weights against the float layer's output on the inputs it reads (its
quantized inputs, as the reference graph computes them) needs only ``X^T X`` of those inputs
(the output error of a weight change ``D`` is ``trace(D X^T X D^T)``), and bias correction
needs only their mean (the output's mean shift is ``mean(X) D^T``). So each layer keeps
``in x in`` numbers whatever the calibration's length: a recorder module placed before the
layer, in a copy of the graph, accumulates them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class InputMoments(nn.Module):
    """Identity on a layer's input; accumulates the sum of ``x x^T`` and of ``x`` over rows.

    A row is one input vector of the layer's weight: a linear layer's last dimension, a
    convolution's patch (``unfold``), so the weight reshaped to ``[out, -1]`` multiplies it.
    A grouped convolution's output channels read only their group's slice of the patch, so
    its sums are kept per group (``gram`` is then ``[groups, d, d]``): a depthwise layer's
    full ``x^T x`` would be ``groups^2`` times larger and all but its diagonal blocks unused.
    """

    def __init__(
        self,
        conv: tuple[list[int], list[int], list[int], list[int]] | None,
        groups: int = 1,
    ) -> None:
        super().__init__()
        self.conv = conv  # kernel, stride, padding, dilation as 2-d (a 1-d one: height 1)
        self.groups = groups
        self.gram: torch.Tensor | None = None
        self.total: torch.Tensor | None = None
        self.rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.conv is None:
                rows = x.reshape(-1, x.shape[-1]).double()
            else:
                kernel, stride, padding, dilation = self.conv
                image = x.float().unsqueeze(2) if x.dim() == 3 else x.float()  # 1-d: height 1
                patches = F.unfold(
                    image, tuple(kernel), tuple(dilation), tuple(padding), tuple(stride)
                )
                rows = patches.transpose(1, 2).reshape(-1, patches.shape[1]).double()
            self.add(rows)
        return x

    def add(self, rows: torch.Tensor) -> None:
        """Fold input rows ([n, in], float64) into the sums."""
        if self.groups > 1:  # the patch is channel-major: group g's columns are contiguous
            parts = rows.reshape(rows.shape[0], self.groups, -1).transpose(0, 1)
            gram = parts.transpose(1, 2) @ parts
        else:
            gram = rows.t() @ rows
        total = rows.sum(0)
        self.gram = gram if self.gram is None else self.gram + gram
        self.total = total if self.total is None else self.total + total
        self.rows += rows.shape[0]

    @property
    def mean(self) -> torch.Tensor:
        assert self.total is not None
        return self.total / max(self.rows, 1)
