"""A w4a8 model (``qt.W4A8Quantizer``) saved packs its 4-bit weights two a byte
(``saved/nibbles.py``), loads to the same numbers, and a file whose packed nibbles do not
match the size it declares is refused; the ONNX export writes them as int4 QDQ (opset 21)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU, load, save
from quantree.backends.cpu.saved.nibbles import pack_nibbles
from quantree.backends.cpu.saved.serialize import write_program
from quantree.backends.onnx import onnx_session
from quantree.tools.files import BadFile


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(64, 128, batch_first=True)
        self.out = nn.Linear(128, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(x)[0])


def _lowered(quantizer: qt.Quantizer) -> tuple[torch.nn.Module, list]:
    torch.manual_seed(0)
    data = [(torch.randn(2, 5, 64),) for _ in range(4)]
    return qt.quantize(Model().eval(), data[0], data, quantizer=quantizer, backend=CPU), data


def test_saved_w4a8_loads_equal_and_is_at_most_0_6_of_int8(tmp_path) -> None:
    sizes = {}
    for name, quantizer in (("int8", qt.Int8Quantizer()), ("w4a8", qt.W4A8Quantizer())):
        low, data = _lowered(quantizer)
        path = tmp_path / f"{name}.pt2"
        save(low, path, data[0])
        sizes[name] = path.stat().st_size
        loaded = load(path)
        for (x,) in data:
            assert torch.equal(loaded(x), low(x))
    assert sizes["w4a8"] <= 0.6 * sizes["int8"], sizes


def test_nibbles_round_trip_odd_and_even() -> None:
    for shape in ((7,), (4, 6), (3, 5, 3)):
        t = torch.randint(-8, 8, shape, dtype=torch.int8)
        packed = pack_nibbles(t)
        assert packed is not None and packed.numel() == (t.numel() + 1) // 2
        assert torch.equal(torch.ops.quantree.nibbles(packed, list(shape)), t)
    assert pack_nibbles(torch.tensor([8, 0], dtype=torch.int8)) is None  # not a 4-bit value


class Crafted(nn.Module):
    def __init__(self, packed: torch.Tensor, size: list[int]) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.ops.quantree.nibbles(self.packed, self.size).float()


@pytest.mark.parametrize(
    ("packed", "size", "message"),
    [
        (torch.zeros(3, dtype=torch.uint8), [4, 4], "3 bytes of nibbles for a tensor of shape"),
        (torch.zeros(8, dtype=torch.int8), [4, 4], "packed nibbles of type torch.int8"),
        (torch.tensor([0, 0xF0], dtype=torch.uint8), [3], "a padding nibble that is not 0"),
    ],
)
def test_a_crafted_file_with_wrong_nibbles_is_a_bad_file(tmp_path, packed, size, message) -> None:
    x = torch.zeros(size)
    program = torch.export.export(Crafted(packed, size), (x,))
    path = tmp_path / "crafted.pt2"
    write_program(program, path)
    with pytest.raises(BadFile, match=message) as caught:
        load(path)
    assert "\n" not in str(caught.value)


def test_onnx_export_writes_int4_weights_and_refuses_a_lower_opset(tmp_path) -> None:
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    data = [(torch.randn(4, 16),) for _ in range(4)]
    prepared = qt.prepare(qt.capture(model, data[0]), qt.W4A8Quantizer())
    qt.calibrate(prepared, data, progress=False)
    ref = qt.convert(prepared)
    with pytest.raises(qt.QuantreeError, match="pass opset=21"):
        qt.export_onnx(ref, data[0], tmp_path / "m.onnx", opset=20)
    path = qt.export_onnx(ref, data[0], tmp_path / "m.onnx", opset=21)  # the fix it names
    proto = onnx.load(str(path))
    int4 = [i.name for i in proto.graph.initializer if i.data_type == onnx.TensorProto.INT4]
    assert len(int4) == 4  # two weights and their zero points
    session = onnx_session(path)
    for (x,) in data:  # ONNX Runtime's int4 dequantize gives the reference's numbers
        (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        np.testing.assert_array_equal(out, ref(x).numpy())
