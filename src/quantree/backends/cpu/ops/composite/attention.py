"""Float attention as one native call: ``softmax(q @ k^T * scale + mask) @ v``.

The default recipe keeps attention's matmuls, scale, mask and softmax float (the int8 grid
on the probabilities cost BERT several dB), so on the CPU they ran as a dozen ATen calls
with Python between them, and the heads' transposes and copies around them.
``passes/attention.py`` puts this op in their place; the kernel (``csrc/attention.cpp``)
reads q, k and v through their strides and can write its output with the heads innermost,
so the transposes and the copy before the output projection become views.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native.checks import F32, LIMIT, fail
from quantree.backends.cpu.native.loader import F32 as C_F32
from quantree.backends.cpu.native.loader import I64, PTR
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.registry import op

SIGNATURES: dict[str, list[type]] = {
    "qt_attention": [PTR, PTR, PTR, PTR, PTR, *[I64] * 6, PTR, C_F32],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)


def out_strides(b: int, h: int, sq: int, dv: int, heads_last: bool) -> tuple[int, ...]:
    """The output's strides: ``[B, H, Sq, Dv]`` dense, or laid out as ``[B, Sq, H, Dv]``
    (``heads_last``), which the usual ``transpose(1, 2)`` then reads as a dense tensor."""
    if heads_last:
        return (sq * h * dv, dv, h * dv, 1)
    return (h * sq * dv, sq * dv, dv, 1)


# void qt_attention(const float* q, const float* k, const float* v, const float* mask,
#                   float* out, int64_t B, int64_t H, int64_t Sq, int64_t Sk, int64_t D,
#                   int64_t Dv, const int64_t* strides, float scale)
def check_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> None:
    """q ``[B, H, Sq, D]``, k ``[B, H, Sk, D]``, v ``[B, H, Sk, Dv]``, float32 on the CPU;
    the mask (if any) float32 of at most four dimensions, broadcastable to ``[B, H, Sq, Sk]``
    (the kernel indexes it through the broadcast's strides); every size below ``LIMIT``."""
    name = "attention"
    for what, t in (("q", q), ("k", k), ("v", v), ("mask", mask)):
        if t is None:
            continue
        if t.dtype != F32 or not t.is_cpu:
            raise fail(name, f"{what} is {t.dtype} on {t.device}, the kernel reads float32 (CPU)")
        if t.numel() >= LIMIT:
            raise fail(name, f"{what} of shape {tuple(t.shape)} has 2**31 elements or more")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        raise fail(name, f"q, k, v of shapes {shapes}: the kernel reads [batch, heads, rows, "
                   "features]")  # fmt: skip
    b, h, sq, d = q.shape
    sk = k.shape[2]
    if tuple(k.shape) != (b, h, sk, d) or tuple(v.shape[:3]) != (b, h, sk):
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        raise fail(name, f"{shapes} do not share batch and heads, k's features are not q's, "
                   "or v's rows not k's")  # fmt: skip
    scores = (b, h, sq, sk)
    if mask is not None and (
        mask.dim() > 4
        or any(m not in (1, n) for m, n in zip(mask.shape[::-1], scores[::-1], strict=False))
    ):
        raise fail(name, f"mask of shape {tuple(mask.shape)} does not broadcast to the "
                   f"scores' {scores}")  # fmt: skip


def last_dense(t: Tensor) -> Tensor:
    """``t`` with a unit stride along its last dimension (a copy only when it has not)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


@op("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool heads_last) -> Tensor")
def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, heads_last: bool
) -> Tensor:
    """``softmax(q @ k^T * scale + mask, -1) @ v`` over ``[B, H, rows, features]``."""
    check_attention(q, k, v, mask)
    b, h, sq, _ = q.shape
    sk, dv = k.shape[2], v.shape[3]
    q, k, v = last_dense(q), last_dense(k), last_dense(v)
    strides = [*q.stride(), *k.stride(), *v.stride()]
    if mask is not None:
        mask = mask.expand(b, h, sq, sk)
        if mask.stride(-1) != 1 and sk > 1:
            mask = mask.contiguous()  # one mask value for all keys: the kernel reads rows
        strides += mask.stride()
    else:
        strides += [0, 0, 0, 0]
    shape = (b, h, sq, dv)
    out = torch.empty_strided(shape, out_strides(*shape, heads_last), dtype=torch.float32)
    strides += out.stride()
    table = torch.tensor(strides, dtype=torch.int64)
    kernels().qt_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), None if mask is None else mask.data_ptr(),
        out.data_ptr(), b, h, sq, sk, q.shape[3], dv, table.data_ptr(), float(scale),
    )  # fmt: skip
    return out


@torch.library.register_fake("quantree::attention")
def _(q, k, v, mask, scale, heads_last):
    shape = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    return q.new_empty_strided(shape, out_strides(*shape, heads_last))
