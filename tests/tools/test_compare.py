"""qt.compare: per-tensor SQNR for every Value, every leaf of nested outputs, worst first."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.tools.compare import RowKind

from support import batches, run


class LSTMThreeHeads(nn.Module):
    """Output, h_n and c_n each read by a Linear: all three LSTM leaves are Values."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(12, 16, 1)
        self.a, self.b, self.c = nn.Linear(16, 4), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, c) = self.lstm(x)
        return self.a(out).sum(0) + self.b(h[0]) + self.c(c[0])


class NestedOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8, 1)

    def forward(self, x: torch.Tensor):
        out, (h, c) = self.lstm(x)
        return out, (h, c)


class MaxIndices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        values, indices = torch.max(self.fc(x), dim=1)
        return values, indices


def _data(*shape: int, n: int = 8) -> list[tuple[torch.Tensor, ...]]:
    return batches(shape, n=n)


def test_every_lstm_leaf_has_a_row_worst_first() -> None:
    torch.manual_seed(0)
    model = LSTMThreeHeads().eval()
    data = _data(5, 3, 12)
    _, converted = run(model, data)
    result = qt.compare(model, converted, data[:3])
    names = [r.name for r in result.rows]
    for leaf in ("lstm[0]", "lstm[1]", "lstm[2]"):
        assert leaf in names
        row = result.row(leaf)
        assert row.kind is RowKind.VALUE and row.quantization == "int8"
        assert 15.0 < row.sqnr_db < math.inf
    finite = [r.sqnr_db for r in result.rows]
    assert finite == sorted(finite)  # worst first
    assert result.batches == 3
    assert [r.kind for r in result.outputs] == [RowKind.OUTPUT]
    weights = [r for r in result.rows if r.kind is RowKind.WEIGHT]
    assert any("lstm.weight_ih_l0" in r.name and "per-channel" in r.quantization for r in weights)


def test_render_and_records() -> None:
    torch.manual_seed(0)
    model = LSTMThreeHeads().eval()
    data = _data(5, 3, 12)
    _, converted = run(model, data)
    result = qt.compare(model, converted, data[:2])
    text = result.render()
    assert text.splitlines()[0].startswith("per-tensor SQNR over 2 batch(es)")
    assert "lstm[2]" in text and "SQNR dB" in text
    assert str(result) == text
    assert "more" in result.render(limit=3)
    records = result.records()
    assert len(records) == len(result.rows)
    assert set(records[0]) == {
        "name", "node", "path", "kind", "op", "quantization", "shape", "sqnr_db", "steps_sqnr_db",
        "layer", "series", "module", "clamped",
    }  # fmt: skip
    lstm1 = next(r for r in records if r["name"] == "lstm[1]")
    assert lstm1["path"] == [1] and lstm1["node"] == "lstm"


def test_nested_outputs_get_one_row_per_leaf() -> None:
    torch.manual_seed(0)
    model = NestedOut().eval()
    data = _data(6, 2, 8)
    _, converted = run(model, data)
    result = qt.compare(model, converted, data[:2])
    outputs = sorted(r.name for r in result.outputs)
    assert outputs == ["output[0]", "output[1][0]", "output[1][1]"]
    assert all(r.sqnr_db > 20 for r in result.outputs)


def test_integer_tensors_are_skipped() -> None:
    torch.manual_seed(0)
    model = MaxIndices().eval()
    data = _data(4, 8)
    _, converted = run(model, data)
    result = qt.compare(model, converted, data[:2])
    max_rows = [r for r in result.rows if r.op.startswith("aten.max")]
    assert [r.path for r in max_rows] == [(0,)]  # the values leaf only, never the indices
    assert [r.name for r in result.outputs] == ["output[0]"]  # the indices output is skipped


def test_energies_accumulate_over_batches() -> None:
    torch.manual_seed(0)
    model = LSTMThreeHeads().eval()
    data = _data(5, 3, 12)
    _, converted = run(model, data)
    result = qt.compare(model, converted, data[:3])
    signal = noise = 0.0
    with torch.no_grad():
        for (x,) in data[:3]:
            ref, got = model(x).double(), converted(x).double()
            signal += float(ref.pow(2).sum())
            noise += float((ref - got).pow(2).sum())
    expected = 10 * math.log10(signal / noise)
    assert result.outputs[0].sqnr_db == pytest.approx(expected, abs=1e-6)


def test_prepared_model_is_exact_everywhere() -> None:
    torch.manual_seed(0)
    model = LSTMThreeHeads().eval()
    data = _data(5, 3, 12)
    prepared, _ = run(model, data)
    result = qt.compare(qt.capture(model, data[0]), prepared, data[:2])
    assert result.rows and all(r.sqnr_db == math.inf for r in result.rows)


def test_any_module_gets_output_rows() -> None:
    torch.manual_seed(0)
    model = LSTMThreeHeads().eval()
    data = _data(5, 3, 12)
    _, converted = run(model, data)

    class Wrapped(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return converted(x)

    result = qt.compare(model, Wrapped(), data[:2])
    assert [r.kind for r in result.rows] == [RowKind.OUTPUT]
    assert result.rows[0].sqnr_db == pytest.approx(
        qt.compare(model, converted, data[:2]).outputs[0].sqnr_db
    )


def test_cells_mode_rows_follow_the_surviving_leaves() -> None:
    torch.manual_seed(0)
    model = LSTMThreeHeads().eval()
    data = _data(5, 3, 12)
    quantizer = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS)
    _, converted = run(model, data, quantizer)
    result = qt.compare(model, converted, data[:2])
    names = [r.name for r in result.rows]
    assert {"lstm[0]", "lstm[1]", "lstm[2]"} <= set(names)
    assert result.outputs[0].sqnr_db > 15


def test_cells_are_compared_step_by_step_against_the_prepared_model() -> None:
    torch.manual_seed(0)
    model = LSTMThreeHeads().eval()
    data = _data(5, 3, 12)
    quantizer = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS, cell_state_dtype=qt.QDtype.INT16)
    prepared, converted = run(model, data, quantizer)
    before = {k: v.clone() for k, v in prepared.state_dict().items()}
    result = qt.compare(prepared, converted, data[:2])
    inner = [r for r in result.rows if "/" in r.node]
    assert inner, "the cell body's Values are rows"
    scopes = {r.node.split("/")[0] for r in inner}
    assert len(scopes) == 1 and next(iter(scopes)).endswith("body")
    ops = {r.op for r in inner}
    assert {"aten.sigmoid.default", "aten.tanh.default"} <= ops
    assert any(r.quantization == "int16" for r in inner)  # the cell state
    assert all(r.shape == (3, 16) or r.shape[-1] in (12, 16, 64) for r in inner)
    # compare reads the prepared model without running its observers or changing it
    assert all(torch.equal(before[k], v) for k, v in prepared.state_dict().items())
    assert type(prepared.get_submodule(next(iter(scopes)))).__name__ != "_Recording"


@pytest.mark.skipif(
    importlib.util.find_spec("quantree.backends") is None, reason="no CPU backend in this build"
)
def test_lowered_model_keeps_output_rows() -> None:
    from quantree.backends import CPU

    torch.manual_seed(0)
    model = LSTMThreeHeads().eval()
    data = _data(5, 3, 12)
    _, converted = run(model, data)
    lowered = qt.lower(converted, CPU)
    result = qt.compare(model, lowered, data[:2])
    assert isinstance(result, qt.Comparison)
    assert result.outputs and result.outputs[0].sqnr_db > 15


def test_lone_tensors_and_no_data() -> None:
    torch.manual_seed(0)
    model = MaxIndices().eval()
    data = _data(4, 8)
    _, converted = run(model, data)
    lone = qt.compare(model, converted, (x for (x,) in data[:2]))  # a generator of tensors
    assert lone.batches == 2 and lone.outputs
    empty = qt.compare(model, converted, [])
    assert empty.rows == () and empty.batches == 0


def test_a_zero_float_tensor_reads_as_float_zero_not_a_decibel_figure() -> None:
    """Noise over a zero signal has no dB value: it was printed as a finite -250 dB that moved
    3 dB between a sum and a mean of the same squares."""
    from quantree.tools.comparison import TensorRow
    from quantree.tools.metrics import sqnr_text

    assert qt.sqnr(torch.zeros(4), torch.full((4,), 1e-3)) == -math.inf
    assert qt.sqnr(torch.zeros(4), torch.zeros(4)) == math.inf
    assert qt.sqnr(torch.ones(4), torch.full((4,), 1.1)) == pytest.approx(20.0, abs=1e-5)
    row = TensorRow(
        name="attn.in_proj_bias", node="b", path=(), kind=RowKind.WEIGHT, op="aten.linear",
        quantization="int32", shape=(4,), signal=0.0, noise=1e-6, order=0,
    )  # fmt: skip
    assert row.sqnr_db == -math.inf and sqnr_text(row.sqnr_db) == "float 0"
    table = qt.Comparison(rows=(row,), batches=1).render()
    assert table.splitlines()[-1].endswith("float 0")
    assert [sqnr_text(v) for v in (math.inf, 12.34)] == ["exact", "12.3"]
