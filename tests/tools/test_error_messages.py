"""Every refusal names the node, batch or file and says what to do; refused arguments are
refused before calibration starts (issue 12, item 4)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.tools.cli import EXIT_BAD_INPUT, EXIT_QUANTIZE_FAILED
from quantree_cli import main


def _small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()


_G = torch.Generator().manual_seed(0)
X = (torch.randn(2, 8, generator=_G),)
DATA = [X, *((torch.randn(2, 8, generator=_G),) for _ in range(2))]  # X is calibrated on


class CountingBatches:
    """Calibration data that records whether calibration ever read it."""

    def __init__(self) -> None:
        self.read = False

    def __len__(self) -> int:
        return 3

    def __iter__(self):
        self.read = True
        return iter(DATA)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "gpu"}, r"backend must be a Backend .* 'reference', 'cpu', got str 'gpu'"),
        ({"backend": nn.Linear(1, 1)}, r"backend must be a Backend"),
        ({"quantizer": "int8"}, r"quantizer must be a Quantizer"),
        ({"unobserved": "float"}, r"unobserved must be a quantree.Unobserved"),
    ],
)
def test_quantize_refuses_bad_arguments_before_calibration(kwargs, match):
    data = CountingBatches()
    with pytest.raises(qt.QuantreeError, match=match):
        qt.quantize(_small(), X, data, progress=False, **kwargs)
    assert not data.read


@pytest.mark.parametrize(
    ("data", "match"), [(None, "got None"), ([], "0 batches"), (iter([]), "0 batches")]
)
def test_missing_or_empty_calibration_data_says_so(data, match):
    with pytest.raises(qt.QuantreeError, match=match):
        qt.quantize(_small(), X, data, progress=False, backend="reference")


@pytest.mark.parametrize("name", ["cpu", "reference"])
def test_backends_by_name_as_on_the_command_line(name):
    model = _small()
    out = qt.quantize(model, X, DATA, backend=name, progress=False)
    ref = qt.quantize(model, X, DATA, progress=False, backend="reference")
    assert qt.sqnr(ref(*X), out(*X)) > 30
    assert qt.sqnr(ref(*X), qt.lower(ref, name)(*X)) > 30


def test_lower_of_a_float_module_or_with_a_wrong_backend_says_what_it_takes():
    with pytest.raises(qt.QuantreeError, match=r"GraphModule quantree\.convert returns"):
        qt.lower(_small())  # type: ignore[arg-type]
    ref = qt.quantize(_small(), X, DATA, progress=False, backend="reference")
    with pytest.raises(qt.QuantreeError, match="backend must be a Backend"):
        qt.lower(ref, _small())  # type: ignore[arg-type]


def test_a_module_loaded_from_a_saved_program_is_accepted(tmp_path: Path):
    path = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(_small(), X), str(path))
    loaded = torch.export.load(str(path)).module()
    out = qt.quantize(loaded, X, DATA, progress=False, backend="reference")
    direct = qt.quantize(_small(), X, DATA, progress=False, backend="reference")
    assert torch.equal(direct(*X), out(*X))


def test_nan_weights_are_the_models_fault_and_refused_before_calibration():
    model = _small()
    with torch.no_grad():
        model[0].weight[1, 2] = float("nan")
    data = CountingBatches()
    with pytest.raises(qt.QuantreeError, match=r"0\.weight hold NaN .*not the calibration data"):
        qt.quantize(model, X, data, progress=False, backend="reference")
    assert not data.read


def test_a_model_that_computes_nan_from_finite_batches_is_named_with_the_batch():
    class Divides(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 4)

        def forward(self, x):
            return self.linear(torch.relu(x) / (x - x))  # 0/0 from finite inputs

    with pytest.raises(qt.QuantreeError, match=r"batch 0 is finite, but the model computed NaN"):
        qt.quantize(Divides(), X, DATA, progress=False, backend="reference")


def test_a_mask_of_infinities_reaching_a_point_stays_float_with_one_warning():
    """A -inf mask that reaches a quantized point through an op (here a minimum) was refused
    as an overflow; the recipe now keeps what the mask reaches float and says so once."""

    class Masks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            mask = torch.zeros(8).masked_fill(torch.arange(8) > 5, float("-inf"))
            return torch.softmax(torch.minimum(self.linear(x), mask), -1)

    model = Masks().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref = qt.quantize(model, X, DATA, progress=False, backend="reference")
    said = [str(w.message) for w in caught if issubclass(w.category, qt.QuantreeWarning)]
    said = [text for text in said if "inf" in text]
    assert len(said) == 1 and "minimum" in said[0]
    with torch.no_grad():
        assert qt.sqnr(model(*X), ref(*X)) > 25  # dB; the masked softmax computed in float


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("errors")
    model = _small()
    paths = {
        "model": root / "model.pt2",
        "data": root / "data.pt",
        "state_dict": root / "weights.pt",
        "pickled": root / "module.pt",
        "script": root / "script.pt",
        "nan": root / "nan.pt2",
    }
    torch.export.save(torch.export.export(model, X), str(paths["model"]))
    torch.save(DATA, paths["data"])
    torch.save(model.state_dict(), paths["state_dict"])
    torch.save(model, paths["pickled"])
    torch.jit.save(torch.jit.trace(model, X), str(paths["script"]))
    broken = _small()
    with torch.no_grad():
        broken[0].bias[0] = float("nan")
    torch.export.save(torch.export.export(broken, X), str(paths["nan"]))
    paths["root"] = root
    return paths


def _cli(capsys, *argv: object) -> tuple[int, str]:
    code = main(["quantize", *map(str, argv), "--quiet"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("state_dict", r"dict of tensors \(a state_dict\?\).*load_state_dict.*torch.export.save"),
        ("pickled", r"pickled object .*Sequential.*torch.export.save"),
        ("script", r"TorchScript file .*torch.export.save"),
        ("data", r"list of tensors \(calibration data\?\).*the model comes first"),
    ],
)
def test_the_cli_says_what_a_wrong_model_file_is(files, capsys, kind, match):
    code, err = _cli(
        capsys, files[kind], "--calibration", files["data"], "-o", files["root"] / "o.pt2"
    )
    assert code == EXIT_BAD_INPUT
    assert str(files[kind]) in err and len(err.strip().splitlines()) == 1
    assert re.search(match, err), err


def test_the_cli_names_swapped_files(files, capsys):
    code, err = _cli(
        capsys, files["model"], "--calibration", files["model"], "-o", files["root"] / "o.pt2"
    )
    assert code == EXIT_BAD_INPUT and "is a torch.export program, not calibration data" in err
    assert "corrupted" not in err


def test_the_cli_refuses_nan_weights_as_the_models_fault(files, capsys):
    code, err = _cli(
        capsys, files["nan"], "--calibration", files["data"], "-o", files["root"] / "o.pt2"
    )
    assert code == EXIT_QUANTIZE_FAILED and "0.bias hold NaN" in err
    assert "calibration set" not in err


def test_the_cli_does_not_create_missing_output_directories(files, capsys):
    out = files["root"] / "missing" / "dir" / "x.pt2"
    code, err = _cli(capsys, files["model"], "--calibration", files["data"], "-o", out)
    assert code == EXIT_BAD_INPUT and "does not exist; create it first" in err
    assert not (files["root"] / "missing").exists()


def test_the_cli_refuses_a_report_on_the_output(files, capsys):
    out = files["root"] / "same.pt2"
    code, err = _cli(
        capsys, files["model"], "--calibration", files["data"], "-o", out, "--report", out
    )
    assert code == EXIT_BAD_INPUT and "--report and -o name the same file" in err
    assert not out.exists()
