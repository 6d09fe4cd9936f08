"""int8 average pooling (``ops_pool.avg_pool2d``, ``lowering_avg_pool.py``).

The kernel sums each window's codes exactly in int32; only the sum goes through float32. So
against the exact answer (the same sum in float64) a result may differ by one code, and only
where the float32 product lands within rounding of a half: a handful in tens of thousands.
ATen's divisor rules (``count_include_pad``, ``divisor_override``, ``ceil_mode``'s clipped
last window) are matched exactly: a wrong divisor moves most results, not one in a thousand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_coverage import assert_matches, lowered, targets
from torch import nn

from quantree.core.errors import QuantreeError

aten = torch.ops.aten
native = torch.ops.quantree

GEOMETRIES = [
    # kernel, stride, padding, ceil_mode, count_include_pad, divisor_override
    ([2, 2], [2, 2], [0, 0], False, True, None),  # DenseNet's transition
    ([3, 3], [1, 1], [1, 1], False, False, None),  # PoolFormer's token mixer
    ([3, 3], [1, 1], [1, 1], False, True, None),  # Inception's branch pool
    ([3, 3], [2, 2], [1, 1], True, True, None),  # ceil_mode: a clipped last window
    ([3, 2], [2, 1], [1, 0], True, False, None),
    ([2, 3], [1, 2], [1, 1], False, True, 5),  # divisor_override
]


@pytest.mark.parametrize(("kernel", "stride", "padding", "ceil", "include", "divisor"), GEOMETRIES)
def test_native_avg_pool_matches_aten_within_one_code(
    kernel, stride, padding, ceil, include, divisor
):
    torch.manual_seed(0)
    x = torch.randint(-128, 128, (2, 37, 13, 11), dtype=torch.int8)
    xs, xz, ys, yz = 0.0491, 3, 0.0213, -7  # no exact ties: 491 / 2130 in lowest terms
    pooled = F.avg_pool2d(
        (x.double() - xz) * xs, kernel, stride, padding, ceil, include, divisor
    )  # float64: far finer than one code
    want = torch.clamp(torch.round(pooled / ys) + yz, -128, 127).to(torch.int8)
    got = native.avg_pool2d(
        x.contiguous(memory_format=torch.channels_last), kernel, stride, padding, ceil, include,
        divisor or 0, xs, xz, ys, yz,
    )  # fmt: skip
    assert got.shape == want.shape
    assert got.is_contiguous(memory_format=torch.channels_last)
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1
    assert (diff > 0).sum() <= max(1, want.numel() // 1000)


def test_native_avg_pool_reads_any_layout():
    """A contiguous (NCHW) input gives the same codes as its channels-last copy."""
    torch.manual_seed(1)
    x = torch.randint(-128, 128, (1, 5, 9, 9), dtype=torch.int8)
    args = ([3, 3], [2, 2], [1, 1], False, True, 0, 0.1, 0, 0.1, 0)
    a = native.avg_pool2d(x, *args)
    b = native.avg_pool2d(x.contiguous(memory_format=torch.channels_last), *args)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("kernel", "padding", "divisor", "message"),
    [([2, 2], [2, 0], 0, "over half the kernel"), ([2, 2], [0, 0], -1, "divisor_override")],
)
def test_native_avg_pool_refuses_what_has_no_divisor(kernel, padding, divisor, message):
    x = torch.zeros(1, 2, 4, 4, dtype=torch.int8)
    with pytest.raises(QuantreeError, match=message):
        native.avg_pool2d(x, kernel, [1, 1], padding, False, True, divisor, 1.0, 0, 1.0, 0)


class Pooled(nn.Module):
    def __init__(self, pool: nn.Module) -> None:
        super().__init__()
        self.conv, self.pool, self.head = nn.Conv2d(3, 16, 3, padding=1), pool, nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.relu(self.conv(x))))


POOLS = {
    "densenet": nn.AvgPool2d(2, 2),
    "poolformer": nn.AvgPool2d(3, 1, 1, count_include_pad=False),
    "ceil": nn.AvgPool2d(3, 2, 1, ceil_mode=True),
    "adaptive-even": nn.AdaptiveAvgPool2d((4, 2)),
}


@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
def test_average_pool_between_convs_is_native(pool):
    ref, low, data = lowered(Pooled(pool), (2, 3, 16, 12))
    assert native.avg_pool2d.default in targets(low)
    assert not {aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default} & targets(low)
    assert_matches(ref, low, data, exact=False)


def test_uneven_adaptive_pool_stays_with_aten():
    """7 rows into 3: ATen's windows overlap and differ in size, no fixed-window pool."""
    ref, low, data = lowered(Pooled(nn.AdaptiveAvgPool2d((3, 3))), (2, 3, 7, 7))
    assert native.avg_pool2d.default not in targets(low)
    assert aten.adaptive_avg_pool2d.default in targets(low)
    assert_matches(ref, low, data, exact=False)
