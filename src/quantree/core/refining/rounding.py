"""Adaptive rounding of one weight on its fixed grid, against the float layer's output.

Rounding each weight to its nearest grid point minimises the weight's error, not the
layer's: errors in weights that read correlated inputs add up in the output. This is the
error-feedback rounding of OPTQ/GPTQ (a closed form of what AdaRound and SeqMSE reach by
gradient descent): weights are rounded one input column at a time, and each column's
rounding error is pushed onto the columns not yet rounded through the inverse of the
input's second moments ``H``, so the output error ``trace(D H D^T)`` stays small. The
scales and zero points stay as calibration set them; only the integers change, so lowering,
saving and export read the result like any reference graph.
"""

from __future__ import annotations

import torch

from quantree.core.observing.grouped import (
    CODE_MAX,
    CODE_MIN,
    best_multipliers,
    quantize_grouped,
)

DAMPING = 0.01
"""Added to H's diagonal, as a fraction of its mean: keeps the inverse defined where an
input column is constant or unseen."""


def output_error(delta: torch.Tensor, gram: torch.Tensor) -> float:
    """Summed squared output error of a weight change ``delta`` ([out, in]) over the rows
    whose ``x^T x`` sums to ``gram``."""
    d = delta.double()
    return float(((d @ gram) * d).sum())


def round_against_output(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    gram: torch.Tensor,
    group_size: int | None = None,
) -> torch.Tensor:
    """Integers for ``weight`` ([out, in]; ``scale``/``zero_point`` per row, shape [out, 1],
    or scalars) chosen column by column with error feedback; never worse than nearest.
    ``group_size``: 4-bit codes times a multiplier per group of columns
    (``observing/grouped.py``), each group's multiplier chosen when its first column is
    reached, on the columns as the errors before it left them."""
    rows = weight.shape[0]
    s = scale.double().reshape(-1, 1).expand(rows, 1)
    z = zero_point.double().reshape(-1, 1).expand(rows, 1)
    if group_size is None:
        nearest = torch.clamp(torch.round(weight.double() / s) + z, qmin, qmax)
    else:
        nearest = quantize_grouped(weight, s[:, 0], group_size).double()
    w = weight.double().clone()
    h = gram.clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    torch.diagonal(h).add_(DAMPING * float(torch.diagonal(h).mean()))
    try:
        upper = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except RuntimeError:  # not positive definite even damped: keep nearest rounding
        return nearest
    q = torch.empty_like(w)
    step = s[:, 0]
    energy = torch.diagonal(gram).clamp(min=0.0)
    for i in range(w.shape[1]):
        if group_size is not None and i % group_size == 0:  # the group's multiplier, from
            block = w[:, i : i + group_size].unsqueeze(1)  # its columns as fed back so far
            m = best_multipliers(block, s[:, 0], energy[i : i + group_size].unsqueeze(0))
            step = s[:, 0] * m[:, 0].double()
        column = w[:, i]
        if group_size is None:
            q[:, i] = torch.clamp(torch.round(column / step) + z[:, 0], qmin, qmax)
        else:
            codes = torch.clamp(torch.round(column / step), CODE_MIN, CODE_MAX)
            q[:, i] = codes * torch.round(step / s[:, 0])
        err = (column - (q[:, i] - z[:, 0]) * s[:, 0]) / upper[i, i]
        w[:, i:] -= err[:, None] * upper[i, i:][None, :]
    better = output_error(weight - (q - z) * s, gram) <= output_error(
        weight - (nearest - z) * s, gram
    )
    return q if better else nearest
