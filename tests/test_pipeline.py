"""The one-call pipeline equals the step-by-step one; calibration takes any iterable."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.export import Dim
from torch.utils.data import DataLoader, TensorDataset

import quantree as qt

from support import batches, output_sqnrs, run


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval()


def test_quantize_equals_the_steps():
    model, data = _model(), batches((4, 6))
    _, stepwise = run(model, data)
    one_call = qt.quantize(model, data[0], data, progress=False, backend="reference")
    with torch.no_grad():
        assert torch.equal(stepwise(*data[0]), one_call(*data[0]))


def test_calibration_accepts_a_dataloader_and_bare_tensors(capsys):
    model, data = _model(), batches((4, 6))
    loader = DataLoader(TensorDataset(torch.cat([d[0] for d in data])), batch_size=4)
    from_loader = qt.quantize(model, data[0], loader, backend="reference")
    from_tensors = qt.quantize(
        model, data[0], [d[0] for d in data], progress=False, backend="reference"
    )
    with torch.no_grad():
        assert torch.equal(from_loader(*data[0]), from_tensors(*data[0]))
    assert "calibrating" in capsys.readouterr().err


def test_reference_backend_leaves_the_graph_as_convert_made_it():
    model, data = _model(), batches((4, 6))
    _, ref = run(model, data)
    assert qt.lower(ref, qt.REFERENCE) is ref


def test_dynamic_batch_dimension_through_quantize():
    model, data = _model(), batches((4, 6), n=6)
    varied = [(torch.randn(b, 6),) for b in (1, 3, 8)] + data
    with pytest.raises(qt.QuantreeError, match=r"batch 0 .*dynamic_shapes="):
        qt.quantize(
            model, data[0], varied, dynamic_batch=False, progress=False, backend="reference"
        )
    # the batch varies
    by_default = qt.quantize(model, data[0], varied, progress=False, backend="reference")
    batch = {"input": {0: Dim("batch")}}  # nn.Sequential's argument is named input
    one_call = qt.quantize(
        model, data[0], varied, dynamic_shapes=batch, progress=False, backend="reference"
    )
    gm = qt.capture(model, data[0], dynamic_shapes=batch)
    prepared = qt.prepare(gm, qt.Int8Quantizer())
    qt.calibrate(prepared, varied, progress=False)
    stepwise = qt.convert(prepared)
    x = torch.randn(5, 6)
    with torch.no_grad():
        assert torch.equal(one_call(x), stepwise(x))
        assert torch.equal(by_default(x), stepwise(x))
        rows = torch.cat([one_call(x[i : i + 1]) for i in range(5)])
        assert torch.equal(one_call(x), rows)  # each sample quantized as on its own
    assert min(output_sqnrs(model, one_call, (x,))) >= 25.0


class _Keyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, *, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(y)


def test_keyword_example_inputs_and_args_kwargs_calibration_pairs():
    torch.manual_seed(0)
    model, data = _Keyword().eval(), batches((4, 6), (4, 6))
    pairs = [((x,), {"y": y}) for x, y in data]
    one_call = qt.quantize(
        model,
        (data[0][0],),
        pairs,
        example_kwargs={"y": data[0][1]},
        progress=False,
        backend="reference",
    )
    prepared = qt.prepare(qt.capture(model, (data[0][0],), {"y": data[0][1]}), qt.Int8Quantizer())
    for x, y in data:
        prepared(x, y=y)
    stepwise = qt.convert(prepared)
    x, y = data[0]
    with torch.no_grad():
        assert torch.equal(one_call(x, y=y), stepwise(x, y=y))
    with pytest.raises(qt.QuantreeError, match=r"batch 0 has keyword argument\(s\) none.*\['y'\]"):
        qt.calibrate(prepared, [(x,)], progress=False)
    # the fix it names: (args, kwargs) pairs
    with pytest.raises(
        qt.QuantreeError, match=r"\(args, kwargs\) pair, e\.g\. \[\(\(x,\), \{'y': \.\.\.\}\)\]"
    ):
        qt.calibrate(prepared, [(x,)], progress=False)
    qt.calibrate(prepared, [((x,), {"y": y})], progress=False)


class _LstmHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.fc = nn.LSTM(6, 8, num_layers=2), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.lstm(x)[0])


@pytest.mark.parametrize(
    ("make", "shape", "recurrent"),
    [
        (_model, (4, 6), qt.RecurrentMode.WHOLE),
        (_LstmHead, (5, 2, 6), qt.RecurrentMode.WHOLE),
        (_LstmHead, (5, 2, 6), qt.RecurrentMode.CELLS),
    ],
)
def test_prepared_and_converted_models_deep_copy_and_compute_alike(make, shape, recurrent):
    """Groups with derived biases live in ``gm.meta``, which ``GraphModule`` deep-copies."""
    torch.manual_seed(0)
    model, data = make().eval(), batches(shape, n=4)
    prepared = qt.prepare(qt.capture(model, data[0]), qt.Int8Quantizer(recurrent=recurrent))
    twin = copy.deepcopy(prepared)
    qt.calibrate(prepared, data, progress=False)
    qt.calibrate(twin, data, progress=False)
    ref = qt.convert(prepared)
    copies = (qt.convert(twin), copy.deepcopy(ref), qt.convert(copy.deepcopy(prepared)))
    with torch.no_grad():
        assert torch.equal(prepared(*data[0]), twin(*data[0]))
        for other in copies:
            assert torch.equal(ref(*data[0]), other(*data[0]))
