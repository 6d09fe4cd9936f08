"""Every fix an error or warning on the user's path suggests works when followed.

Issue 24, finding 4. Each test provokes the message, checks that it names the fix, follows
the fix literally (parsing the code it suggests where it gives code) and checks the result.
Messages covered here (others: tests/tools/test_error_messages.py, tests/test_default_backend.py):

- calibration batch in another layout (calibrate's shape guard): ``x.permute(...)``
- a call in another layout (a quantized model's shape guard): ``x.permute(...)``
- a call at another length (a quantized model's shape guard): ``dynamic_shapes={...}``
- a calibration batch at another length: ``dynamic_shapes={...}``
- a calibration batch of another dtype: ``x.to(dtype)``
- (input, target) pairs as calibration items: ``[(x,) for x, _ in loader]``
- a python constant passed as a tensor: pass the captured value
- a model in train mode: one warning; ``model.eval()`` silences it, same model
- a wrong channel count: no permutation is suggested, the channel note is
- example_args not a tuple: ``(x,)``
- an ExportedProgram given to capture: ``torch.export.load(path).module()``
- a quantizer by name: ``quantree.Int8Quantizer()``
- convert before calibration: ``quantree.calibrate``
- lower before convert: calibrate and convert
- tensors calibration never reached: ``unobserved=quantree.Unobserved.FLOAT``
- saving into a directory that does not exist: ``os.makedirs(directory, exist_ok=True)``
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import quantree as qt

from support import batches


def _conv() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(80, 16, 3), nn.ReLU(), nn.Conv1d(16, 8, 1)).eval()


EXAMPLE = (torch.randn(4, 80, 50, generator=torch.Generator().manual_seed(1)),)
DATA = batches((4, 80, 50), n=4)


def _suggested_dynamic_shapes(message: str) -> dict:
    """The ``dynamic_shapes={...}`` the message suggests, as the value it spells."""
    found = re.search(r"dynamic_shapes=(\{.*?\}\})", message)
    assert found, message
    return eval(found.group(1), {"torch": torch})


def _suggested_permutation(message: str) -> tuple[int, ...]:
    found = re.search(r"\w+\.permute(\([\d, ]+\))", message)
    assert found, message
    return eval(found.group(1))


def test_calibration_batches_in_another_layout_are_told_to_permute_and_that_works() -> None:
    time_major = [(x.transpose(1, 2),) for (x,) in DATA]  # (batch, time, mels)
    with pytest.raises(qt.QuantreeError) as raised:
        qt.quantize(_conv(), EXAMPLE, time_major, progress=False, backend="reference")
    message = str(raised.value)
    assert "captured sizes in another order" in message
    assert "dynamic_shapes={" not in message  # freeing the channel dimension fails at capture
    order = _suggested_permutation(message)
    assert order == (0, 2, 1)
    fixed = [(x.permute(*order),) for (x,) in time_major]
    ref = qt.quantize(_conv(), EXAMPLE, fixed, progress=False, backend="reference")
    with torch.no_grad():
        assert qt.sqnr(_conv()(*DATA[0]), ref(*DATA[0])) > 30.0


def test_the_old_advice_for_a_layout_fails_at_capture() -> None:
    """Why the message no longer suggests it: the conv's weights fix the channel count."""
    free_channels = {"input": {1: torch.export.Dim("input_1")}}
    with pytest.raises(qt.QuantreeError, match=r"torch\.export could not capture"):
        qt.capture(_conv(), EXAMPLE, dynamic_shapes=free_channels)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_call_in_another_layout_is_told_to_permute_and_that_works(backend: str) -> None:
    qmodel = qt.quantize(_conv(), EXAMPLE, DATA, progress=False, backend=backend)
    x = DATA[1][0]
    with pytest.raises(qt.QuantreeError) as raised:
        qmodel(x.transpose(1, 2))
    message = str(raised.value)
    assert "input 'input' has the captured sizes in another order" in message
    order = _suggested_permutation(message)
    with torch.no_grad():
        assert torch.equal(qmodel(x.transpose(1, 2).permute(*order)), qmodel(x))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_call_at_another_length_is_given_dynamic_shapes_that_work(backend: str) -> None:
    qmodel = qt.quantize(_conv(), EXAMPLE, DATA, progress=False, backend=backend)
    longer = torch.randn(3, 80, 70)
    with pytest.raises(qt.QuantreeError) as raised:
        qmodel(longer)
    message = str(raised.value)
    assert "cannot be made dynamic" in message  # and which sizes cannot
    shapes = _suggested_dynamic_shapes(message)
    assert list(shapes) == ["input"]  # the forward's parameter, not the graph's input_1
    again = qt.quantize(
        _conv(), EXAMPLE, DATA, progress=False, backend=backend, dynamic_shapes=shapes
    )
    with torch.no_grad():
        assert qt.sqnr(_conv()(longer), again(longer)) > 30.0


def test_calibration_at_another_length_is_given_dynamic_shapes_that_work() -> None:
    varied = [*DATA, (torch.randn(4, 80, 64),)]
    with pytest.raises(qt.QuantreeError) as raised:
        qt.quantize(_conv(), EXAMPLE, varied, progress=False, backend="reference")
    shapes = _suggested_dynamic_shapes(str(raised.value))
    ref = qt.quantize(
        _conv(), EXAMPLE, varied, progress=False, backend="reference", dynamic_shapes=shapes
    )
    with torch.no_grad():
        assert ref(torch.randn(2, 80, 64)).shape == (2, 8, 62)


def test_a_batch_of_another_dtype_is_told_to_convert_and_that_works() -> None:
    doubles = [(x.double(),) for (x,) in DATA]
    with pytest.raises(qt.QuantreeError, match=r"convert it, e\.g\. (\w+)\.to\(torch\.float32\)"):
        qt.quantize(_conv(), EXAMPLE, doubles, progress=False, backend="reference")
    qt.quantize(
        _conv(), EXAMPLE, [(x.to(torch.float32),) for (x,) in doubles], progress=False,
        backend="reference",
    )  # fmt: skip


def test_input_target_pairs_are_told_to_keep_the_inputs_and_that_works() -> None:
    pairs = [(x, torch.zeros(4)) for (x,) in DATA]
    with pytest.raises(qt.QuantreeError, match=re.escape("[(x,) for x, _ in loader]")):
        qt.quantize(_conv(), EXAMPLE, pairs, progress=False, backend="reference")
    qt.quantize(_conv(), EXAMPLE, [(x,) for x, _ in pairs], progress=False, backend="reference")


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.linear(x) * scale


def test_a_constant_given_as_a_tensor_is_told_the_value_and_that_works() -> None:
    data = [(x, torch.tensor(2.0)) for (x,) in batches((3, 6), n=3)]
    with pytest.raises(qt.QuantreeError, match=r"pass 2\.0 there"):
        qt.quantize(Scaled().eval(), (data[0][0], 2.0), data, progress=False, backend="reference")
    fixed = [(x, 2.0) for x, _ in data]
    qt.quantize(Scaled().eval(), (data[0][0], 2.0), fixed, progress=False, backend="reference")


class Regularised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(80, 16, 3)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-1, 1)
            self.norm.running_var.uniform_(0.5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.norm(self.conv(x))))


def test_a_model_in_train_mode_gets_one_warning_and_eval_silences_it() -> None:
    model = Regularised().train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = qt.quantize(model, EXAMPLE, DATA, progress=False, backend="reference")
    said = [str(w.message) for w in caught if issubclass(w.category, qt.QuantreeWarning)]
    assert len(said) == 1, said
    assert "train mode" in said[0] and "norm (BatchNorm1d)" in said[0]
    assert "drop (Dropout)" in said[0] and "model.eval()" in said[0]
    assert model.training  # left as it was
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        following = qt.quantize(model.eval(), EXAMPLE, DATA, progress=False, backend="reference")
    with torch.no_grad():
        for (x,) in DATA:
            assert torch.equal(q(x), following(x))


def test_a_model_in_train_mode_without_train_dependent_modules_is_not_warned() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        qt.quantize(_conv().train(), EXAMPLE, DATA, progress=False, backend="reference")


def test_a_program_exported_in_train_mode_is_the_documented_error() -> None:
    """The README's error: a graph torch.export captured in train mode (batch statistics)."""
    program = torch.export.export(Regularised().train(), EXAMPLE)
    with pytest.raises(qt.QuantreeError, match=r"captured in train mode. Call model.eval\(\)"):
        qt.prepare(program.module(), qt.Int8Quantizer())
    fixed = torch.export.export(Regularised().eval(), EXAMPLE)
    qt.prepare(fixed.module(), qt.Int8Quantizer())


def test_a_wrong_channel_count_is_not_told_to_permute() -> None:
    narrow = [(torch.randn(4, 40, 50),)]
    with pytest.raises(qt.QuantreeError) as raised:
        qt.quantize(_conv(), EXAMPLE, narrow, progress=False, backend="reference")
    message = str(raised.value)
    assert "permute" not in message and "cannot be made dynamic" in message


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 4), nn.ReLU()).eval()


LINEAR_DATA = batches((3, 6), n=3)


def test_example_args_not_a_tuple_are_told_to_write_a_tuple() -> None:
    (x,) = LINEAR_DATA[0]
    with pytest.raises(qt.QuantreeError, match=r"write \(x,\) for a single input"):
        qt.capture(_linear(), x)  # type: ignore[arg-type]
    qt.capture(_linear(), (x,))


def test_an_exported_program_is_told_to_pass_its_module() -> None:
    program = torch.export.export(_linear(), LINEAR_DATA[0])
    with pytest.raises(qt.QuantreeError, match=r"pass torch\.export\.load\(path\)\.module\(\)"):
        qt.capture(program, LINEAR_DATA[0])  # type: ignore[arg-type]
    qt.capture(program.module(), LINEAR_DATA[0])


def test_a_quantizer_by_name_is_told_the_type_to_pass() -> None:
    with pytest.raises(qt.QuantreeError, match=r"e\.g\. quantree\.Int8Quantizer\(\)"):
        qt.quantize(_linear(), LINEAR_DATA[0], LINEAR_DATA, quantizer="int8")  # type: ignore[arg-type]
    qt.quantize(
        _linear(), LINEAR_DATA[0], LINEAR_DATA, quantizer=qt.Int8Quantizer(), progress=False
    )


def test_convert_before_calibration_is_told_to_calibrate() -> None:
    prepared = qt.prepare(qt.capture(_linear(), LINEAR_DATA[0]), qt.Int8Quantizer())
    with pytest.raises(qt.QuantreeError, match=r"or use quantree\.calibrate\) before"):
        qt.convert(prepared)
    qt.calibrate(prepared, LINEAR_DATA, progress=False)
    qt.convert(prepared)


def test_lower_of_a_prepared_model_is_told_to_calibrate_and_convert() -> None:
    prepared = qt.prepare(qt.capture(_linear(), LINEAR_DATA[0]), qt.Int8Quantizer())
    with pytest.raises(qt.QuantreeError, match="calibrate and convert it first"):
        qt.lower(prepared, "cpu")
    qt.calibrate(prepared, LINEAR_DATA, progress=False)
    qt.lower(qt.convert(prepared), "cpu")


class WithMemory(nn.Module):
    """A memory that is empty in every calibration batch: its linear is never observed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.x = nn.Linear(6, 4)
        self.memory = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.x(x) + self.memory(memory).sum(1)


def test_tensors_never_observed_are_told_to_stay_float_and_that_works() -> None:
    data = [(x, torch.zeros(3, 0, 5)) for (x,) in LINEAR_DATA]
    with pytest.raises(qt.QuantreeError, match=r"unobserved=quantree\.Unobserved\.FLOAT") as e:
        qt.quantize(WithMemory().eval(), data[0], data, progress=False, backend="reference")
    assert "never observed" in str(e.value)
    with pytest.warns(qt.QuantreeWarning):
        ref = qt.quantize(
            WithMemory().eval(), data[0], data, progress=False, backend="reference",
            unobserved=qt.Unobserved.FLOAT,
        )  # fmt: skip
    x, memory = data[1][0], torch.zeros(3, 0, 5)
    with torch.no_grad():
        assert qt.sqnr(WithMemory().eval()(x, memory), ref(x, memory)) > 25.0


def test_saving_into_a_missing_directory_is_told_to_create_it_and_that_works(tmp_path) -> None:
    import os

    from quantree.backends import load, save

    lowered = qt.quantize(_conv(), EXAMPLE, DATA, progress=False, backend="cpu")
    path = tmp_path / "not" / "there" / "model.pt2"
    with pytest.raises(qt.QuantreeError, match=r"os\.makedirs\(directory, exist_ok=True\)") as err:
        save(lowered, path, EXAMPLE)
    assert "does not exist" in str(err.value)
    os.makedirs(path.parent, exist_ok=True)  # the fix, as the message spells it
    save(lowered, path, EXAMPLE)
    torch.testing.assert_close(load(path)(*EXAMPLE), lowered(*EXAMPLE), rtol=0, atol=0)


@pytest.mark.parametrize("runtime", ["onnx", "executorch"])
def test_exporting_into_a_missing_directory_is_told_before_the_export(tmp_path, runtime) -> None:
    """The exports failed with the writer's raw ``FileNotFoundError`` after all their work."""
    import os

    pytest.importorskip("onnx" if runtime == "onnx" else "executorch")
    export = qt.export_onnx if runtime == "onnx" else qt.export_executorch
    lowered = qt.quantize(_conv(), EXAMPLE, DATA, progress=False, backend="cpu")
    path = tmp_path / "not" / "there" / "model.file"
    with pytest.raises(qt.QuantreeError, match=r"does not exist.*os\.makedirs\(directory"):
        export(lowered, EXAMPLE, path)
    with pytest.raises(qt.QuantreeError, match="it is a directory"):
        export(lowered, EXAMPLE, tmp_path)
    os.makedirs(path.parent, exist_ok=True)  # the fix, as the message spells it
    assert export(lowered, EXAMPLE, path) == path and path.stat().st_size > 0
