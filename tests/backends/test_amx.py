"""The AVX-512 VNNI path's GEMMs on AMX tiles give the bits of its vector micro-kernels.

``qt_amx`` switches the tiles in-process; where the CPU or the OS does not offer them, it
stays off and these tests skip. By default (``qt_amx(1)``) the tiles run for products of
1 M multiply-adds or more with 64 bytes of k or more (``gemm_avx512amx``), so the first
shapes here are above that;
``qt_amx(2)`` puts every product of 16 rows and more on them, which the small odd shapes
use. Together they cover the row panel's tails (fewer than 16 or 32 rows), the k tail (Kp
not a multiple of 64), odd column blocks, a padded last block, every epilogue the lowered
ops use (int8 out with and without relu, float out) and the int16 activations' two planes
(``linear16``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.loader import library


@pytest.fixture
def amx() -> Iterator[object]:
    lib = library()
    if lib.qt_amx(-1) != 1:
        pytest.skip("no AMX on this CPU or OS")
    yield lib.qt_amx
    lib.qt_amx(1)


def both(
    lowered: torch.nn.Module, x: torch.Tensor, amx: object, mode: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    assert amx(0) == 0  # type: ignore[operator]
    off = lowered(x)
    assert amx(mode) == mode  # type: ignore[operator]
    return off, lowered(x)


@pytest.mark.parametrize(
    "cin, cout, kernel, stride, size",
    [(17, 33, 5, 1, 24), (64, 48, 3, 2, 40), (200, 64, 1, 1, 30)],
)
def test_conv_on_tiles_equals_vector_path(amx, cin, cout, kernel, stride, size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2), nn.ReLU()).eval()
    calib = [(torch.randn(2, cin, size, size),) for _ in range(2)]
    lowered = qt.quantize(model, calib[0], calib, backend=CPU, progress=False)
    off, on = both(lowered, torch.randn(2, cin, size, size), amx)
    assert torch.equal(off, on)


@pytest.mark.parametrize("rows, depth, width", [(47, 1000, 70), (33, 2000, 40), (100, 700, 100)])
@pytest.mark.parametrize("wide", [False, True])
def test_linear_on_tiles_equals_vector_path(amx, rows, depth, width, wide):
    assert rows * (width + 15) // 16 * 16 * depth >= 1 << 20 and depth >= 64  # the tiles'
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(depth, width), nn.ReLU(), nn.Linear(width, 8)).eval()
    calib = [(torch.randn(rows, depth),) for _ in range(2)]
    quantizer = qt.A16W8Quantizer() if wide else None
    lowered = qt.quantize(model, calib[0], calib, backend=CPU, progress=False, quantizer=quantizer)
    assert ("linear16" in lowered.code) == wide
    off, on = both(lowered, torch.randn(rows, depth), amx)
    assert torch.equal(off, on)


@pytest.mark.parametrize(
    "cin, cout, kernel, stride, size, batch",
    [(3, 16, 3, 1, 9, 1), (5, 33, 3, 2, 11, 2), (70, 17, 1, 1, 5, 3), (16, 100, 2, 1, 7, 1)],
)
def test_small_odd_convs_on_tiles_equal_vector_path(amx, cin, cout, kernel, stride, size, batch):
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride), nn.ReLU(), nn.Conv2d(cout, 8, 1)
    ).eval()
    calib = [(torch.randn(batch, cin, size, size),) for _ in range(2)]
    lowered = qt.quantize(model, calib[0], calib, backend=CPU, progress=False)
    off, on = both(lowered, torch.randn(batch, cin, size, size), amx, mode=2)
    assert torch.equal(off, on)


@pytest.mark.parametrize("rows, depth, width", [(16, 1, 1), (17, 63, 15), (40, 65, 33)])
@pytest.mark.parametrize("wide", [False, True])
def test_small_odd_linears_on_tiles_equal_vector_path(amx, rows, depth, width, wide):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(depth, width), nn.Linear(width, 5)).eval()
    calib = [(torch.randn(rows, depth),) for _ in range(2)]
    quantizer = qt.A16W8Quantizer() if wide else None
    lowered = qt.quantize(model, calib[0], calib, backend=CPU, progress=False, quantizer=quantizer)
    off, on = both(lowered, torch.randn(rows, depth), amx, mode=2)
    assert torch.equal(off, on)
