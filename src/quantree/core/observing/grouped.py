"""4-bit weights with a scale per group of input columns, held on a per-channel int8 grid.

Per-channel 4-bit weights give each output channel one step for all its inputs; a scale per
block of ``group_size`` input columns (the usual fix at 4 bits) follows the columns'
magnitudes. Here a group's scale is an integer multiple ``m`` (1 to ``MULTIPLIERS``) of its
channel's int8 scale ``s``, so a group's weights are ``code * m * s`` with ``code`` in
[-8, 7]: ``code * m`` is an int8 integer on the channel's grid. The reference graph is
therefore the plain per-channel int8 dequantize (pt2e dialect), every backend's int8 kernel
computes on it exactly and at int8 speed, and a file or runtime that wants 4 bits recovers
``code`` and ``m`` per group (``group_codes``): the saved file packs the codes two a byte
with one multiplier byte a group, and ONNX reads them as int4 with block scales ``m * s``.

A group's multiplier is the one whose 4-bit rounding of the group has the least error
(weighted by each column's input energy where known, ``qt.refine``); with the channel's
int8 scale at its largest magnitude over 127.5, ``m = 16`` is the per-channel 4-bit grid.
"""

from __future__ import annotations

import torch

from quantree.core.errors import QuantreeError

CODE_MIN, CODE_MAX = -8, 7
MULTIPLIERS = 16
"""A group's scale is 1 to 16 times its channel's; ``code * m`` then stays in [-128, 112]."""
GROUP_SIZE_KEY = "quantree_group_size"
"""``meta`` key of a grouped weight's integer constant in the reference graph (its group size)."""
GRID_MIN, GRID_MAX = -128, 127
"""The channel grid grouped weights are declared on (int8; the scale maps the largest
magnitude to 127.5)."""


def check_group_size(group_size: object) -> None:
    if group_size is None:
        return
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2:
        raise QuantreeError(f"group_size must be an int >= 2 or None, got {group_size!r}")


def rows_of(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``weight`` as ``[channels, columns]`` (axis 0 the channels), refused where its columns
    do not split into whole groups."""
    rows = weight.reshape(weight.shape[0], -1)
    if rows.shape[1] % group_size:
        raise QuantreeError(
            f"a weight of shape {list(weight.shape)} has {rows.shape[1]} input columns a "
            f"channel, not a multiple of group_size={group_size}; pick a group_size dividing "
            f"{rows.shape[1]} or leave group_size=None (per channel)"
        )
    return rows


def best_multipliers(
    groups: torch.Tensor, scale: torch.Tensor, energy: torch.Tensor | None = None
) -> torch.Tensor:
    """The multiplier (1..16) per group of ``groups`` (``[channels, n_groups, size]``, in
    units of float) whose 4-bit rounding has the least error; ``scale`` ``[channels]`` the
    channel scales, ``energy`` (``[n_groups, size]``, optional) a weight per column."""
    s = scale.double().reshape(-1, 1, 1)
    x = groups.double()
    best_err = torch.full(x.shape[:2], float("inf"), dtype=torch.float64)
    best = torch.ones(x.shape[:2], dtype=torch.int64)
    for m in range(1, MULTIPLIERS + 1):
        step = s * m
        err = (x - torch.clamp(torch.round(x / step), CODE_MIN, CODE_MAX) * step) ** 2
        if energy is not None:
            err = err * energy.double().unsqueeze(0)
        total = err.sum(-1)
        take = total < best_err
        best_err = torch.where(take, total, best_err)
        best = torch.where(take, torch.full_like(best, m), best)
    return best


def quantize_grouped(weight: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """``weight`` (channels on axis 0) as int8 ``code * m`` per group, nearest rounding."""
    rows = rows_of(weight, group_size).double()
    groups = rows.reshape(rows.shape[0], -1, group_size)
    m = best_multipliers(groups, scale).unsqueeze(-1)
    step = scale.double().reshape(-1, 1, 1) * m
    codes = torch.clamp(torch.round(groups / step), CODE_MIN, CODE_MAX)
    return (codes * m).to(torch.int8).reshape(weight.shape)


def group_codes(q: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(codes, multipliers)`` of an int8 tensor whose every group is ``code * m`` (codes in
    [-8, 7] shaped ``[channels, columns]``, multipliers ``[channels, n_groups]``, 1..16), or
    None where one is not: what a file or an int4 runtime stores instead of ``q``."""
    if q.dtype != torch.int8 or q.dim() < 1 or q.numel() == 0:
        return None
    rows = q.reshape(q.shape[0], -1).to(torch.int64)
    if rows.shape[1] % group_size:
        return None
    groups = rows.reshape(rows.shape[0], -1, group_size)
    m = _gcd_along(groups.abs())
    m = torch.where(m == 0, torch.ones_like(m), m)
    big = m > MULTIPLIERS
    if bool(big.any()):  # a gcd above 16: a smaller divisor may still fit
        m = torch.where(big, _fitting_divisor(groups, m), m)
    codes = groups // m.unsqueeze(-1)
    if int(codes.min()) < CODE_MIN or int(codes.max()) > CODE_MAX or int(m.max()) > MULTIPLIERS:
        return None
    if not torch.equal(codes * m.unsqueeze(-1), groups):
        return None
    return codes.reshape(rows.shape).to(torch.int8), m.to(torch.uint8)


def _gcd_along(x: torch.Tensor) -> torch.Tensor:
    g = x[..., 0]
    for k in range(1, x.shape[-1]):
        g = torch.gcd(g, x[..., k])
    return g


def _fitting_divisor(groups: torch.Tensor, gcd: torch.Tensor) -> torch.Tensor:
    """Per group, the largest divisor of ``gcd`` up to 16 whose codes fit (else 0)."""
    out = torch.zeros_like(gcd)
    for m in range(MULTIPLIERS, 0, -1):
        divides = (gcd % m == 0) & (out == 0)
        codes = groups // m
        fits = (codes.amin(-1) >= CODE_MIN) & (codes.amax(-1) <= CODE_MAX)
        out = torch.where(divides & fits, torch.full_like(out, m), out)
    return torch.where(out == 0, torch.full_like(out, MULTIPLIERS + 1), out)
