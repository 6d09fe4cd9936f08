"""int8 global average pooling: the mean over H and W of ``[N, C, H, W]`` (``csrc/mean.cpp``).

Squeeze-excite blocks (EfficientNet, RegNet-Y, MobileNetV3) and classifier heads average a
whole feature map into C values. Without a kernel that was a float island: the int8 map
dequantized to a float copy, averaged, the C results quantized. Here the codes are summed
in int32 in one pass over the map as it lies (channels-last from a convolution, or
contiguous), and only the C sums are converted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.loader import library
from quantree.backends.cpu.native.registry import inverse, op


@op(
    "mean_hw(Tensor x, float x_scale, int x_zero_point, float out_scale, int out_zero_point, "
    "bool keepdim) -> Tensor"
)
def mean_hw(
    x: Tensor,
    x_scale: float,
    x_zero_point: int,
    out_scale: float,
    out_zero_point: int,
    keepdim: bool,
) -> Tensor:
    """int8 ``x`` ``[N, C, H, W]`` averaged over H and W onto the output grid: ``[N, C, 1, 1]``
    (``keepdim``) or ``[N, C]``."""
    check.mean_hw(x, x_zero_point, out_zero_point)
    n, c, h, w = x.shape
    out = torch.empty((n, c), dtype=torch.int8)
    library().qt_mean_hw(
        x.data_ptr(), n, c, h, w, *x.stride(), float(x_scale), int(x_zero_point),
        inverse(out_scale), float(out_zero_point), out.data_ptr(),
    )  # fmt: skip
    return out.view(n, c, 1, 1) if keepdim else out


@torch.library.register_fake("quantree::mean_hw")
def _(x, x_scale, x_zero_point, out_scale, out_zero_point, keepdim):
    shape = (x.shape[0], x.shape[1], 1, 1) if keepdim else (x.shape[0], x.shape[1])
    return x.new_empty(shape, dtype=torch.int8)
