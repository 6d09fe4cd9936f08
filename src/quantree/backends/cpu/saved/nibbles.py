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
