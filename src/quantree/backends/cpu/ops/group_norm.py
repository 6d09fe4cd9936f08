"""Float group norm in the layout the native convolutions produce (``csrc/group_norm.cpp``).

ConvTasNet, HDemucs, wav2vec2's feature extractor and PoolFormer normalise float maps
between int8 convolutions. The convolutions hand their float outputs over channels-last,
and ATen's CPU group norm copies such a map to contiguous before normalising it: at batch 1
that copy made the norm several times as slow as on a contiguous map, a large share of
ConvTasNet's lowered time. The kernel reads a channels-last map as it lies and writes the
same layout; any other layout goes to ATen's kernel, which is as fast on a contiguous map.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.loader import F32, I64, PTR
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.registry import op

SIGNATURES: dict[str, list[type]] = {
    "qt_group_norm": [PTR, *[I64] * 5, PTR, PTR, F32, PTR],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)


def _channels_last(x: Tensor) -> bool:
    """Whether ``x`` lies channels-last (channel stride 1, positions C apart), the layout
    the kernel is for."""
    n, c = int(x.shape[0]), int(x.shape[1])
    strides = x.stride()
    if c > 1 and strides[1] == 1 and (n <= 1 or strides[0] == c * math.prod(x.shape[2:])):
        expected = c
        for size, stride in reversed(list(zip(x.shape[2:], strides[2:], strict=True))):
            if size != 1 and stride != expected:
                break
            expected *= size
        else:
            return True
    return False


@op("group_norm(Tensor x, int groups, Tensor? weight, Tensor? bias, float eps) -> Tensor")
def group_norm(
    x: Tensor, groups: int, weight: Tensor | None, bias: Tensor | None, eps: float
) -> Tensor:
    """ATen's ``group_norm`` of float ``x`` ``[N, C, *]``; the result keeps ``x``'s layout
    (channels-last or contiguous)."""
    check.group_norm(x, groups, weight, bias)
    if not _channels_last(x):
        # any other layout: ATen's kernel, as fast as this one on a contiguous map, without
        # the Python around a native call (HDemucs' 20 norms of [8-32, 2-32, 64] rows)
        return torch.group_norm(x, groups, weight, bias, eps)
    weight = None if weight is None else weight.contiguous()  # alive through the call
    bias = None if bias is None else bias.contiguous()
    out = torch.empty_like(x)
    n, c = int(x.shape[0]), int(x.shape[1])
    kernels().qt_group_norm(
        x.data_ptr(), n, c, math.prod(x.shape[2:]), 1, int(groups),
        None if weight is None else weight.data_ptr(),
        None if bias is None else bias.data_ptr(), float(eps), out.data_ptr(),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::group_norm")
def _(x, groups, weight, bias, eps):
    return torch.empty_like(x)
