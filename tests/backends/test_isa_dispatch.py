"""The kernel path chosen from what a CPU reports, for CPUs no machine here has.

``qt_isa_for(features, cap)`` is the library's choice as a pure function of
``qt_cpu_features()``'s bits, so the x86 CPUs qemu cannot emulate (AVX-512, AVX-VNNI) are
checked here; the CPUs it can emulate run the whole library in ``test_kernel_check.py``.
Each path needs the whole -march level its files are compiled with: AVX2 and FMA alone
(a virtual machine masking BMI2) are not enough for the avx2 path, nor AVX-512 without VNNI
for the avx512vnni one (Skylake-SP takes avx2).
"""

from __future__ import annotations

import pytest

from quantree.backends.cpu.native import build as build_native
from quantree.backends.cpu.native import loader as native

AVX2, FMA, AVXVNNI, F, BW, VL, VNNI512, V3, V4 = 1, 2, 4, 8, 16, 32, 64, 512, 1024
HASWELL = AVX2 | FMA | V3
SKYLAKE_SP = HASWELL | F | BW | VL | V4
CPUS = {  # features (as libgcc reports them) -> the path
    "Nehalem / SandyBridge (no AVX2)": (0, "portable"),
    "AVX2 + FMA without the rest of x86-64-v3": (AVX2 | FMA, "portable"),
    "Haswell / Zen 1-3": (HASWELL, "avx2"),
    "Skylake-SP (AVX-512 without VNNI)": (SKYLAKE_SP, "avx2"),
    "Cascade Lake / Ice Lake / Zen 4": (SKYLAKE_SP | VNNI512, "avx512vnni"),
    # an OS that saves the YMM but not the ZMM state: libgcc reports no AVX-512 at all
    "Ice Lake, OS without AVX-512 state": (HASWELL, "avx2"),
    "Alder Lake (hybrid, AVX-VNNI, no AVX-512)": (HASWELL | AVXVNNI, "avxvnni"),
    "Sapphire Rapids / Zen 5": (SKYLAKE_SP | VNNI512 | AVXVNNI, "avx512vnni"),
    "AVX-512 VNNI bits without x86-64-v4": (HASWELL | F | BW | VL | VNNI512, "avx2"),
}


@pytest.mark.skipif(not build_native.X86, reason="the x86 paths exist on x86-64 only")
@pytest.mark.parametrize("cpu", list(CPUS))
def test_path_for_cpu(cpu):
    features, path = CPUS[cpu]
    lib = native.library()
    assert native.ISA_NAMES[lib.qt_isa_for(features, 7)] == path


@pytest.mark.skipif(not build_native.X86, reason="the x86 paths exist on x86-64 only")
def test_cap_lowers_the_path():
    lib = native.library()
    cascade = SKYLAKE_SP | VNNI512
    chosen = [native.ISA_NAMES[lib.qt_isa_for(cascade, cap)] for cap in range(4)]
    # capped at avxvnni, an AVX-512 VNNI CPU runs that path's EVEX twin
    assert chosen == ["portable", "avx2", "avxvnni", "avx512vnni"]
    alder = HASWELL | AVXVNNI
    assert [native.ISA_NAMES[lib.qt_isa_for(alder, cap)] for cap in range(4)] == [
        "portable",
        "avx2",
        "avxvnni",
        "avxvnni",
    ]


def test_this_cpu_takes_what_its_bits_allow():
    lib = native.library()
    assert lib.qt_select_isa(7) == lib.qt_isa_for(lib.qt_cpu_features(), 7)
    lib.qt_select_isa(native.isa_cap())
