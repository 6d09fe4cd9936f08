"""``torch.save(lowered)`` says how to save a lowered model: it raised torch.package's
``ObjNotFoundError`` (pickle cannot name quantree's native ops)."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import load, save

from support import batches


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0])


def test_pickling_a_lowered_model_names_the_fix_and_the_fix_works(tmp_path) -> None:
    torch.manual_seed(0)
    data = batches((2, 6, 8), n=4)
    lowered = qt.quantize(Tagger().eval(), data[0], data, backend="cpu", progress=False)
    with pytest.raises(qt.QuantreeError, match=r"quantree\.backends\.save\(model"):
        torch.save(lowered, io.BytesIO())
    with pytest.raises(qt.QuantreeError, match="not pickled"):
        pickle.dumps(lowered)
    path = tmp_path / "tagger.pt2"
    save(lowered, path, data[0])  # the fix the error names
    loaded = load(path)
    x = torch.randn(3, 6, 8)
    assert torch.equal(loaded(x), lowered(x))
    with pytest.raises(qt.QuantreeError, match="not pickled"):
        torch.save(loaded, io.BytesIO())


def test_pickling_a_reference_graph_names_the_fix_and_the_fix_works(tmp_path) -> None:
    """It failed with a raw ``AttributeError`` (export's module holds local functions)."""
    torch.manual_seed(0)
    data = batches((2, 6, 8), n=4)
    reference = qt.quantize(Tagger().eval(), data[0], data, backend=None, progress=False)
    with pytest.raises(qt.QuantreeError, match=r"quantree\.backends\.save\(model"):
        torch.save(reference, io.BytesIO())
    save(reference, tmp_path / "reference.pt2", data[0])
    x = torch.randn(3, 6, 8)
    assert torch.equal(load(tmp_path / "reference.pt2")(x), reference(x))
