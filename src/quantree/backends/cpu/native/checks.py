"""The contracts of quantree's native entry points: what each C kernel reads and writes.

Over 400 lines: one contract per native op, each beside the C signature it protects. A new
op keeps its contract in its own module (``docs/adding-an-op.md``); these move there as
their ops are next edited.

A lowered model's graph hands the C kernels (``csrc/``, called through ``ctypes`` with raw
pointers) tensors and integers that, in a saved model, come from the file: a crafted file
could name a weight smaller than the kernel reads, an int8 buffer where floats are read, or
a kernel size that walks off the input. The kernels trust their arguments (checking in C
would cost every inner loop and touch files other work is changing), so each op checks,
before its C call, that every buffer the kernel touches lies inside a tensor of the dtype
it reads, and that every integer is in range. A violation is a ``NativeArgumentError``
naming the op and what is wrong, never a signal.

Each function here is the op's whole contract and its only statement: the op runs it on
every call made through the dispatcher (``torch.ops.quantree.*``, a graph loaded with plain
``torch.export.load``), and a lowered graph's layers (linear, conv, pooling) run it once per node,
then check per call only what the verdict rested on (``bound_calls.py``). Contiguity and
device are checked where the pointer is taken (``native/args.py``'s ``NativeArgs``: a strided
input is read through a dense copy held through the call; ``loader.ptr`` refuses one). What
an op's body would raise on arguments no contract foresees is a ``NativeArgumentError`` too
(``registry.contract_errors``), and a C++ exception is caught at the kernel's entry point
(``native/caught.py``). Region programs and cell loops, whose tables take O(length) to check,
are in ``native/program_checks.py``.

One function per op, each with the C signature it protects.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from quantree.core.errors import QuantreeError

I8, I32, I64, F32 = torch.int8, torch.int32, torch.int64, torch.float32
LIMIT = 1 << 31
"""Bound on every size and geometry integer: the kernels multiply pairs of them in int64."""
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
"""Gate blocks of each recurrent kind: the kernels' N is ``gates x hidden``."""


class NativeArgumentError(QuantreeError, ValueError):
    """Arguments a native kernel would read or write out of bounds; nothing was run."""


class NativeMemoryError(QuantreeError, MemoryError):
    """A native kernel could not allocate its workspace (``std::bad_alloc`` caught at its
    ``extern "C"`` entry point, ``QT_CATCH``); nothing was returned."""


def fail(op: str, what: str) -> NativeArgumentError:
    return NativeArgumentError(
        f"quantree.{op}: {what}; the native kernel was not run. The graph calling it was "
        "not made by quantree's lowering (or was edited): lower the model again, or re-save "
        "it with quantree.backends.save"
    )


def dtype_of(op: str, name: str, t: Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise fail(op, f"{name} is {t.dtype}, the kernel reads {dtype}")


def positive(op: str, name: str, value: float) -> None:
    """A scale the kernel divides by: finite and above 0 (0 is no grid, and 1 / 0 is a
    Python ``ZeroDivisionError`` before the kernel or an infinity inside it)."""
    if not 0.0 < value < math.inf:
        raise fail(op, f"{name} {value} is not a positive finite scale")


def vector(op: str, name: str, t: Tensor | None, dtype: torch.dtype, n: int) -> None:
    """``t`` holds at least ``n`` values of ``dtype`` (per-channel offsets, scales, biases)."""
    if t is None:
        raise fail(op, f"{name} is missing")
    if t.dtype != dtype or t.numel() < n:
        raise fail(op, f"{name} is {t.dtype} with {t.numel()} values, the kernel reads {n} {dtype}")


def geometry(
    op: str,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    rank: int,
) -> None:
    """``rank`` kernel sizes, strides and dilations >= 1, ``rank`` (or ``2 rank``: before
    and after) paddings >= 0, all below ``LIMIT``. One expression: it runs on every call."""
    if not (
        len(kernel) == len(stride) == len(dilation) == rank
        and len(padding) in (rank, 2 * rank)
        and min(*kernel, *stride, *dilation) >= 1
        and min(padding) >= 0
        and max(*kernel, *stride, *dilation, *padding) < LIMIT
    ):
        raise fail(
            op,
            f"kernel {list(kernel)}, stride {list(stride)}, dilation {list(dilation)} must be "
            f"{rank} integers in [1, 2**31) and padding {list(padding)} {rank} or {2 * rank} "
            "in [0, 2**31)",
        )


def packed(op: str, name: str, weight: Tensor, rows: int, depth: int) -> int:
    """A packed weight (``packing.pack``: ``[ceil(N / 16), Kp / 4, 64]`` int8) of at least
    ``rows`` output channels and a padded depth of at least ``depth``; returns its Kp."""
    dtype_of(op, name, weight, I8)
    if weight.dim() != 3 or weight.shape[2] != 64:
        raise fail(op, f"{name} has shape {tuple(weight.shape)}, not a packed [N/16, Kp/4, 64]")
    kp = int(weight.shape[1]) * 4
    if not 0 <= rows < LIMIT or weight.shape[0] * 16 < rows or kp < depth:
        raise fail(
            op,
            f"{name} of shape {tuple(weight.shape)} holds {weight.shape[0] * 16} channels of "
            f"depth {kp}; the kernel reads {rows} of depth {depth} or more",
        )
    return kp


def layer_constants(op: str, weight: Tensor, offset: Tensor, scale: Tensor,
                    bias: Tensor | None, rows: int, depth: int) -> None:  # fmt: skip
    """A packed weight of at least ``rows`` channels and depth ``depth``, and ``rows``
    offsets, scales (and biases): what a linear's GEMM reads besides its input."""
    packed(op, "weight", weight, rows, depth)
    vector(op, "offset", offset, I32, rows)
    vector(op, "scale", scale, F32, rows)
    if bias is not None:
        vector(op, "bias", bias, F32, rows)


# void qt_linear(const int8_t* x, int64_t M, int64_t K, int64_t N, int64_t Kp, const int8_t* w,
#                const int32_t* off, const float* scale, const float* bias, int8_t* out_q,
#                float* out_f, float inv, float zp, int relu)
def linear(x: Tensor, weight: Tensor, offset: Tensor, scale: Tensor, bias: Tensor | None,
           out_features: int) -> None:  # fmt: skip
    """x int8 [M, K]; weight packed with N >= out_features rows and Kp >= K; N offsets,
    scales (and biases)."""
    dtype_of("linear", "x", x, I8)
    if x.dim() < 1:
        raise fail("linear", "x is a scalar, the kernel reads [..., K]")
    layer_constants("linear", weight, offset, scale, bias, out_features, x.shape[-1])


# void qt_linear16(const float* x, int64_t M, int64_t K, int64_t N, int64_t Kp,
#                  const int8_t* w, const int32_t* off, const float* scale, const float* bias,
#                  float* out, float inv, float qmin, float qmax)
def linear16(x: Tensor, weight: Tensor, offset: Tensor, scale: Tensor, bias: Tensor | None,
             out_features: int) -> None:  # fmt: skip
    """x [..., K] of any dtype (the op reads it as float); the constants as ``linear``'s."""
    if x.dim() < 1:
        raise fail("linear16", "x is a scalar, the kernel reads [..., K]")
    layer_constants("linear16", weight, offset, scale, bias, out_features, x.shape[-1])


# void qt_conv2d_grouped(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W,
#     int64_t x_zp, int64_t OC, int64_t groups, int64_t KH, int64_t KW, int64_t sh, int64_t sw,
#     int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t OH, int64_t OW, int64_t Kp,
#     const int8_t* w, const int32_t* off, const float* scale, const float* bias, int8_t* out_q,
#     float* out_f, float inv, float zp, int relu)
# void qt_conv2d_depthwise(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W,
#     int64_t x_zp, int64_t KH, int64_t KW, int64_t sh, int64_t sw, int64_t ph, int64_t pw,
#     int64_t dh, int64_t dw, int64_t OH, int64_t OW, const int8_t* w, const int32_t* off,
#     const float* scale, const float* bias, int8_t* out_q, float* out_f, float inv, float zp,
#     int relu)
def conv2d(x: Tensor, weight: Tensor, offset: Tensor, scale: Tensor,
                   bias: Tensor | None, out_channels: int, kernel: list[int],
                   stride: list[int], padding: list[int], dilation: list[int],
                   x_zero_point: int, groups: int) -> None:  # fmt: skip
    """x int8 [N, C, H, W]; geometry in range (an output size below 0 is torch's error when
    the output is made); groups dividing C and out_channels; the weight ``[taps, C]``
    (depthwise) or each group packed in turn (``ceil(OCg / 16) * 16 * Kp`` bytes a group,
    Kp >= taps * C / groups)."""
    op = "conv2d"
    dtype_of(op, "x", x, I8)
    if x.dim() != 4:
        raise fail(op, f"x has shape {tuple(x.shape)}, the kernel reads [N, C, H, W]")
    geometry(op, kernel, stride, padding, dilation, 2)
    if not -128 <= x_zero_point <= 127:
        raise fail(op, f"x_zero_point {x_zero_point} is not an int8 value")
    c = int(x.shape[1])
    if not (1 <= groups < LIMIT and 0 <= out_channels < LIMIT):
        raise fail(op, f"groups {groups} and out_channels {out_channels} out of range")
    if c % groups or out_channels % groups:
        raise fail(
            op, f"groups {groups} divides neither {c} input nor {out_channels} output channels"
        )
    taps = kernel[0] * kernel[1]
    if groups == c == out_channels:  # the depthwise kernel (ops_gemm.is_depthwise)
        vector(op, "weight", weight, I8, taps * c)
    else:
        per_group = -(-out_channels // groups // 16) * 16
        kp = packed(op, "weight", weight, 0, taps * (c // groups))
        if weight.numel() < groups * per_group * kp:
            raise fail(
                op,
                f"weight of shape {tuple(weight.shape)} holds fewer than {groups} groups of "
                f"{per_group} packed channels of depth {kp}",
            )
    vector(op, "offset", offset, I32, out_channels)
    vector(op, "scale", scale, F32, out_channels)
    if bias is not None:
        vector(op, "bias", bias, F32, out_channels)


def conv1d(kernel: list[int], stride: list[int], padding: list[int], dilation: list[int]) -> None:
    """The 1-d geometry lists conv1d turns into a conv2d's (which checks the rest)."""
    geometry("conv1d", kernel, stride, padding, dilation, 1)


# void qt_conv1d(const int8_t* x_q, const float* x_f, int64_t sn, int64_t sc, int64_t sl,
#     int64_t batch, int64_t C, int64_t L, int64_t x_zp, float x_inv, float qmin, float qmax,
#     int64_t OC, int64_t groups, int64_t K, int64_t stride, int64_t pad, int64_t dil,
#     int64_t OL, int64_t Kp, const int8_t* w, const int32_t* off, const float* scale,
#     const int32_t* lo_off, const float* lo_scale, const float* bias, int8_t* out_q,
#     float* out_f, int64_t on, int64_t oc, int64_t ol, float inv, float zp, int relu)
def conv1d_strided(x: Tensor, wide: bool, weight: Tensor, offset: Tensor, scale: Tensor,
                   lo_offset: Tensor | None, lo_scale: Tensor | None, bias: Tensor | None,
                   out_channels: int, kernel: list[int], stride: list[int],
                   padding: list[int], dilation: list[int], x_zero_point: int,
                   groups: int) -> None:  # fmt: skip
    """x [N, C, L] on the CPU, int8 (float32 when ``wide``: quantized to int16 inside), read
    through its own strides (a torch view stays inside its storage); the weight, offsets and
    scales as conv2d's of height 1 (the low plane's too when ``wide``). The output is made
    by the caller from the same geometry."""
    op = "conv1d"
    dtype_of(op, "x", x, F32 if wide else I8)
    if x.dim() != 3 or not x.is_cpu:
        raise fail(
            op, f"x of shape {tuple(x.shape)} on {x.device}: the kernel reads [N, C, L], CPU"
        )
    geometry(op, kernel, stride, padding, dilation, 1)
    if not -128 <= x_zero_point <= 127:
        raise fail(op, f"x_zero_point {x_zero_point} is not an int8 value")
    c = int(x.shape[1])
    if not (1 <= groups < LIMIT and 0 <= out_channels < LIMIT):
        raise fail(op, f"groups {groups} and out_channels {out_channels} out of range")
    if c % groups or out_channels % groups:
        raise fail(
            op, f"groups {groups} divides neither {c} input nor {out_channels} output channels"
        )
    if groups == c == out_channels:  # depthwise: [taps, C]
        vector(op, "weight", weight, I8, kernel[0] * c)
    else:
        per_group = -(-out_channels // groups // 16) * 16
        kp = packed(op, "weight", weight, 0, kernel[0] * (c // groups))
        if weight.numel() < groups * per_group * kp:
            raise fail(
                op,
                f"weight of shape {tuple(weight.shape)} holds fewer than {groups} groups of "
                f"{per_group} packed channels of depth {kp}",
            )
    vector(op, "offset", offset, I32, out_channels)
    vector(op, "scale", scale, F32, out_channels)
    if wide:
        vector(op, "lo_offset", lo_offset, I32, out_channels)
        vector(op, "lo_scale", lo_scale, F32, out_channels)
    if bias is not None:
        vector(op, "bias", bias, F32, out_channels)


# void qt_matmul(const int8_t* a, const int8_t* bmat, int64_t batch, int64_t M, int64_t K,
#                int64_t N, float za, float zb, float scale, int8_t* out_q, float* out_f,
#                float inv, float zp)
def matmul(a: Tensor, b: Tensor) -> None:
    """a int8 [..., M, K], b int8 [..., K, N]."""
    dtype_of("matmul", "a", a, I8)
    dtype_of("matmul", "b", b, I8)
    if a.dim() < 2 or b.dim() < 2 or a.shape[-1] != b.shape[-2]:
        raise fail("matmul", f"shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")


# void qt_dequantize(const int8_t* q, int64_t n, float scale, float zp, float* out)
def dequantize(q: Tensor) -> None:
    dtype_of("dequantize", "q", q, I8)


# void qt_lookup(const int8_t* x, int64_t n, const int8_t* table, int8_t* out)
def lookup(x: Tensor, table: Tensor) -> None:
    """x int8 (any value indexes ``table[x + 128]``); a table of 256 int8."""
    dtype_of("lookup", "x", x, I8)
    vector("lookup", "table", table, I8, 256)


# void qt_binary(int op, const int8_t* a, const int8_t* b, int64_t n, float sa, float za,
#                float sb, float zb, float inv, float zp, int8_t* out)
def binary(kind: str, a: Tensor, b: Tensor, kinds: dict[str, int]) -> None:
    if kind not in kinds:
        raise fail("binary", f"kind {kind!r} is not one of {sorted(kinds)}")
    dtype_of("binary", "a", a, I8)
    dtype_of("binary", "b", b, I8)


# void qt_softmax(const int8_t* x, int64_t rows, int64_t cols, const float* exp_table,
#                 float inv, float zp, int8_t* out)
def softmax(x: Tensor, exp_table: Tensor) -> None:
    """x int8 (a code difference 0..255 indexes the table); 256 floats."""
    dtype_of("softmax", "x", x, I8)
    vector("softmax", "exp_table", exp_table, F32, 256)


# void qt_max_pool2d(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W,
#     int64_t KH, int64_t KW, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh,
#     int64_t dw, int64_t OH, int64_t OW, int8_t* out)
def max_pool2d(x: Tensor, kernel: list[int], stride: list[int], padding: list[int],
               dilation: list[int]) -> None:  # fmt: skip
    """x int8 [N, C, H, W]; the kernel skips taps outside the input, so any geometry of
    positive kernel/stride/dilation and padding >= 0 stays inside (products fit int64)."""
    op = "max_pool2d"
    dtype_of(op, "x", x, I8)
    if x.dim() != 4:
        raise fail(op, f"x has shape {tuple(x.shape)}, the kernel reads [N, C, H, W]")
    geometry(op, kernel, stride, padding, dilation, 2)
    if len(padding) != 2:
        raise fail(op, f"padding {list(padding)} must be 2 integers")


# void qt_avg_pool2d(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W,
#     int64_t KH, int64_t KW, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t OH,
#     int64_t OW, int64_t count_include_pad, int64_t divisor_override, float x_scale,
#     int64_t x_zp, float inv, float zp, int8_t* out)
def avg_pool2d(x: Tensor, kernel: list[int], stride: list[int], padding: list[int],
               divisor_override: int, x_zero_point: int, out_zero_point: int) -> None:  # fmt: skip
    """x int8 [N, C, H, W]; taps outside the input are skipped; a window's int32 sum of
    codes cannot overflow below 2**24 taps; padding at most half the kernel (ATen's rule:
    every window then holds an input tap, so no divisor is 0); int8 zero points."""
    op = "avg_pool2d"
    dtype_of(op, "x", x, I8)
    if x.dim() != 4:
        raise fail(op, f"x has shape {tuple(x.shape)}, the kernel reads [N, C, H, W]")
    geometry(op, kernel, stride, padding, [1, 1], 2)
    if len(padding) != 2 or kernel[0] * kernel[1] >= 1 << 24:
        raise fail(op, f"kernel {list(kernel)} / padding {list(padding)}: 2 paddings and "
                   "fewer than 2**24 taps")  # fmt: skip
    if any(2 * p > k for p, k in zip(padding, kernel, strict=True)) or divisor_override < 0:
        raise fail(op, f"padding {list(padding)} over half the kernel {list(kernel)}, or "
                   f"divisor_override {divisor_override} < 0")  # fmt: skip
    if not (-128 <= x_zero_point <= 127 and -128 <= out_zero_point <= 127):
        raise fail(op, f"zero points {x_zero_point}, {out_zero_point} are not int8 values")


# void qt_group_norm(const float* x, int64_t N, int64_t C, int64_t S, int64_t channels_last,
#     int64_t G, const float* weight, const float* bias, float eps, float* out)
def group_norm(x: Tensor, groups: int, weight: Tensor | None, bias: Tensor | None) -> None:
    """x float32 [N, C, *] on the CPU; C a multiple of ``groups`` >= 1; weight and bias
    None or C float32 values."""
    op = "group_norm"
    dtype_of(op, "x", x, F32)
    if x.dim() < 2 or not x.is_cpu or x.numel() >= LIMIT:
        raise fail(op, f"x of shape {tuple(x.shape)} on {x.device}: the kernel reads [N, C, *]"
                   " on the CPU")  # fmt: skip
    c = int(x.shape[1])
    if not 1 <= groups <= c or c % groups:
        raise fail(op, f"{c} channels do not split into {groups} groups")
    if weight is not None:
        vector(op, "weight", weight, F32, c)
    if bias is not None:
        vector(op, "bias", bias, F32, c)


def recurrent_sizes(op: str, kind: str, hidden: int, proj_size: int) -> int:
    """The gate count of ``kind``, after checking the sizes (the kernel divides by
    ``gates * hidden``)."""
    if kind not in GATES:
        raise fail(op, f"kind {kind!r} is not one of {sorted(GATES)}")
    if not 1 <= hidden < LIMIT or not 0 <= proj_size < hidden:
        raise fail(op, f"hidden {hidden} / proj_size {proj_size} out of range")
    if proj_size and kind != "lstm":
        raise fail(op, f"proj_size {proj_size} with kind {kind!r} (only an LSTM projects)")
    return GATES[kind]


# QtRnnPlan.params, per layer and direction (csrc/rnn.cpp, layer()): w_ih [N rows, Kp_ih],
# colsum_ih int32[N], ws_ih float[N], b_ih float[N], the same for hh (Kp_hh >= the hidden
# width), then with P: w_hr packed [P rows, ceil(H / 4) * 4], colsum_hr int32[P], ws_hr float[P]
def layer_params(op: str, params: Sequence[Tensor], gates: int, hidden: int, proj_size: int,
                 inputs: int, where: str) -> tuple[int, int]:  # fmt: skip
    """One layer and direction's block; returns (Kp_ih, Kp_hh)."""
    n = gates * hidden
    kp_ih = packed(op, f"w_ih{where}", params[0], n, inputs)
    vector(op, f"rowsum_ih{where}", params[1], I32, n)
    vector(op, f"scale_ih{where}", params[2], F32, n)
    vector(op, f"b_ih{where}", params[3], F32, n)
    kp_hh = packed(op, f"w_hh{where}", params[4], n, proj_size or hidden)
    vector(op, f"rowsum_hh{where}", params[5], I32, n)
    vector(op, f"scale_hh{where}", params[6], F32, n)
    vector(op, f"b_hh{where}", params[7], F32, n)
    if proj_size:
        kp_hr = -(-hidden // 4) * 4  # the kernel's own depth for w_hr
        packed(op, f"w_hr{where}", params[8], proj_size, 0)
        vector(op, f"w_hr{where}", params[8], I8, -(-proj_size // 16) * 16 * kp_hr)
        vector(op, f"rowsum_hr{where}", params[9], I32, proj_size)
        vector(op, f"scale_hr{where}", params[10], F32, proj_size)
    return kp_ih, kp_hh


# void qt_rnn(const QtRnnPlan* p, int64_t T, int64_t B, const int8_t* x, const float* x_float,
#             float x_inv, const int8_t* h0, const int8_t* c0, int8_t* y, float* y_float,
#             int8_t* hn, int8_t* cn)
def rnn_plan(kind: str, params: Sequence[Tensor], hidden: int, num_layers: int,
             bidirectional: bool, hidden_bits: int, proj_size: int, features: int,
             qparams: Sequence[float], per_layer: int) -> None:  # fmt: skip
    """Everything the plan (``ops.rnn.RnnPlan``) points the kernel at; checked when a plan
    is built (``RnnRunner.prepare``: new tensors, or tensors at a new address)."""
    op = "rnn"
    gates = recurrent_sizes(op, kind, hidden, proj_size)
    dirs = 2 if bidirectional else 1
    if not 1 <= num_layers < 1024 or hidden_bits not in (8, 16) or len(qparams) != 18:
        raise fail(
            op,
            f"num_layers {num_layers}, hidden_bits {hidden_bits} or {len(qparams)} qparams "
            "(18 expected) out of range",
        )
    for index, name in ((0, "x scale"), (14, "h_n scale"), (16, "c_n scale")):
        positive(op, f"qparams[{index}] ({name})", qparams[index])
    if len(params) != num_layers * dirs * per_layer:
        raise fail(op, f"{len(params)} params for {num_layers} x {dirs} blocks of {per_layer}")
    if not 0 <= features < LIMIT:
        raise fail(op, f"{features} input features")
    for layer in range(num_layers):
        for d in range(dirs):
            i = (layer * dirs + d) * per_layer
            inputs = features if layer == 0 else dirs * (proj_size or hidden)
            where = f" (layer {layer}, direction {d})"
            layer_params(op, params[i : i + per_layer], gates, hidden, proj_size, inputs, where)


def rnn_boundaries(x_bits: int, y_bits: int, float_input: bool, float_output: bool,
                   qparams: Sequence[float]) -> None:  # fmt: skip
    """The int16 boundaries of ``rnn``: a float input or output on a symmetric grid (the
    kernel quantizes x to int16 planes, or rounds its float output onto the grid)."""
    for bits, is_float, name, zero in (
        (x_bits, float_input, "x", 1),
        (y_bits, float_output, "y", 5),
    ):
        if bits not in (8, 16):
            raise fail("rnn", f"{name}_bits {bits}: 8 or 16 expected")
        if bits == 16 and not is_float:
            raise fail("rnn", f"{name}_bits 16 needs float_{'input' if name == 'x' else 'output'}")
        if bits == 16 and len(qparams) > zero and qparams[zero] != 0:
            raise fail("rnn", f"{name}_bits 16 reads a symmetric grid, zero point "
                       f"{qparams[zero]} given")  # fmt: skip
    if y_bits == 16 and len(qparams) > 4:
        positive("rnn", "qparams[4] (y scale)", qparams[4])


def rnn_call(x: Tensor, hx: Sequence[Tensor], float_input: bool, lstm: bool, states: int,
             cells: int, op: str = "rnn", packed: bool = False) -> None:  # fmt: skip
    """The activations of one ``qt_rnn`` call: x [T, B, K] (``packed``: the rows [N, K] of
    ``qt_rnn_packed``; int8, or float with ``float_input``), initial states of ``states`` /
    ``cells`` int8 values, or none."""
    if x.dim() != (2 if packed else 3):
        layout = "[N, K] packed rows" if packed else "[T, B, K]"
        raise fail(op, f"x has shape {tuple(x.shape)}, the kernel reads {layout}")
    if not float_input:
        dtype_of(op, "x", x, I8)
    if hx:
        vector(op, "h_0", hx[0], I8, states)
        if lstm:
            if len(hx) < 2:
                raise fail(op, "an LSTM's initial states need c_0 too")
            vector(op, "c_0", hx[1], I8, cells)


def packed_batch_sizes(op: str, batch_sizes: Tensor, rows: int) -> list[int]:
    """A packed sequence's ``batch_sizes``, as the packed kernels (``qt_rnn_packed``,
    ``qt_cell_loop_packed``) walk them: integers, each at least 1 and none above the one
    before (the sequences still running at a step are the first rows), summing to the
    ``rows`` given. Returns them; the first is the batch the states must hold."""
    one_d = batch_sizes.dim() == 1 and not batch_sizes.is_floating_point()
    sizes = [int(b) for b in batch_sizes.tolist()] if one_d else []
    if (
        not sizes
        or any(not 1 <= b <= a for a, b in zip([sizes[0], *sizes], sizes, strict=False))
        or sum(sizes) != rows
    ):
        n = batch_sizes.numel()
        shown = batch_sizes.tolist() if n <= 64 else f"of {n} values"
        raise fail(
            op,
            f"batch_sizes {shown} are not a packed sequence's (integers, each at least 1, "
            f"none above the one before) of the {rows} rows given",
        )
    return sizes


# void qt_rnn_layer(int kind, int64_t T, int64_t B, int64_t K, int64_t H, int reverse,
#     const int8_t* x, ..., const int8_t* w_ih, int64_t kp_ih, const int32_t* colsum_ih,
#     const float* ws_ih, const float* b_ih, const int8_t* w_hh, int64_t kp_hh, ...)
def rnn_cell(kind: str, x: Tensor, hx: Sequence[Tensor], params: Sequence[Tensor],
             hidden: int) -> None:  # fmt: skip
    """One step: x int8 [B, K] (or [K]), states of ``B x hidden``, one layer's 8 params."""
    op = "rnn_cell"
    gates = recurrent_sizes(op, kind, hidden, 0)
    dtype_of(op, "x", x, I8)
    if x.dim() not in (1, 2):
        raise fail(op, f"x has shape {tuple(x.shape)}, the kernel reads [B, K]")
    if len(params) != 8:
        raise fail(op, f"{len(params)} params, the kernel reads 8")
    if len(hx) < (2 if kind == "lstm" else 1):
        raise fail(op, f"{len(hx)} states for an {kind} cell")
    layer_params(op, params, gates, hidden, 0, x.shape[-1], "")


# void qt_mean_hw(const int8_t* x, int64_t N, int64_t C, int64_t H, int64_t W, int64_t sn,
#                 int64_t sc, int64_t sh, int64_t sw, float x_scale, int64_t x_zp, float inv,
#                 float zp, int8_t* out)
def mean_hw(x: Tensor, x_zero_point: int, out_zero_point: int) -> None:
    """x int8 [N, C, H, W] on the CPU, read through its own strides; H * W below 2**23, so
    a channel's int32 sum of codes cannot overflow; int8 zero points."""
    op = "mean_hw"
    dtype_of(op, "x", x, I8)
    if x.dim() != 4 or not x.is_cpu or x.shape[2] * x.shape[3] >= 1 << 23:
        raise fail(op, f"x of shape {tuple(x.shape)} on {x.device}: the kernel reads [N, C, H, W]"
                   " on the CPU with H * W below 2**23")  # fmt: skip
    if not (-128 <= x_zero_point <= 127 and -128 <= out_zero_point <= 127):
        raise fail(op, f"zero points {x_zero_point}, {out_zero_point} are not int8 values")


CONV_TRANSPOSE_CHUNK = 512
"""``CHUNK`` of ``csrc/conv_transpose.cpp``: input channels one GEMM reduces over at most."""


# void qt_conv_transpose(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W,
#                        int64_t OC, int64_t groups, int64_t KH, int64_t KW, int64_t sh,
#                        int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t OH,
#                        int64_t OW, const int8_t* w, const int32_t* col_off,
#                        const int32_t* out_off, const float* scale, const float* bias,
#                        int8_t* out_q, float* out_f, int64_t on, int64_t oc, int64_t oh_s,
#                        int64_t ow_s, float inv, float zp, int relu)
def conv_transpose(x: Tensor, weight: Tensor, col_offset: Tensor, offset: Tensor,
                   scale: Tensor, bias: Tensor | None, out_channels: int, kernel: list[int],
                   stride: list[int], padding: list[int], output_padding: list[int],
                   dilation: list[int], groups: int,
                   wide: tuple[Tensor, Tensor] | None = None) -> None:  # fmt: skip
    """x int8 [N, C, L] or [N, C, H, W] on the CPU (copied dense by the caller), or with
    ``wide`` (the low plane's column offsets, the high plane's scale) float32 of any strides
    quantized to int16 inside (``conv_transpose16``); geometry
    in range with one padding per dimension and ``0 <= output_padding < max(stride,
    dilation)`` (torch's rule), an output size of at least 0; groups dividing C and
    out_channels; the weight and column offsets as ``packed_transposed_weight`` makes them:
    per group and chunk of ``CONV_TRANSPOSE_CHUNK`` input channels, ``ceil(N / 16) * 16 * Kp``
    bytes and N offsets, N = taps * out_channels / groups."""
    op = "conv_transpose" if wide is None else "conv_transpose16"
    dtype_of(op, "x", x, I8 if wide is None else F32)
    rank = len(kernel)
    if rank not in (1, 2) or x.dim() != rank + 2 or not x.is_cpu:
        raise fail(op, f"x of shape {tuple(x.shape)} on {x.device} for a {rank}-d kernel: the "
                   "kernel reads [N, C, L] or [N, C, H, W] on the CPU")  # fmt: skip
    geometry(op, kernel, stride, padding, dilation, rank)
    if (
        len(padding) != rank
        or len(output_padding) != rank
        or not all(
            0 <= p < max(s, d) for p, s, d in zip(output_padding, stride, dilation, strict=True)
        )
    ):
        raise fail(op, f"padding {list(padding)} and output_padding {list(output_padding)}: "
                   f"{rank} each, output_padding below max(stride, dilation)")  # fmt: skip
    c = int(x.shape[1])
    if not (1 <= groups < LIMIT and 0 <= out_channels < LIMIT):
        raise fail(op, f"groups {groups} and out_channels {out_channels} out of range")
    if c % groups or out_channels % groups:
        raise fail(
            op, f"groups {groups} divides neither {c} input nor {out_channels} output channels"
        )
    size = [
        (int(i) - 1) * s - 2 * p + d * (k - 1) + q + 1
        for i, k, s, p, q, d in zip(
            x.shape[2:], kernel, stride, padding, output_padding, dilation, strict=True
        )
    ]
    accumulator = out_channels
    for extent in size:
        accumulator *= max(extent, 0)
    if min(size) < 0 or accumulator >= LIMIT:
        raise fail(op, f"output size {size} x {out_channels} channels is below 0 or too large")
    taps = kernel[0] * (kernel[1] if rank == 2 else 1)
    n = taps * (out_channels // groups)
    cg = c // groups
    depths = [
        -(-min(CONV_TRANSPOSE_CHUNK, cg - k0) // 4) * 4 for k0 in range(0, cg, CONV_TRANSPOSE_CHUNK)
    ]
    need = groups * -(-n // 16) * 16 * sum(depths)
    if weight.dtype != I8 or weight.dim() != 1 or weight.numel() < need:
        raise fail(op, f"weight is {weight.dtype} of shape {tuple(weight.shape)}; the kernel "
                   f"reads {need} packed int8 bytes")  # fmt: skip
    vector(op, "col_offset", col_offset, I32, groups * len(depths) * n)
    vector(op, "offset", offset, I32, out_channels)
    vector(op, "scale", scale, F32, out_channels)
    if wide is not None:
        vector(op, "lo_col_offset", wide[0], I32, groups * len(depths) * n)
        vector(op, "hi_scale", wide[1], F32, out_channels)
    if bias is not None:
        vector(op, "bias", bias, F32, out_channels)


# void qt_channel_affine(const int8_t* x, int64_t outer, int64_t C, int64_t inner,
#     float x_scale, float x_zp, const float* alpha, const float* beta, float inv, float zp,
#     float qmin, int8_t* out)
def channel_affine(
    x: Tensor, alpha: Tensor, beta: Tensor, x_zero_point: int, out_zero_point: int
) -> None:
    """x int8 [N, C, ...] on the CPU; alpha and beta float32 holding C values; int8 zero
    points."""
    op = "channel_affine"
    dtype_of(op, "x", x, I8)
    if x.dim() < 2 or not x.is_cpu:
        raise fail(op, f"x of shape {tuple(x.shape)} on {x.device}: the kernel reads [N, C, ...]"
                   " on the CPU")  # fmt: skip
    vector(op, "alpha", alpha, F32, int(x.shape[1]))
    vector(op, "beta", beta, F32, int(x.shape[1]))
    if not (-128 <= x_zero_point <= 127 and -128 <= out_zero_point <= 127):
        raise fail(op, f"zero points {x_zero_point}, {out_zero_point} are not int8 values")
