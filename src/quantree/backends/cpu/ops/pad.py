"""int8 reflect / replicate padding of the last dimension (``csrc/pad.cpp``).

Codecs reflect-pad every convolution's input (Encodec's 25 pads a call, on the int8 output
of the layer before); ATen pads int8 with a scalar loop per element, slower again on a
convolution's channels-last output. The kernel copies each row once and writes its few edge
codes, reading the input through its strides. Any other call (other modes, several padded
dimensions, negative pads, pads ATen refuses) runs ``aten.pad`` itself, errors included.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native.loader import I64, PTR
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.registry import op

SIGNATURES: dict[str, list[type]] = {
    "qt_pad_last_i8": [PTR, *[I64] * 9, PTR],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)

MODES = {"reflect": 0, "replicate": 1}
"""The modes the kernel writes: their ``replicate`` flag."""


@op("pad_last(Tensor x, SymInt[] pad, str mode) -> Tensor")
def pad_last(x: Tensor, pad: list[int], mode: str) -> Tensor:
    """``aten.pad(x, pad, mode)``: natively for int8 ``x`` of rank 2 or 3 (ATen's) with
    ``pad`` the two non-negative sizes of its last dimension, in ``reflect`` (each below that
    dimension) or ``replicate`` (a non-empty one); a contiguous result, as ATen's."""
    length = int(x.shape[-1]) if x.dim() else 0
    native = (
        x.dtype == torch.int8 and 2 <= x.dim() <= 3 and mode in MODES and len(pad) == 2
        and min(pad) >= 0 and length >= 1 and (mode == "replicate" or max(pad) < length)
    )  # fmt: skip
    if not native:
        return torch.ops.aten.pad.default(x, pad, mode)
    left, right = int(pad[0]), int(pad[1])
    x3 = x.unsqueeze(0) if x.dim() == 2 else x
    n, c = int(x3.shape[0]), int(x3.shape[1])
    out = torch.empty((*x.shape[:-1], left + length + right), dtype=torch.int8)
    if out.numel():
        kernels().qt_pad_last_i8(
            x3.data_ptr(), n, c, length, *x3.stride(), left, right, MODES[mode], out.data_ptr()
        )
    return out


@torch.library.register_fake("quantree::pad_last")
def _(x, pad, mode):
    return torch.ops.aten.pad.default(x, pad, mode)
