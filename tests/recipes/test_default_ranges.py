"""The default recipe's activation ranges: chosen per point by measured error (range search).

Issue 27's LSTM(50, 50) with random initial states and three linear heads, 20 calibration
batches of 4, on 5 new inputs: the head on the final hidden state sees 4 values a batch, so
min-max ranges clip on new inputs (its worst leaf under 25 dB on this draw); the default
recipe's search gives that head a margin and every leaf is >= 30 dB (the issue's line). The
lowered graph is the same with either range rule: the ranges change, not the kernels.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import quantree as qt
from quantree.core.observing.search import RangeSearchObserver

from support import IssueLSTM


def _data(seed: int, n: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 10, 50, generator=g), torch.randn(1, 4, 50, generator=g),
         torch.randn(1, 4, 50, generator=g))
        for _ in range(n)
    ]  # fmt: skip


def _worst_leaf(model: nn.Module, quantized: nn.Module, inputs: list[tuple]) -> float:
    with torch.no_grad():
        return min(
            float(qt.sqnr(a, b))
            for x in inputs
            for a, b in zip(tree_leaves(model(*x)), tree_leaves(quantized(*x)), strict=True)
        )


def _model() -> tuple[nn.Module, list[tuple], list[tuple]]:
    torch.manual_seed(1)
    data = _data(101, 25)
    return IssueLSTM().eval(), data[:20], data[20:]


def test_default_holds_30_db_on_new_inputs_where_min_max_clips():
    model, calib, new = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = qt.quantize(model, calib[0], calib, progress=False)
        minmax = qt.quantize(
            model, calib[0], calib, progress=False,
            quantizer=qt.Int8Quantizer(activation_observer=qt.ObserverKind.MINMAX),
        )  # fmt: skip
    assert _worst_leaf(model, minmax, new) < 25.0
    assert _worst_leaf(model, default, new) >= 30.0


def test_default_prepares_range_search_observers():
    model, calib, _ = _model()
    prepared = qt.prepare(qt.capture(model, calib[0]), qt.Int8Quantizer())
    kinds = collections.Counter(type(m).__name__ for m in prepared.modules())
    assert kinds[RangeSearchObserver.__name__] > 0


def test_default_lowers_to_the_same_kernels_as_min_max():
    model, calib, _ = _model()

    def ops(quantizer: qt.Int8Quantizer) -> collections.Counter:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lowered = qt.quantize(
                model, calib[0], calib[:4], quantizer=quantizer, backend="cpu", progress=False
            )
        return collections.Counter(
            str(n.target) for m in lowered.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function"
        )  # fmt: skip

    minmax = qt.Int8Quantizer(activation_observer=qt.ObserverKind.MINMAX)
    assert ops(qt.Int8Quantizer()) == ops(minmax)


class ClampedReaders(nn.Module):
    """A conv read only by ReLU6 (MobileNet's blocks) and a residual add read only by ReLU
    (ResNet's): each reader keeps [0, 6] or [0, inf) of a range reaching well below 0."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.c = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = nn.functional.relu6(self.a(x))
        return self.c(torch.relu(self.b(y) + y))


def test_a_point_every_reader_clamps_is_calibrated_on_what_they_keep():
    """The conv's and the add's grids start at 0 (zero point at int8's lowest code) though
    both tensors reach below -1 on calibration; the output is >= 30 dB on new inputs."""
    torch.manual_seed(0)
    model = ClampedReaders().eval()
    g = torch.Generator().manual_seed(0)
    calib = [(torch.randn(2, 3, 16, 16, generator=g),) for _ in range(8)]
    new = [(torch.randn(2, 3, 16, 16, generator=g),) for _ in range(4)]
    prepared = qt.prepare(qt.capture(model, calib[0]), qt.Int8Quantizer())
    clamped = {m.spec.clamped for m in prepared.modules() if isinstance(m, RangeSearchObserver)}
    assert {(0.0, 6.0), (0.0, float("inf"))} <= clamped
    qt.calibrate(prepared, calib, progress=False)
    observers = [m for m in prepared.modules() if isinstance(m, RangeSearchObserver)]
    for obs in observers:
        if obs.spec.clamped is not None:
            assert int(obs.qparams().zero_point) == -128
    ref = qt.convert(prepared)
    with torch.no_grad():
        assert min(float(qt.sqnr(model(*x), ref(*x))) for x in new) >= 30.0


def test_clamped_is_a_per_tensor_interval_holding_zero():
    assert qt.QuantSpec(clamped=(0.0, 6.0)).clamped == (0.0, 6.0)
    for bad in ((1.0, 6.0), (0.0, -1.0), ("0", 6.0)):
        with pytest.raises(qt.QuantreeError, match="clamped"):
            qt.QuantSpec(clamped=bad)  # type: ignore[arg-type]
    with pytest.raises(qt.QuantreeError, match="axis"):
        qt.QuantSpec(symmetric=True, axis=0, clamped=(0.0, 6.0))
