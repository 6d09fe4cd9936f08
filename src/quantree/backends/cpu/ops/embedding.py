"""Embedding lookups in an int8 or int16 table: gather the rows, then dequantize only those.

The reference graph dequantizes the whole table and then gathers (``dequantize ->
embedding``), which on a 30522 x 128 vocabulary is most of a small BERT's time; gathering
first does the same arithmetic on the rows that are read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantree.backends.cpu.native.loader import I64, PTR
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.registry import op

SIGNATURES: dict[str, list[type]] = {
    "qt_embedding_rows": [PTR, I64, I64, PTR, I64, PTR, PTR, PTR],
    "qt_embedding_rows16": [PTR, I64, I64, PTR, I64, PTR, PTR, PTR],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES, returns={name: I64 for name in SIGNATURES})
"""(Each returns the first index out of range, or -1.)"""


@op(
    "embedding_rows(Tensor table, Tensor scale, Tensor zero_point, Tensor indices, "
    "bool per_row) -> Tensor"
)
def embedding_rows(
    table: Tensor, scale: Tensor, zero_point: Tensor, indices: Tensor, per_row: bool
) -> Tensor:
    """Rows ``indices`` of the int8 or int16 ``table``, dequantized with the same arithmetic as
    ``quantized_decomposed.dequantize_per_channel`` (axis 0) or ``_per_tensor``.

    Per row, with the dtypes lowering makes, one native call (``qt_embedding_rows``, the
    same int32 difference and float product) replaces five ATen ops, at every step of an
    unrolled decoder."""
    if per_row and native_rows(table, scale, zero_point, indices):
        ids = indices.contiguous()
        out = torch.empty(*ids.shape, table.shape[1])
        native = kernels()
        gather = (
            native.qt_embedding_rows16 if table.dtype is torch.int16 else native.qt_embedding_rows
        )
        first_bad = gather(
            table.data_ptr(), table.shape[0], table.shape[1], ids.data_ptr(), ids.numel(),
            scale.data_ptr(), zero_point.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if first_bad < 0:
            return out
        # an index out of range: torch's gather below raises its own error for it
    rows = torch.nn.functional.embedding(indices, table)
    if per_row:
        zp = zero_point[indices].unsqueeze(-1)
        return ((rows - zp) * scale[indices].unsqueeze(-1)).to(torch.float32)
    return (rows.to(torch.float32) - int(zero_point)) * float(scale)


def native_rows(table: Tensor, scale: Tensor, zero_point: Tensor, indices: Tensor) -> bool:
    """Whether the native gather computes this lookup: the dtypes lowering makes (an int8 or
    int16 table, float32 scales and int32 zero points, one per row, int64 indices), dense."""
    return (
        table.dtype in (torch.int8, torch.int16)
        and scale.dtype is torch.float32
        and zero_point.dtype is torch.int32
        and indices.dtype is torch.int64
        and table.dim() == 2
        and table.is_contiguous()
        and scale.is_contiguous()
        and zero_point.is_contiguous()
        and scale.shape == zero_point.shape == table.shape[:1]
    )


@torch.library.register_fake("quantree::embedding_rows")
def _(table, scale, zero_point, indices, per_row):
    return table.new_empty((*indices.shape, table.shape[1]), dtype=torch.float32)
