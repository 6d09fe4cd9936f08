"""ONNX Runtime's fused int8 operators saturate on x86 without VNNI; ``onnx_session`` keeps the
reference's numbers there (``backends/onnx/ort_kernels.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends.onnx import export as onnx_export
from quantree.backends.onnx import onnx_session, ort_kernels, run_onnx
from quantree.backends.onnx.ort_kernels import cpu_flags, saturates


def test_cpu_flags_read_the_first_flags_line():
    text = "processor : 0\nflags\t\t: fpu avx2 fma\nflags : other\n"
    assert cpu_flags(text) == {"fpu", "avx2", "fma"}
    assert cpu_flags("processor : 0\n") == set()


@pytest.mark.parametrize(
    ("machine", "flags", "want"),
    [
        ("x86_64", {"avx2", "fma"}, True),  # Zen 3, Skylake: vpmaddubsw
        ("x86_64", {"avx2", "avx512f", "avx512_vnni"}, False),
        ("x86_64", {"avx2", "avx_vnni"}, False),  # Alder Lake's AVX-VNNI
        ("AMD64", {"sse4_2"}, True),
        ("x86_64", None, False),  # flags unknown (another OS): not claimed
        ("aarch64", {"asimd"}, False),
    ],
)
def test_saturation_is_claimed_only_on_x86_without_vnni(machine, flags, want):
    assert saturates(machine, flags) is want


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = Net().eval()
    g = torch.Generator().manual_seed(1)
    # large inputs and weights: u8 x s8 pair sums far beyond int16 where they saturate
    data = [(3 * torch.randn(16, 3, 6, 6, generator=g),) for _ in range(8)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = qt.quantize(model, data[0], data, backend=qt.REFERENCE, progress=False)
    path = tmp_path_factory.mktemp("ort") / "net.onnx"
    qt.export_onnx(ref, data[0], path)
    return ref, data[0][0], path


def _run(session, x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])


def test_where_kernels_saturate_the_session_runs_qdq_as_written_and_says_so(exported, monkeypatch):
    """On a CPU claimed saturating, the default session warns once and gives the reference's
    numbers exactly; following the warning (``int8_kernels=False``) silences it, same numbers."""
    ref, x, path = exported
    monkeypatch.setattr(onnx_export, "ort_int8_saturates", lambda: True)
    with torch.no_grad():
        want = ref(x)
    with pytest.warns(qt.QuantreeWarning, match="int8_kernels=True"):
        session = onnx_session(path)
    assert torch.equal(_run(session, x), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        quiet = onnx_session(path, int8_kernels=False)
        got = run_onnx(path, (x,), int8_kernels=False)[0]
    assert torch.equal(_run(quiet, x), want)
    assert torch.equal(got, want)


def test_where_kernels_are_exact_the_default_fuses_silently(exported, monkeypatch):
    path = exported[2]
    monkeypatch.setattr(onnx_export, "ort_int8_saturates", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        onnx_session(path)
        onnx_session(path, int8_kernels=True)


@pytest.mark.skipif(not ort_kernels.ort_int8_saturates(), reason="this CPU has VNNI")
def test_on_this_cpu_the_fused_kernels_do_differ(exported):
    """The claim holds here: ONNX Runtime's fused int8 operators miss the reference."""
    ref, x, path = exported
    with torch.no_grad():
        want = ref(x)
    assert not torch.equal(_run(onnx_session(path, int8_kernels=True), x), want)


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


def _tagger_export(tmp_path, reduce_range: bool):
    """A model ONNX Runtime's target runs in an explicit integer operator (DynamicQuantizeLSTM),
    which no session option sends back to float."""
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = Tagger().eval()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(12, 3, 16, generator=g),) for _ in range(6)]
    quantizer = qt.Int8Quantizer(reduce_range=reduce_range)
    ref = qt.quantize(model, data[0], data[:5], quantizer=quantizer, progress=False)
    path = tmp_path / f"tagger{int(reduce_range)}.onnx"
    qt.export_onnx(ref, data[0], path, target=qt.OnnxTarget.ONNXRUNTIME)
    return model, ref, data[5][0], path


def test_saturating_integer_ops_are_named_with_the_fix_and_the_fix_silences_it(
    tmp_path, monkeypatch
):
    import onnx

    _, _, _, wide = _tagger_export(tmp_path, reduce_range=False)
    _, _, _, narrow = _tagger_export(tmp_path, reduce_range=True)
    assert [s.split()[0] for s in ort_kernels.saturating_ops(onnx.load(str(wide)))] == [
        "DynamicQuantizeLSTM"
    ]
    assert ort_kernels.saturating_ops(onnx.load(str(narrow))) == []
    monkeypatch.setattr(onnx_export, "ort_int8_saturates", lambda: True)
    fix = r"1 integer operator\(s\).*DynamicQuantizeLSTM.*Int8Quantizer\(reduce_range=True\)"
    with pytest.warns(qt.QuantreeWarning, match=fix):
        onnx_session(wide, int8_kernels=False)  # the q/dq option cannot reach these
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        onnx_session(narrow, int8_kernels=False)  # following the fix: nothing to say
        onnx_session(wide, int8_kernels=True)  # speed asked for over the reference's numbers
    monkeypatch.setattr(onnx_export, "ort_int8_saturates", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        onnx_session(wide)  # exact where the kernels are


def test_reduced_range_weights_stay_on_seven_bits_and_never_widen():
    from quantree.core.specs import int8_weight
    from quantree.recipes.int8 import reduced_range
    from quantree.recipes.w4a8 import int4_weight

    assert reduced_range(int8_weight()).range == (-63, 63)
    assert reduced_range(int4_weight()).range == int4_weight().range
    with pytest.raises(qt.QuantreeError, match="reduce_range must be True or False"):
        qt.Int8Quantizer(reduce_range=1)  # type: ignore[arg-type]


@pytest.mark.skipif(not ort_kernels.ort_int8_saturates(), reason="this CPU has VNNI")
def test_on_this_cpu_seven_bit_weights_give_the_reference_accuracy_full_range_does_not(tmp_path):
    """The warning's fix, followed on a CPU where it matters: full-range weights lose tens of
    dB in ONNX Runtime's LSTM here; 7-bit ones land within 2 dB of their reference."""
    model, wide_ref, x, wide = _tagger_export(tmp_path, reduce_range=False)
    _, narrow_ref, _, narrow = _tagger_export(tmp_path, reduce_range=True)
    with torch.no_grad():
        want = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        wide_db = qt.sqnr(want, run_onnx(wide, (x,))[0])
        narrow_db = qt.sqnr(want, run_onnx(narrow, (x,))[0])
    with torch.no_grad():
        assert wide_db < qt.sqnr(want, wide_ref(x)) - 10
        assert narrow_db >= qt.sqnr(want, narrow_ref(x)) - 2.0
