"""Every kernel path the CPU can run gives the bits of the portable path.

The path is switched in-process through ``qt_select_isa`` (the library is loaded once), so
one run covers AVX-512 VNNI, AVX-VNNI (its EVEX twin on AVX-512 machines) and AVX2 wherever
the CPU has them; a subprocess checks that ``QUANTREE_NATIVE_MARCH=x86-64-v3`` picks AVX2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import quantree as qt
import quantree.backends.cpu.ops
from quantree.backends import CPU, cpu_isa
from quantree.backends.cpu.native.loader import ISA_NAMES, isa_cap, library
from quantree.backends.cpu.native.packing import pack, zero_point_offset

from support import batches, leaves

quantree_ops = torch.ops.quantree


def available() -> list[str]:
    """The paths this CPU runs (selecting one returns it only when the CPU has it)."""
    lib = library()
    names = [name for i, name in enumerate(ISA_NAMES) if lib.qt_select_isa(i) == i]
    lib.qt_select_isa(isa_cap())
    return names


@pytest.fixture
def select() -> Iterator[object]:
    lib = library()

    def choose(name: str) -> None:
        assert ISA_NAMES[lib.qt_select_isa(ISA_NAMES.index(name))] == name

    yield choose
    lib.qt_select_isa(isa_cap())


def vector_paths() -> list[str]:
    return [name for name in available() if name != "portable"]


def test_selected_path_is_reported():
    assert cpu_isa() in available()


SHAPES = [(1, 4, 16), (1, 3, 7), (1, 300, 1000), (1, 64, 40), (2, 17, 9), (3, 5, 17),
          (5, 130, 33), (67, 64, 100), (130, 36, 24)]  # fmt: skip


@pytest.mark.parametrize("name", vector_paths())
def test_linear_paths_equal_portable(name, select):
    for m, k, n in SHAPES:
        torch.manual_seed(m * 1000 + k + n)
        x = torch.randint(-128, 128, (m, k), dtype=torch.int8)
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8)  # -128 included: no saturation
        args = (pack(w), zero_point_offset(w, -7), torch.rand(n) * 1e-2, torch.randn(n), n)
        results = {}
        for path in ("portable", name):
            select(path)
            results[path] = [
                quantree_ops.linear(x, *args, 0.0, 0, False),
                quantree_ops.linear(x, *args, 0.05, 3, False),
                quantree_ops.linear(x, *args, 0.05, -5, True),
            ]
        for want, got in zip(results["portable"], results[name], strict=True):
            assert torch.equal(want, got), (name, m, k, n)


@pytest.mark.parametrize("name", vector_paths())
def test_matmul_and_conv_paths_equal_portable(name, select):
    torch.manual_seed(0)
    a = torch.randint(-128, 128, (3, 5, 19), dtype=torch.int8)
    b = torch.randint(-128, 128, (3, 19, 21), dtype=torch.int8)
    model = nn.Sequential(nn.Conv2d(3, 24, 3, padding=1), nn.ReLU(), nn.Conv2d(24, 10, 3, 2))
    data = batches((2, 3, 9, 11), n=4)
    low = qt.lower(
        qt.quantize(model.eval(), data[0], data, progress=False, backend="reference"), CPU
    )
    results = {}
    for path in ("portable", name):
        select(path)
        with torch.no_grad():
            results[path] = [
                quantree_ops.matmul(a, b, 0.1, 3, 0.2, -2, 0.5, 1),
                quantree_ops.matmul(a, b, 0.1, 3, 0.2, -2, 0.0, 0),
                *leaves(low(data[1][0])),
            ]
    for want, got in zip(results["portable"], results[name], strict=True):
        assert torch.equal(want, got)


RECURRENT = {
    "lstm-2x": (lambda: nn.LSTM(12, 24, 2), qt.RecurrentMode.WHOLE, 8),
    "lstm-h16": (lambda: nn.LSTM(12, 20, 2, bidirectional=True), qt.RecurrentMode.WHOLE, 16),
    "gru": (lambda: nn.GRU(12, 19), qt.RecurrentMode.WHOLE, 8),
    "rnn": (lambda: nn.RNN(12, 17), qt.RecurrentMode.WHOLE, 8),
    "lstm-cells": (lambda: nn.LSTM(12, 24), qt.RecurrentMode.CELLS, 8),
}


@pytest.mark.parametrize("case", RECURRENT.values(), ids=RECURRENT.keys())
def test_recurrent_vector_paths_agree(case, select):
    """The vector paths share the gate math's polynomial too: bit-equal among themselves
    (the portable path uses libm's exp and tanh, so it only matches to quantization)."""
    paths = vector_paths()
    if len(paths) < 2:
        pytest.skip(f"this CPU runs fewer than two vector paths ({paths})")
    make, mode, bits = case
    torch.manual_seed(0)
    model = make().eval()
    data = batches((7, 3, 12), n=4)
    ref = qt.quantize(model, data[0], data, quantizer=qt.Int8Quantizer(recurrent=mode),
                      progress=False, backend="reference")  # fmt: skip
    low = qt.lower(ref, qt.backends.cpu_backend(hidden_bits=bits))
    results = {}
    for path in paths:
        select(path)
        with torch.no_grad():
            results[path] = leaves(low(data[1][0]))
    for path in paths[1:]:
        for want, got in zip(results[paths[0]], results[path], strict=True):
            assert torch.equal(want, got), path


@pytest.mark.skipif("avx2" not in available(), reason="the CPU has no AVX2")
def test_march_x86_64_v3_selects_avx2():
    env = {**os.environ, "QUANTREE_NATIVE_MARCH": "x86-64-v3"}
    env.pop("QUANTREE_CPU_ISA", None)
    code = "from quantree.backends import cpu_isa; print(cpu_isa())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "avx2"
