"""A float group norm, its activation, a per-channel scale and a residual add in one native
call (``csrc/norm_block.cpp``).

Demucs-style residual branches (torchaudio's HDemucs ``DConv``: conv, GroupNorm, GELU, conv,
GroupNorm, GLU, LayerScale, ``+ x``) keep their norms and activations float between int16
convolutions; as ATen ops that is six calls and six passes over the map per branch, what
the float model pays too, so the int16 convolutions alone could not take the model below
float. ``passes/norm_blocks.py`` forms these calls; the op is the composition of the ATen
ops it replaces (norm, then the activation, then ``scale * y``, then ``residual + y``),
equal to them to float rounding.
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
    "qt_norm_block": [PTR, *[I64] * 4, PTR, PTR, F32, I64, PTR, PTR, PTR],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)

NONE, GELU, GLU = 0, 1, 2
"""The activations after the norm (``qt_norm_block.h``'s ``Act``): GLU halves the channels."""


def out_shape(x: Tensor, act: int) -> list[int]:
    shape = list(x.shape)
    if act == GLU:
        shape[1] //= 2
    return shape


# void qt_norm_block(const float* x, int64_t N, int64_t C, int64_t S, int64_t G,
#     const float* weight, const float* bias, float eps, int64_t act, const float* scale,
#     const float* residual, float* out)
def contract(
    x: Tensor,
    groups: int,
    weight: Tensor | None,
    bias: Tensor | None,
    act: int,
    scale: Tensor | None,
    residual: Tensor | None,
) -> None:
    """The group norm's contract (``checks.group_norm``); ``act`` one of NONE/GELU/GLU (GLU:
    an even channel count); ``scale`` None or one float32 per output channel; ``residual``
    None or a float32 tensor of the output's shape."""
    name = "norm_block"
    check.group_norm(x, groups, weight, bias)
    if act not in (NONE, GELU, GLU) or (act == GLU and int(x.shape[1]) % 2):
        raise check.fail(name, f"act {act} on {int(x.shape[1])} channels: 0, 1 or 2 (GLU: even)")
    shape = out_shape(x, act)
    if scale is not None and (scale.dtype != torch.float32 or scale.numel() != shape[1]):
        raise check.fail(name, f"scale is {scale.dtype} with {scale.numel()} values, the kernel "
                         f"reads {shape[1]} float32")  # fmt: skip
    if residual is not None:
        check.dtype_of(name, "residual", residual, torch.float32)
        if list(residual.shape) != shape:
            raise check.fail(name, f"residual of shape {tuple(residual.shape)}, the output's "
                             f"is {tuple(shape)}")  # fmt: skip


def composed(
    x: Tensor,
    groups: int,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    act: int,
    scale: Tensor | None,
    residual: Tensor | None,
) -> Tensor:
    """The ATen ops the call replaces, in the graph's order (a layout the kernel does not
    read runs as these)."""
    y = torch.group_norm(x, groups, weight, bias, eps)
    if act == GELU:
        y = torch.nn.functional.gelu(y)
    elif act == GLU:
        y = torch.nn.functional.glu(y, 1)
    if scale is not None:
        y = scale.reshape([-1] + [1] * (y.dim() - 2)) * y
    if residual is not None:
        y = residual + y
    return y


@op(
    "norm_block(Tensor x, int groups, Tensor? weight, Tensor? bias, float eps, int act, "
    "Tensor? scale, Tensor? residual) -> Tensor"
)
def norm_block(
    x: Tensor,
    groups: int,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    act: int,
    scale: Tensor | None,
    residual: Tensor | None,
) -> Tensor:
    """``residual + scale * act(group_norm(x, groups, weight, bias, eps))``, act none, GELU
    (erf) or GLU over the channels, ``scale`` per output channel; float ``[N, C, *]``."""
    contract(x, groups, weight, bias, act, scale, residual)
    if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
        return composed(x, groups, weight, bias, eps, act, scale, residual)
    weight = None if weight is None else weight.contiguous()  # alive through the call
    bias = None if bias is None else bias.contiguous()
    scale = None if scale is None else scale.contiguous()
    out = torch.empty(out_shape(x, act), dtype=torch.float32)
    n, c = int(x.shape[0]), int(x.shape[1])
    kernels().qt_norm_block(
        x.data_ptr(), n, c, math.prod(x.shape[2:]), int(groups),
        None if weight is None else weight.data_ptr(),
        None if bias is None else bias.data_ptr(), float(eps), int(act),
        None if scale is None else scale.data_ptr(),
        None if residual is None else residual.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::norm_block")
def _(x, groups, weight, bias, eps, act, scale, residual):
    return x.new_empty(out_shape(x, act))
