"""Ops that derive a call site's constants from tensors every call site shares.

Lowering records them as recipes and ``load`` runs each once (``derived.py`` says why); a
plain ``torch.export.load`` runs them on every call. Each checks its arguments, since a file
may hold them with any.
"""

from __future__ import annotations

import torch
from torch import Tensor

import quantree.backends.cpu.saved.nibbles  # noqa: F401  (registers quantree.nibbles)
from quantree.backends.cpu.native.registry import LIBRARY, op
from quantree.core.errors import QuantreeError
from quantree.core.qdq import dequantize_tensor, quantize_tensor
from quantree.core.specs import QDtype, QParams


def _check(bias: Tensor, weight_scale: Tensor, what: str) -> None:
    if bias.dim() != 1 or weight_scale.numel() not in (1, bias.numel()):
        raise QuantreeError(
            f"quantree.{what}: a bias of shape {tuple(bias.shape)} with "
            f"{weight_scale.numel()} weight scales; the file was not written by "
            "quantree.backends.save (re-save the lowered model)"
        )


def _int32_bias(bias: Tensor, weight_scale: Tensor, input_scale: float) -> tuple[Tensor, QParams]:
    """The bias on the grid input scale x weight scale, as ``convert`` rounds it
    (``product_of_scales``, then ``quantize_per_channel``)."""
    scale = (torch.tensor(input_scale, dtype=torch.float64) * weight_scale.double()).float()
    scale = scale.reshape(-1).expand(bias.numel()).contiguous()
    lo, hi = QDtype.INT32.bounds
    params = QParams(scale, torch.zeros_like(scale, dtype=torch.int64), QDtype.INT32, lo, hi, 0)
    return quantize_tensor(bias, params), params


@op("derived_bias(Tensor bias, Tensor weight_scale, float input_scale) -> Tensor")
def derived_bias(bias: Tensor, weight_scale: Tensor, input_scale: float) -> Tensor:
    """The float bias a layer adds: rounded to its int32 grid, then dequantized."""
    _check(bias, weight_scale, "derived_bias")
    q, params = _int32_bias(bias, weight_scale, input_scale)
    return dequantize_tensor(q, params).float().contiguous()


@op(
    "derived_offset(Tensor row_sums, Tensor? bias, Tensor weight_scale, float input_scale, "
    "int input_zero_point) -> Tensor"
)
def derived_offset(
    row_sums: Tensor,
    bias: Tensor | None,
    weight_scale: Tensor,
    input_scale: float,
    input_zero_point: int,
) -> Tensor:
    """A linear/conv's int32 accumulator offset: zero-point correction plus int32 bias."""
    offset = (-(int(input_zero_point) + 128) * row_sums).to(torch.int32)
    if bias is None:
        return offset
    _check(bias, weight_scale, "derived_offset")
    if bias.numel() != row_sums.numel():
        raise QuantreeError(
            f"quantree.derived_offset: {row_sums.numel()} row sums for a bias of "
            f"{bias.numel()}; the file was not written by quantree.backends.save"
        )
    q, _ = _int32_bias(bias, weight_scale, input_scale)
    return offset + q.to(torch.int32)


@op("derived_scale(Tensor weight_scale, float input_scale) -> Tensor")
def derived_scale(weight_scale: Tensor, input_scale: float) -> Tensor:
    """A linear/conv's output scale per channel: input scale x weight scale, in float32."""
    return (input_scale * weight_scale).float()


@torch.library.register_fake("quantree::derived_bias")
def _(bias, weight_scale, input_scale):
    return bias.new_empty(bias.shape, dtype=torch.float32)


@torch.library.register_fake("quantree::derived_offset")
def _(row_sums, bias, weight_scale, input_scale, input_zero_point):
    return row_sums.new_empty(row_sums.shape, dtype=torch.int32)


@torch.library.register_fake("quantree::derived_scale")
def _(weight_scale, input_scale):
    return weight_scale.new_empty(weight_scale.shape, dtype=torch.float32)


@op("derived_requant(Tensor scale, Tensor? bias, float out_scale) -> Tensor")
def derived_requant(scale: Tensor, bias: Tensor | None, out_scale: float) -> Tensor:
    """An int8-output linear's multipliers in a region program: ``scale / out_scale`` then
    ``bias / out_scale``, float32, as ``qt_cell_loop`` computes them."""
    if scale.dim() != 1 or (bias is not None and bias.shape != scale.shape) or out_scale <= 0:
        raise QuantreeError(
            f"quantree.derived_requant: scale of shape {tuple(scale.shape)}, bias of shape "
            f"{None if bias is None else tuple(bias.shape)}, output scale {out_scale}; the "
            "file was not written by quantree.backends.save (re-save the lowered model)"
        )
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(out_scale, dtype=torch.float32)
    added = torch.zeros_like(scale) if bias is None else bias
    return torch.cat([scale.float() * inv, added.float() * inv]).contiguous()


@op("derived_row_sums(Tensor packed, int rows, int groups) -> Tensor")
def derived_row_sums(packed: Tensor, rows: int, groups: int) -> Tensor:
    """int32 ``sum_k w[n, k]`` of each of ``rows`` output channels, read from the weight as
    the kernels hold it: ``[taps, channels]`` (depthwise) or each group's VNNI blocks
    ``[rows / groups / 16, K / 4, 64]`` one after the other (``packing.pack``; its padding is
    zeros, so it adds nothing)."""
    if packed.dtype != torch.int8 or groups < 1 or rows % groups:
        raise QuantreeError(
            f"quantree.derived_row_sums: a {packed.dtype} weight of shape "
            f"{tuple(packed.shape)} for {rows} rows in {groups} groups; the file was not "
            "written by quantree.backends.save (re-save the lowered model)"
        )
    if packed.dim() == 2 and packed.shape[1] == rows:
        return packed.to(torch.int32).sum(0, dtype=torch.int32)
    blocks = -(-rows // groups // 16)
    if packed.dim() != 3 or packed.shape[0] != groups * blocks or packed.shape[2] != 64:
        raise QuantreeError(
            f"quantree.derived_row_sums: a weight of shape {tuple(packed.shape)} is not "
            f"{rows} rows in {groups} groups of 16-row blocks; the file was not written by "
            "quantree.backends.save (re-save the lowered model)"
        )
    lanes = packed.reshape(groups, blocks, packed.shape[1], 16, 4).to(torch.int32)
    sums = lanes.sum((2, 4), dtype=torch.int32).reshape(groups, blocks * 16)
    return sums[:, : rows // groups].reshape(rows).contiguous()


TABLE_FUNCTIONS = {
    "requantize": lambda x: x,
    "aten.sigmoid.default": torch.sigmoid,
    "aten.sigmoid_.default": torch.sigmoid,
    "aten.tanh.default": torch.tanh,
    "aten.tanh_.default": torch.tanh,
    "aten.relu.default": torch.relu,
    "aten.relu_.default": torch.relu,
    "aten.gelu.default": torch.nn.functional.gelu,
    "aten.silu.default": torch.nn.functional.silu,
    "aten.silu_.default": torch.nn.functional.silu,
    "aten.hardswish.default": torch.nn.functional.hardswish,
    "aten.hardswish_.default": torch.nn.functional.hardswish,
    "aten.hardsigmoid.default": torch.nn.functional.hardsigmoid,
    "aten.hardsigmoid_.default": torch.nn.functional.hardsigmoid,
}
"""Functions a lookup table may be derived from, by name (a file names one of these; it
never names code to run)."""


@op(
    "derived_table(Tensor codes, str function, float in_scale, int in_zero_point, "
    "float out_scale, int out_zero_point) -> Tensor"
)
def derived_table(
    codes: Tensor,
    function: str,
    in_scale: float,
    in_zero_point: int,
    out_scale: float,
    out_zero_point: int,
) -> Tensor:
    """The int8 table of ``function`` over ``codes`` (the 256 int8 codes, one tensor the
    whole file shares: an op needs a tensor argument to be dispatched) from one grid to
    another, made with the reference's own quantize/dequantize ops, as lowering makes it."""
    fn = TABLE_FUNCTIONS.get(function)
    if fn is None or codes.dtype != torch.int8 or codes.dim() != 1:
        raise QuantreeError(
            f"quantree.derived_table: function {function!r} over {codes.dtype} codes of shape "
            f"{tuple(codes.shape)}; the file was not written by quantree.backends.save "
            "(re-save the lowered model)"
        )
    qd = torch.ops.quantized_decomposed
    values = qd.dequantize_per_tensor(codes, in_scale, in_zero_point, -128, 127, torch.int8)
    return qd.quantize_per_tensor(fn(values), out_scale, out_zero_point, -128, 127, torch.int8)


def table_recipe_args(function: str, grids: tuple[float, int, float, int]) -> tuple:
    """``derived_table``'s arguments for a table over all 256 codes."""
    return (torch.arange(-128, 128, dtype=torch.int8), function, *grids)


@torch.library.register_fake("quantree::derived_requant")
def _(scale, bias, out_scale):
    return scale.new_empty((2 * scale.shape[0],), dtype=torch.float32)


@torch.library.register_fake("quantree::derived_row_sums")
def _(packed, rows, groups):
    return packed.new_empty((rows,), dtype=torch.int32)


@torch.library.register_fake("quantree::derived_table")
def _(codes, function, in_scale, in_zero_point, out_scale, out_zero_point):
    return torch.empty_like(codes)


WIDENINGS = {
    (torch.int8, torch.int16),
    (torch.int8, torch.int32),
    (torch.int8, torch.int64),
    (torch.int16, torch.int32),
    (torch.int16, torch.int64),
    (torch.int32, torch.int64),
    (torch.float16, torch.float32),
}
"""(stored, read) dtype pairs ``widened`` converts: each holds every value of the stored type."""


MAX_EXPONENT = 64
"""The largest power of two ``widened`` scales a float by (float16 normals span 2^-14 to
2^15; a tensor whose values need more than that is not saved narrow)."""


@op("widened(Tensor narrow, ScalarType dtype, int exponent=0) -> Tensor")
def widened(narrow: Tensor, dtype: torch.dtype, exponent: int = 0) -> Tensor:
    """A constant saved in a narrower type than it is read in (``narrowed.py``), read back:
    ``narrow`` in ``dtype``, times 2^``exponent`` (exact for floats: a power of two only
    moves the exponent), so float32 values of 11 significant bits whose range is not where
    float16's is (weight scales of 1e-5) are saved in two bytes too."""
    floating = narrow.is_floating_point() and dtype.is_floating_point
    if (narrow.dtype, dtype) not in WIDENINGS or (
        exponent != 0 and not (floating and abs(exponent) <= MAX_EXPONENT)
    ):
        raise QuantreeError(
            f"quantree.widened: {narrow.dtype} to {dtype} times 2^{exponent} is not a "
            "widening; the file was not written by quantree.backends.save (re-save the "
            "lowered model)"
        )
    wide = narrow.to(dtype).contiguous()
    return (wide * 2.0**exponent).contiguous() if exponent else wide


@torch.library.register_fake("quantree::widened")
def _(narrow, dtype, exponent=0):
    return torch.empty_like(narrow, dtype=dtype)


FILLED_DTYPES = (
    torch.float32,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
)
MAX_FILLED_BYTES = 1 << 30
"""The largest constant ``filled`` makes: a file declares the size, and load allocates it."""


def filled(value: float, size: list[int], dtype: torch.dtype) -> Tensor:
    """A constant every element of which is ``value`` (a layer norm's weight at 1 and bias
    at 0, a zero bias): saved as the number and the shape, no bytes of tensor data."""
    numel = 1
    for n in size:
        numel *= n if n >= 0 else -1
    item = torch.empty((), dtype=dtype).element_size() if dtype in FILLED_DTYPES else 0
    if dtype not in FILLED_DTYPES or numel < 0 or numel * item > MAX_FILLED_BYTES:
        raise QuantreeError(
            f"quantree.filled: a {dtype} constant of shape {list(size)}; the file was not "
            "written by quantree.backends.save (re-save the lowered model)"
        )
    return torch.full(list(size), value, dtype=dtype)


# defined by hand, not with ``op``: it reads no tensor, so no backend key could dispatch it
LIBRARY.define("filled(float value, int[] size, ScalarType dtype) -> Tensor")
LIBRARY.impl("filled", filled, "CompositeExplicitAutograd")


@torch.library.register_fake("quantree::filled")
def _(value, size, dtype):
    return torch.empty(list(size), dtype=dtype)


RECIPE_OPS = (
    torch.ops.quantree.derived_bias.default,
    torch.ops.quantree.derived_offset.default,
    torch.ops.quantree.derived_scale.default,
    torch.ops.quantree.derived_requant.default,
    torch.ops.quantree.derived_row_sums.default,
    torch.ops.quantree.derived_table.default,
    torch.ops.quantree.widened.default,
    torch.ops.quantree.filled.default,
    torch.ops.quantree.nibbles.default,  # 4-bit weights, two a byte (``nibbles.py``)
    torch.ops.quantree.grouped_nibbles.default,  # grouped 4-bit weights (``nibbles.py``)
)
