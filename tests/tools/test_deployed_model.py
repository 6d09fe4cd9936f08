"""A deployed model (reference, CPU-lowered, saved and loaded) as a user calls it: a shape it
cannot take is explained, and float ops are warned about once, when the model is made."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save


class Tagger(nn.Module):
    """Conv1d -> GRU -> Linear -> log_softmax: a recurrent model keeps its captured shapes,
    and log_softmax has no CPU kernel (it runs in float between quantize/dequantize)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(6, 8, 3, padding=1)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 5)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        y, _ = self.gru(torch.relu(self.conv(feats)).transpose(1, 2))
        return torch.log_softmax(self.fc(y), -1)


def _data() -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 6, 10, generator=g),) for _ in range(4)]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    model, data = Tagger().eval(), _data()
    ref = qt.quantize(model, data[0], data, progress=False, backend="reference")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        lowered = qt.lower(ref, CPU)
    path = tmp_path_factory.mktemp("deployed") / "tagger.pt2"
    save(lowered, path, data[0])
    return {"reference": ref, "cpu": lowered, "loaded": load(path)}


@pytest.mark.parametrize("which", ["reference", "cpu", "loaded"])
def test_a_shape_the_model_cannot_take_names_input_captured_shape_and_fix(deployed, which) -> None:
    """Before: ``AssertionError: Guard failed: feats.size()[0] == 4``. The batch and the
    length vary (a recurrent model is captured with both free); the conv's channels cannot."""
    for shape in ((2, 6, 10), (4, 6, 12), (1, 6, 3)):
        assert deployed[which](torch.randn(*shape)).shape == (shape[0], shape[2], 5)
    with pytest.raises(qt.QuantreeError) as caught:
        deployed[which](torch.randn(4, 7, 10))
    message = str(caught.value)
    assert "input 'feats' has shape (4, 7, 10)" in message
    assert "captured with (*, 6, *)" in message
    assert "dimension 1 was fixed" in message
    assert "(channels, features) cannot be made dynamic" in message


def test_the_suggested_dynamic_shapes_let_the_batch_vary(tmp_path: Path) -> None:
    """The fix the message gives works: quantized with it, every form takes batch 2."""
    torch.manual_seed(0)
    model, data = Tagger().eval(), _data()
    dims = {"feats": {0: torch.export.Dim("batch")}}
    ref = qt.quantize(
        model, data[0], data, dynamic_shapes=dims, progress=False, backend="reference"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        lowered = qt.lower(ref, CPU)
    save(lowered, tmp_path / "m.pt2", data[0])
    small = data[1][0][:2]
    for quantized in (ref, lowered, load(tmp_path / "m.pt2")):
        assert qt.sqnr(model(small), quantized(small)) > 25.0  # measured 36-40 dB


def test_float_ops_are_warned_about_once_per_model_not_per_call(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, data = Tagger().eval(), _data()
    ref = qt.quantize(model, data[0], data, progress=False, backend="reference")
    with warnings.catch_warnings(record=True) as made:
        warnings.simplefilter("always")
        lowered = qt.lower(ref, CPU)
    floats = [w for w in made if issubclass(w.category, qt.QuantreeWarning)]
    assert len(floats) == 1 and re.search(r"log_softmax", str(floats[0].message)), floats
    save(lowered, tmp_path / "m.pt2", data[0])
    loaded = load(tmp_path / "m.pt2")
    for quantized in (ref, lowered, loaded):
        with warnings.catch_warnings(record=True) as calls:
            warnings.simplefilter("always")
            for _ in range(3):
                quantized(*data[0])
        assert not calls, [str(w.message) for w in calls]
