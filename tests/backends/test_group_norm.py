"""Float group norm as a native kernel (``ops_group_norm.py``, ``lowering_group_norm.py``).

The kernel sums in a different order than ATen, so results agree to float rounding (the
tolerances below are a few float32 ulps of values of order 1), in both layouts it reads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_coverage import assert_matches, lowered, targets
from torch import nn

from quantree.backends import CPU
from quantree.core.errors import QuantreeError
from quantree.tools.inspection import NATIVE_FLOAT, op_statuses

aten = torch.ops.aten
native = torch.ops.quantree

SHAPES = [(2, 12, 37), (1, 8, 5, 7), (3, 6, 1), (1, 4, 2, 3, 5)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_native_group_norm_matches_aten(shape, groups, affine, channels_last):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3 + 5  # an offset mean: the two-pass variance must not cancel
    if channels_last:  # channels innermost, as the native convolutions hand maps over
        order = (0, *range(2, len(shape)), 1)
        x = x.permute(order).contiguous().permute(0, len(shape) - 1, *range(1, len(shape) - 1))
    c = shape[1]
    weight, bias = (torch.randn(c), torch.randn(c)) if affine else (None, None)
    want = F.group_norm(x, groups, weight, bias, 1e-5)
    got = native.group_norm(x, groups, weight, bias, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.stride() == x.stride()  # the input's layout kept


def test_native_group_norm_reads_a_strided_input():
    x = torch.randn(2, 6, 20)[:, :, ::2]  # neither layout: read through a contiguous copy
    torch.testing.assert_close(
        native.group_norm(x, 3, None, None, 1e-5), F.group_norm(x, 3), rtol=1e-5, atol=1e-5
    )


def test_native_group_norm_refuses_groups_that_do_not_divide():
    with pytest.raises(QuantreeError, match="do not split into 4 groups"):
        native.group_norm(torch.zeros(1, 6, 3), 4, None, None, 1e-5)


class Separation(nn.Module):
    """ConvTasNet's block: conv -> PReLU -> gLN (GroupNorm with 1 group) -> conv."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.act = nn.Conv1d(8, 32, 3, padding=1), nn.PReLU()
        self.norm, self.b = nn.GroupNorm(1, 32, eps=1e-8), nn.Conv1d(32, 8, 1)
        self.norm2 = nn.GroupNorm(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.b(self.norm(self.act(self.a(x)))))


def test_group_norm_between_convs_is_native_and_reported_float():
    ref, low, data = lowered(Separation(), (2, 8, 50))
    assert native.group_norm.default in targets(low)
    assert aten.group_norm.default not in targets(low)
    assert_matches(ref, low, data, exact=False)
    statuses = [s for s in op_statuses(low) if "group_norm" in s.op]
    assert len(statuses) == 2 and all(s.status == NATIVE_FLOAT for s in statuses)


def test_lowering_names_the_native_float_group_norm():
    torch.manual_seed(0)
    data = [(torch.randn(2, 8, 50),) for _ in range(3)]
    import quantree as qt

    with pytest.warns(qt.QuantreeWarning, match=r"quantree.group_norm.default x2"):
        qt.quantize(Separation().eval(), data[0], data, backend=CPU, progress=False)
