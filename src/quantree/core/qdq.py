"""The q/dq vocabulary: pt2e's ``quantized_decomposed`` ops, read and written in one place.

The reference graph is pt2e's dialect, so whatever reads ``convert_pt2e`` output reads ours.
Every pass that makes or matches these ops uses the names and helpers here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.ao.quantization.fx._decomposed
import torch.fx as fx

from quantree.core.graphs import fetch_attr
from quantree.core.observing.grouped import quantize_grouped
from quantree.core.specs import QDtype, QParams

qd = torch.ops.quantized_decomposed
QUANTIZE_PER_TENSOR = qd.quantize_per_tensor.default
DEQUANTIZE_PER_TENSOR = qd.dequantize_per_tensor.default
QUANTIZE_PER_CHANNEL = qd.quantize_per_channel.default
DEQUANTIZE_PER_CHANNEL = qd.dequantize_per_channel.default
QUANTIZE_OPS = (QUANTIZE_PER_TENSOR, QUANTIZE_PER_CHANNEL)
DEQUANTIZE_OPS = (DEQUANTIZE_PER_TENSOR, DEQUANTIZE_PER_CHANNEL)
PER_CHANNEL_OPS = (QUANTIZE_PER_CHANNEL, DEQUANTIZE_PER_CHANNEL)
_DTYPES = {q.torch_dtype: q for q in QDtype}


def is_quantize(node: object) -> bool:
    return isinstance(node, fx.Node) and node.target in QUANTIZE_OPS


def is_dequantize(node: object) -> bool:
    return isinstance(node, fx.Node) and node.target in DEQUANTIZE_OPS


def quantize_tensor(x: torch.Tensor, p: QParams) -> torch.Tensor:
    """``x`` as integers on ``p``'s grid, with the same arithmetic as the graph's q op.

    int32 saturates: the q op clamps in float32, where ``2**31 - 1`` rounds up to ``2**31``,
    which its cast wraps to ``-2**31``; a positive value past the range is kept at the top
    instead. (convert does not clamp a derived bias this way: one past its range stays float,
    ``grouping/overflow.py``.)
    """
    if p.group_size is not None:
        return quantize_grouped(x, p.scale, p.group_size)
    if p.axis is None:
        q = qd.quantize_per_tensor(
            x, float(p.scale), int(p.zero_point), p.quant_min, p.quant_max, p.dtype.torch_dtype
        )
    else:
        q = qd.quantize_per_channel(
            x, p.scale, p.zero_point, p.axis, p.quant_min, p.quant_max, p.dtype.torch_dtype
        )
    if p.dtype.torch_dtype == torch.int32 and p.quant_max == torch.iinfo(torch.int32).max:
        q = torch.where((q == torch.iinfo(torch.int32).min) & (x > 0), p.quant_max, q)
    return q


def dequantize_tensor(q: torch.Tensor, p: QParams) -> torch.Tensor:
    """The float values the graph's dq op gives for ``q``."""
    if p.axis is None:
        return qd.dequantize_per_tensor(
            q, float(p.scale), int(p.zero_point), p.quant_min, p.quant_max, p.dtype.torch_dtype
        )
    return qd.dequantize_per_channel(
        q, p.scale, p.zero_point, p.axis, p.quant_min, p.quant_max, p.dtype.torch_dtype
    )


def params_of(node: fx.Node, gm: fx.GraphModule) -> QParams:
    """The QParams carried by the arguments of a q or dq node of ``gm``."""
    args: Any = node.args
    if node.target not in PER_CHANNEL_OPS:
        _, scale, zp, qmin, qmax, dtype = args[:6]
        return QParams(
            torch.tensor(float(scale)), torch.tensor(int(zp)), _DTYPES[dtype], qmin, qmax, None
        )
    _, scale, zp, axis, qmin, qmax, dtype = args[:7]
    return QParams(
        fetch_attr(gm, str(scale.target)),
        fetch_attr(gm, str(zp.target)),
        _DTYPES[dtype],
        qmin,
        qmax,
        int(axis),
    )
