"""Shared helpers for the tests: run the pipeline and read the converted graph."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

import quantree as qt

qd = torch.ops.quantized_decomposed


def batches(*shapes: tuple[int, ...], n: int = 20, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(*s, generator=g) for s in shapes) for _ in range(n)]


def run(model: torch.nn.Module, data: list[tuple[Any, ...]], quantizer: qt.Quantizer | None = None):
    """capture -> prepare -> calibrate -> convert; returns (prepared, converted)."""
    gm = qt.capture(model, data[0])
    prepared = qt.prepare(gm, quantizer or qt.Int8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    return prepared, qt.convert(prepared)


def for_onnxruntime(**options: Any) -> qt.Int8Quantizer:
    """The int8 recipe for a model that runs in ONNX Runtime's integer operators on this CPU:
    7-bit weights where its kernels saturate on full-range ones (x86 without VNNI), the fix
    ``onnx_session``'s warning names; full range elsewhere."""
    from quantree.backends.onnx.ort_kernels import ort_int8_saturates

    return qt.Int8Quantizer(reduce_range=ort_int8_saturates(), **options)


def onnxruntime_band_db(band_db: float) -> float:
    """How far under the reference graph's SQNR ONNX Runtime's integer operators may land: the
    band measured at full-range weights, and 1.5 dB more where ``for_onnxruntime`` narrows them
    to 7 bits (measured on a Zen 3: an LSTM's ``DynamicQuantizeLSTM`` 1.0-1.7 dB under its
    7-bit reference at weight ranges 15-63, none of it saturation)."""
    from quantree.backends.onnx.ort_kernels import ort_int8_saturates

    return band_db + (1.5 if ort_int8_saturates() else 0.0)


def leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def output_sqnrs(model: torch.nn.Module, converted: fx.GraphModule, args: tuple) -> list[float]:
    with torch.no_grad():
        ref, got = leaves(model(*args)), leaves(converted(*args))
    assert len(ref) == len(got)
    return [qt.sqnr(r, g) for r, g in zip(ref, got, strict=True) if r.is_floating_point()]


def assert_prepared_exact(model: torch.nn.Module, prepared: fx.GraphModule, args: tuple) -> None:
    with torch.no_grad():
        ref, got = model(*args), prepared(*args)
    assert tree_flatten(ref)[1] == tree_flatten(got)[1]
    for r, g in zip(leaves(ref), leaves(got), strict=True):
        assert torch.equal(r, g)


def calls(gm: fx.GraphModule, target: Any) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


QUANTIZE = (qd.quantize_per_tensor.default, qd.quantize_per_channel.default)
DEQUANTIZE = (qd.dequantize_per_tensor.default, qd.dequantize_per_channel.default)


def qparams_of(q: fx.Node) -> tuple[float, int, torch.dtype]:
    """(scale, zero_point, dtype) of a per-tensor quantize or dequantize node."""
    _, scale, zp, _, _, dtype = q.args[:6]
    return float(scale), int(zp), dtype


def assert_no_weight_dequantized_per_call(lowered: torch.nn.Module) -> None:
    """Fail if a float op of ``lowered`` (nested graphs too) reads ``dequantize(int8
    constant)``: the weight would be dequantized on every call
    (``passes/dequantized_constants.py`` folds each at lowering)."""
    from quantree.backends.cpu.passes.float_report import float_ops

    costly = [f"{where}.{node.name}" for where, node, constant in float_ops(lowered) if constant]
    assert not costly, f"float ops dequantize an int8 constant per call: {costly}"


class IssueLSTM(torch.nn.Module):
    """Issue 27's LSTM(50, 50) with random initial states and three linear consumers (out,
    h, c): ranges calibration saw few values of (a batch's final states)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(50, 50, batch_first=True)
        self.out = torch.nn.Linear(50, 10)
        self.h, self.c = torch.nn.Linear(50, 10), torch.nn.Linear(50, 10)

    def forward(self, x, h, c):
        y, (hn, cn) = self.rnn(x, (h, c))
        return self.out(y), self.h(hn), self.c(cn)


class SortedPacked(torch.nn.Module):
    """The outside model ``gru_packed`` (benchmarks/outside_models.py): a 2-layer bidirectional
    GRU over lengths given sorted (``enforce_sorted=True``, the default), padded back to the
    input's length."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = torch.nn.GRU(8, 12, num_layers=2, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(24, 5)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
        out, _ = self.gru(packed)
        out, _ = torch.nn.utils.rnn.pad_packed_sequence(
            out, batch_first=True, total_length=x.shape[1]
        )
        return self.head(out)


def selective_scan(decay: torch.Tensor, drive: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The toy selective scans' loop over time (Mamba-1's sequential path in miniature):
    ``decay``, ``drive`` ``[B, 4, T, 3]``, read out by ``x[:, t, 2:5]``; ``[B, 4, T]``."""
    state = torch.zeros(x.shape[0], 4, 3)
    ys = []
    for t in range(x.shape[1]):
        state = decay[:, :, t] * state + drive[:, :, t]
        ys.append(torch.matmul(state, x[:, t, 2:5, None])[:, :, 0])
    return torch.stack(ys, -1)


class Tokens(torch.nn.Module):
    """Token ids -> embedding -> linear: an integer input that is often a slice of a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8, 20)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))
