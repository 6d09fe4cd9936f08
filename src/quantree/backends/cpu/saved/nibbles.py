"""4-bit weights saved two to a byte, read back as the int8 tensors the kernels compute on.

A w4a8 model (``recipes/w4a8.py``) keeps its weights as pt2e expresses 4-bit integers: int8
storage on the grid [-8, 7]. The CPU backend's int8 kernels compute on those values exactly,
so the lowered model reads int8 tensors; only the file needs the 4 bits. ``save`` writes an
int8 constant whose every value lies in [-8, 7] as ``quantree.nibbles(packed, size)`` (each
byte two values, low nibble first, two's complement), and ``load`` folds the call once
(``derived.py``), giving the same tensor bit for bit. Every nibble is a value of [-8, 7], so
what a file can get wrong is the packed tensor's type and size against the size it declares,
and the padding nibble of an odd count: each refused with a clear error (a ``BadFile`` at
load).
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native.registry import op
from quantree.core.errors import QuantreeError

NIBBLE_MIN, NIBBLE_MAX = -8, 7
MAX_NIBBLES_BYTES = 1 << 30
"""The largest tensor ``nibbles`` makes (a file declares the size; load allocates it)."""


def _refuse(what: str) -> QuantreeError:
    return QuantreeError(
        f"quantree.nibbles: {what}; the file was not written by quantree.backends.save "
        "(re-save the lowered model)"
    )


def pack_nibbles(t: Tensor) -> Tensor | None:
    """``t`` (int8, every value in [-8, 7]) two values a byte, low nibble first; None if a
    value does not fit."""
    if t.dtype != torch.int8:
        return None
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0 or int(flat.min()) < NIBBLE_MIN or int(flat.max()) > NIBBLE_MAX:
        return None
    codes = (flat.to(torch.int16) & 0xF).to(torch.uint8)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).contiguous()


@op("nibbles(Tensor packed, int[] size) -> Tensor")
def nibbles(packed: Tensor, size: list[int]) -> Tensor:
    """The int8 tensor of shape ``size`` that ``pack_nibbles`` packed into ``packed``."""
    numel = 1
    for n in size:
        if not isinstance(n, int) or n < 0:
            raise _refuse(f"a size {list(size)} with a negative or symbolic dimension")
        numel *= n
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise _refuse(f"packed nibbles of type {packed.dtype}, {packed.dim()}-d (uint8, 1-d)")
    if numel > MAX_NIBBLES_BYTES or packed.numel() != (numel + 1) // 2:
        raise _refuse(f"{packed.numel()} bytes of nibbles for a tensor of shape {list(size)}")
    bytes_ = packed.to(torch.int16)
    if numel % 2 and int(bytes_[-1]) >> 4 != 0:
        raise _refuse("a padding nibble that is not 0")
    codes = torch.stack([bytes_ & 0xF, bytes_ >> 4], dim=1).reshape(-1)[:numel]
    values = torch.where(codes > NIBBLE_MAX, codes - 16, codes)
    return values.to(torch.int8).reshape(list(size)).contiguous()


@torch.library.register_fake("quantree::nibbles")
def _(packed, size):
    return packed.new_empty(list(size), dtype=torch.int8)


# Grouped 4-bit weights (``W4A8Quantizer(group_size=...)``, ``core/observing/grouped.py``):
# each group of a channel's columns is ``code * m`` on the channel's int8 grid. The kernels'
# blocked layout (``native/packing.py``: ``[N/16, K/4, 64]``) is read back as ``[N, K]``
# rows, each group's codes packed as nibbles and its multiplier as one more nibble (``m - 9``),
# 4 + 4/group bits a weight; ``grouped_nibbles`` rebuilds the blocked tensor bit for bit.
GROUP_SIZES = (256, 128, 64, 32, 16)
"""Group sizes tried, largest first (the largest that factors every group is the smallest
file)."""
_LANES, _DEPTH = 16, 4


def _rows_of_blocks(t: Tensor) -> Tensor:
    p, q, _ = t.shape
    return t.view(p, q, _LANES, _DEPTH).permute(0, 2, 1, 3).reshape(p * _LANES, q * _DEPTH)


def _blocks_of_rows(rows: Tensor) -> Tensor:
    n, k = rows.shape
    blocks = rows.view(n // _LANES, _LANES, k // _DEPTH, _DEPTH).permute(0, 2, 1, 3)
    return blocks.contiguous().view(n // _LANES, k // _DEPTH, _LANES * _DEPTH)


def pack_grouped(t: Tensor) -> tuple[Tensor, Tensor, int] | None:
    """``(codes, multipliers, group)`` for an int8 weight in the kernels' blocked layout whose
    every group is ``code * m`` (codes and ``m - 9`` two a byte); None where none is."""
    from quantree.core.observing.grouped import group_codes

    if t.dtype != torch.int8 or t.dim() != 3 or t.shape[2] != _LANES * _DEPTH or t.numel() == 0:
        return None
    rows = _rows_of_blocks(t.detach().contiguous())
    for group in GROUP_SIZES:
        if rows.shape[1] % group:
            continue
        found = group_codes(rows, group)
        if found is None:
            continue
        codes, multipliers = found
        packed_m = pack_nibbles((multipliers.to(torch.int16) - 9).to(torch.int8))  # 1..16 -> -8..7
        packed_codes = pack_nibbles(codes)
        if packed_m is None or packed_codes is None:
            return None
        return packed_codes, packed_m, group
    return None


@op("grouped_nibbles(Tensor codes, Tensor multipliers, int[] size, int group) -> Tensor")
def grouped_nibbles(codes: Tensor, multipliers: Tensor, size: list[int], group: int) -> Tensor:
    """The blocked int8 weight of shape ``size`` that ``pack_grouped`` packed."""
    if len(size) != 3 or size[2] != _LANES * _DEPTH or not isinstance(group, int) or group < 1:
        raise _refuse(f"grouped nibbles of shape {list(size)} with group {group!r}")
    rows_n, cols = size[0] * _LANES, size[1] * _DEPTH
    if cols % group:
        raise _refuse(f"{cols} columns a row that groups of {group} do not split")
    code_values = nibbles(codes, [rows_n, cols]).to(torch.int16)
    m = nibbles(multipliers, [rows_n, cols // group]).to(torch.int16) + 9  # stored as m - 9
    values = code_values.view(rows_n, cols // group, group) * m.unsqueeze(-1)
    return _blocks_of_rows(values.reshape(rows_n, cols).to(torch.int8))


@torch.library.register_fake("quantree::grouped_nibbles")
def _(codes, multipliers, size, group):
    return codes.new_empty(list(size), dtype=torch.int8)
