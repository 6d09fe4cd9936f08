"""An int8 cumulative sum runs natively (``ops/cumsum.py``, ``rules/cumsum.py``).

The op that ``docs/adding-an-op.md`` was followed for: a kernel, an op module, a rule, and an
entry each in ``ops.OPS`` and the rule tuple. The default recipe leaves ``cumsum`` float, so
these tests quantize it with a rule of their own.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.native.checks import NativeArgumentError

from support import calls

aten = torch.ops.aten
quantree_ops = torch.ops.quantree
ACT = qt.QuantSpec(qt.QDtype.INT8)


def _cumsum_rule(node: torch.fx.Node) -> qt.Annotation:
    return qt.Annotation(outputs=ACT, inputs={(0,): ACT})


QUANTIZER = qt.Int8Quantizer() + qt.Quantizer((qt.Rule((aten.cumsum.default,), _cumsum_rule),))


class RunningTotal(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 12)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(self.proj(x), self.dim)


def _lowered(dim: int, shape: tuple[int, ...]) -> tuple:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(*shape, generator=g),) for _ in range(8)]
    ref = qt.quantize(
        RunningTotal(dim).eval(),
        data[0],
        data,
        quantizer=QUANTIZER,
        progress=False,
        backend="reference",
    )
    return ref, qt.lower(ref, CPU), data


@pytest.mark.parametrize("dim", [1, -1, 0])
def test_cumsum_runs_natively_within_one_code_of_the_reference(dim: int) -> None:
    ref, low, data = _lowered(dim, (3, 7, 16))
    assert len(calls(low, quantree_ops.cumsum.default)) == 1
    assert not calls(low, aten.cumsum.default)
    (q,) = calls(ref, torch.ops.quantized_decomposed.quantize_per_tensor.default)[-1:]
    step = float(q.args[1])  # the totals' grid: the reference's float sum rounds at each
    for (x,) in data:  # addition, so a total within rounding of a half may land one code off
        want, got = ref(x), low(x)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= step * 1.001
        assert (got == want).float().mean() > 0.9


def test_the_default_recipe_leaves_cumsum_float() -> None:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 5, 16, generator=g),) for _ in range(4)]
    low = qt.quantize(RunningTotal(1).eval(), data[0], data, backend=CPU, progress=False)
    assert calls(low, aten.cumsum.default) and not calls(low, quantree_ops.cumsum.default)


def test_cumsum_is_exact_on_integers() -> None:
    x = torch.tensor([[[-128, 127, 3], [5, -7, 0]]], dtype=torch.int8)  # [1, 2, 3]
    got = quantree_ops.cumsum(x, 1, 0.5, 1, 0.5, -2)
    # running totals of (code - 1) * 0.5 along dim 1, then / 0.5 - 2
    assert got.tolist() == [[[-128, 124, 0], [-127, 116, -1]]]


def test_a_crafted_argument_is_refused() -> None:
    with pytest.raises(NativeArgumentError, match=r"quantree\.cumsum: x is torch\.float32"):
        quantree_ops.cumsum(torch.zeros(2, 3), 0, 0.1, 0, 0.1, 0)
    with pytest.raises(NativeArgumentError, match="has no dimension 2"):
        quantree_ops.cumsum(torch.zeros(2, 3, dtype=torch.int8), 2, 0.1, 0, 0.1, 0)
    with pytest.raises(NativeArgumentError, match="zero points"):
        quantree_ops.cumsum(torch.zeros(2, 3, dtype=torch.int8), 0, 0.1, 300, 0.1, 0)


def test_saved_and_loaded_it_computes_the_same(tmp_path) -> None:
    _, low, data = _lowered(1, (2, 5, 16))
    save(low, tmp_path / "cumsum.pt2", data[0])
    loaded = load(tmp_path / "cumsum.pt2")
    assert torch.equal(loaded(data[1][0]), low(data[1][0]))
