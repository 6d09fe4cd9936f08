"""``save`` refuses, before writing, a model ``load`` would refuse; the ops outside models
keep float between quantized layers load (``saved/checks/vocabulary.py``, ``serialize.py``).

On 1e712c1 a lowered model calling ``aten.roll`` or ``aten.im2col`` (``F.unfold``) in its
float part saved without a word and every ``load`` then refused the file.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantree as qt
from quantree.backends import load, save
from quantree.backends.cpu.saved.checks.vocabulary import op_error


class Shifted(nn.Module):
    """Float ops between quantized layers that torch.export keeps as themselves: a window
    shift, a GLU, an unfold/fold pair, a pointwise op outside the Core ATen opset."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv1d(4, 8, 3, padding=1), nn.Linear(12, 5)
        self.prelu = nn.PReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [2, 4, 16]
        y = F.glu(self.conv(x), 1)
        y = torch.roll(y, 1, -1) + torch.logaddexp(y, -y) + self.prelu(y).reshape_as(y)
        cols = F.unfold(y[:, :, None, :], (1, 3))
        z = F.fold(cols, (1, 16), (1, 3))[:, :, 0, :12]
        return self.fc(z)


class Median(nn.Module):
    """A median filter: ``aten.median.dim``, outside the vocabulary."""

    def __init__(self, rewritten: bool = False) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv1d(4, 8, 3, padding=1), nn.Linear(8, 5)
        self.rewritten = rewritten

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [2, 4, 16]
        y = self.conv(x).unfold(-1, 3, 1)  # [2, 8, 14, 3]
        # the error's fix: the same median from ops the vocabulary holds
        sort = self.rewritten
        middle = torch.sort(y, -1).values[..., 1] if sort else torch.median(y, -1).values
        return self.fc(middle.mean(-1))


def _quantized(model: nn.Module) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(2, 4, 16)
    data = [(torch.randn(2, 4, 16),) for _ in range(3)]
    return qt.quantize(model.eval(), (x,), data, backend="cpu", progress=False), x


def test_float_ops_outside_models_keep_save_and_load_bit_equal(tmp_path) -> None:
    for name in ("roll", "im2col", "glu", "logaddexp", "prelu", "reshape_as"):
        assert op_error(getattr(torch.ops.aten, name).default) is None, name
    low, x = _quantized(Shifted())
    save(low, tmp_path / "shifted.pt2", (x,))
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "shifted.pt2")(x), low(x))


def test_a_model_load_would_refuse_is_refused_by_save_and_the_fix_it_names_works(tmp_path):
    torch.manual_seed(0)
    model = Median()
    low, x = _quantized(model)
    with pytest.raises(
        qt.QuantreeError, match=r"cannot save .*node \w+ calls aten\.median\.dim"
    ) as e:
        save(low, tmp_path / "median.pt2", (x,))
    assert "Write that part of the model with ops the vocabulary holds" in str(e.value)
    assert not (tmp_path / "median.pt2").exists()
    # following the fix: the same median from ops the vocabulary holds, quantized again
    fixed = Median(rewritten=True)
    fixed.load_state_dict(model.state_dict())
    with torch.no_grad():
        # the same function (the mean sums a strided and a dense tensor: rounding only)
        assert torch.allclose(fixed(x), model(x), rtol=0, atol=1e-6)
    low, x = _quantized(fixed)
    save(low, tmp_path / "median.pt2", (x,))
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "median.pt2")(x), low(x))


class Broadcast(nn.Module):
    """A constant that is a broadcast view (strides of 0), as a mask ``expand`` folded at
    lowering is (DistilBERT's)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.randn(1, 1, 4, 1).expand(1, 1, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [2, 1, 4, 4]
        return self.fc(x) * self.mask


def test_a_broadcast_constant_is_written_dense_and_loads(tmp_path) -> None:
    from quantree.backends.cpu.saved.serialize import saved_program, write_program

    torch.manual_seed(0)
    model, x = Broadcast().eval(), torch.randn(2, 1, 4, 4)
    program = saved_program(model, (x,), dynamic_batch=False)
    assert all(0 not in t.stride() for t in program.state_dict.values())
    write_program(program, tmp_path / "broadcast.pt2")
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "broadcast.pt2")(x), model(x))
    assert model.mask.stride() == (4, 4, 1, 0)  # the user's model is not changed
