"""``save`` refuses, before writing, a model ``load`` would refuse; the ops outside models
keep float between quantized layers load (``saved/checks/vocabulary.py``, ``serialize.py``).

On 1e712c1 a lowered model calling ``aten.roll`` or ``aten.im2col`` (``F.unfold``) in its
float part saved without a word and every ``load`` then refused the file.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantree as qt
from quantree.backends import load, save
from quantree.backends.cpu.saved.checks.vocabulary import op_error
from quantree.tools.files import BadFile


class Shifted(nn.Module):
    """Float ops between quantized layers that torch.export keeps as themselves: a window
    shift, a GLU, an unfold/fold pair, a pointwise op outside the Core ATen opset."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv1d(4, 8, 3, padding=1), nn.Linear(12, 5)
        self.prelu = nn.PReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [2, 4, 16]
        y = F.glu(self.conv(x), 1)
        y = torch.roll(y, 1, -1) + torch.logaddexp(y, -y) + self.prelu(y).reshape_as(y)
        cols = F.unfold(y[:, :, None, :], (1, 3))
        z = F.fold(cols, (1, 16), (1, 3))[:, :, 0, :12]
        return self.fc(z)


class Median(nn.Module):
    """A median filter: ``aten.median.dim``, outside the vocabulary."""

    def __init__(self, rewritten: bool = False) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv1d(4, 8, 3, padding=1), nn.Linear(8, 5)
        self.rewritten = rewritten

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [2, 4, 16]
        y = self.conv(x).unfold(-1, 3, 1)  # [2, 8, 14, 3]
        # the error's fix: the same median from ops the vocabulary holds
        sort = self.rewritten
        middle = torch.sort(y, -1).values[..., 1] if sort else torch.median(y, -1).values
        return self.fc(middle.mean(-1))


def _quantized(model: nn.Module) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(2, 4, 16)
    data = [(torch.randn(2, 4, 16),) for _ in range(3)]
    return qt.quantize(model.eval(), (x,), data, backend="cpu", progress=False), x


def test_float_ops_outside_models_keep_save_and_load_bit_equal(tmp_path) -> None:
    for name in ("roll", "im2col", "glu", "logaddexp", "prelu", "reshape_as"):
        assert op_error(getattr(torch.ops.aten, name).default) is None, name
    low, x = _quantized(Shifted())
    save(low, tmp_path / "shifted.pt2", (x,))
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "shifted.pt2")(x), low(x))


class Distances(nn.Module):
    """Float ops torch.export keeps whole that models write between layers: gates in log
    space (xLSTM), normalized features and their distances, a channel shuffle, a sort."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv1d(4, 8, 3, padding=1), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [2, 4, 16]
        y = self.conv(x)
        y = F.logsigmoid(y) + F.normalize(y, dim=1) + F.channel_shuffle(y, 2)
        y = y + F.cosine_similarity(y, y.flip(-1), dim=1)[:, None, :]
        y = y + torch.cdist(y, y)[..., :8].repeat(1, 1, 2) + torch.std_mean(y, -1)[0][..., None]
        y = y + torch.outer(y[0, 0], y[0, 1])[:8][None] + torch.argsort(y, -1) / 16
        return self.fc(y)


def test_float_ops_models_write_between_layers_save_and_load_bit_equal(tmp_path) -> None:
    low, x = _quantized(Distances())
    kept = {
        str(n.target)
        for n in torch.export.export(Distances().eval(), (x,)).graph.nodes
        if n.op == "call_function"
    }
    for name in ("log_sigmoid", "linalg_vector_norm", "cdist", "argsort", "outer", "std_mean"):
        assert any(t.startswith(f"aten.{name}.") for t in kept), name  # the ops under test
    save(low, tmp_path / "distances.pt2", (x,))
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "distances.pt2")(x), low(x))


def test_a_model_load_would_refuse_is_refused_by_save_and_the_fix_it_names_works(tmp_path):
    torch.manual_seed(0)
    model = Median()
    low, x = _quantized(model)
    with pytest.raises(
        qt.QuantreeError, match=r"cannot save .*node \w+ calls aten\.median\.dim"
    ) as e:
        save(low, tmp_path / "median.pt2", (x,))
    assert "Write that part of the model with ops the vocabulary holds" in str(e.value)
    assert not (tmp_path / "median.pt2").exists()
    # following the fix: the same median from ops the vocabulary holds, quantized again
    fixed = Median(rewritten=True)
    fixed.load_state_dict(model.state_dict())
    with torch.no_grad():
        # the same function (the mean sums a strided and a dense tensor: rounding only)
        assert torch.allclose(fixed(x), model(x), rtol=0, atol=1e-6)
    low, x = _quantized(fixed)
    save(low, tmp_path / "median.pt2", (x,))
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "median.pt2")(x), low(x))


class Broadcast(nn.Module):
    """A constant that is a broadcast view (strides of 0), as a mask ``expand`` folded at
    lowering is (DistilBERT's)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.randn(1, 1, 4, 1).expand(1, 1, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [2, 1, 4, 4]
        return self.fc(x) * self.mask


def test_a_broadcast_constant_is_written_dense_and_loads(tmp_path) -> None:
    from quantree.backends.cpu.saved.serialize import saved_program, write_program

    torch.manual_seed(0)
    model, x = Broadcast().eval(), torch.randn(2, 1, 4, 4)
    program = saved_program(model, (x,), dynamic_batch=False)
    assert all(0 not in t.stride() for t in program.state_dict.values())
    write_program(program, tmp_path / "broadcast.pt2")
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "broadcast.pt2")(x), model(x))
    assert model.mask.stride() == (4, 4, 1, 0)  # the user's model is not changed


class DualPath(nn.Module):
    """A dual-path RNN in small: 50%-overlapping chunks (``F.unfold``), a BiLSTM along each
    chunk, overlap-add back (``F.fold``): ``aten.im2col`` and ``aten.col2im`` in the
    lowered graph."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.lstm = nn.Conv1d(1, 8, 4, stride=2), nn.LSTM(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [1, 1, 64]
        w = torch.relu(self.encoder(x))  # [1, 8, 31]
        frames = w.shape[-1]
        chunks = F.unfold(w.unsqueeze(-1), (8, 1), padding=(8, 0), stride=(4, 1))
        n = chunks.shape[-1]
        seq = chunks.reshape(8, 8, n).permute(2, 1, 0)  # [chunks, chunk, channels]
        y = self.fc(self.lstm(seq)[0]).permute(2, 1, 0).reshape(1, 64, n)
        return F.fold(y, (frames, 1), (8, 1), padding=(8, 0), stride=(4, 1))


def _window_file(tmp_path) -> tuple[Path, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(1, 1, 64)
    data = [(torch.randn(1, 1, 64),) for _ in range(4)]
    low = qt.quantize(DualPath().eval(), (x,), data, backend="cpu", progress=False)
    path = tmp_path / "dual_path.pt2"
    save(low, path, (x,))
    return path, low, x


def _with_argument(source: Path, target: Path, op: str, name: str, value: object) -> Path:
    """``source`` with the ``name`` argument of its ``op`` nodes set to ``value`` in the
    archive's program JSON: a file an attacker writes."""

    def edit(item: object) -> None:
        if isinstance(item, dict):
            if str(item.get("target", "")).endswith(f".{op}.default"):
                for arg in item["inputs"]:
                    if arg["name"] == name:
                        arg["arg"] = {"as_ints": value}
            for v in item.values():
                edit(v)
        elif isinstance(item, list):
            for v in item:
                edit(v)

    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("models/model.json"):
                program = json.loads(data)
                edit(program)
                data = json.dumps(program).encode()
            dst.writestr(info, data, compress_type=info.compress_type)
    return target


def test_unfold_lstm_fold_saves_and_loads_bit_equal(tmp_path) -> None:
    path, low, x = _window_file(tmp_path)
    called = {str(n.target) for n in low.graph.nodes}
    assert {"aten.im2col.default", "aten.col2im.default"} <= called
    with torch.no_grad():
        assert torch.equal(load(path)(x), low(x))
        longer = torch.randn(1, 1, 96)  # the length stays free in the file
        assert torch.equal(load(path)(longer), low(longer))


@pytest.mark.parametrize(
    ("op", "name", "value"),
    [
        ("im2col", "stride", [0, 1]),
        ("im2col", "kernel_size", [1 << 40, 1]),
        ("im2col", "padding", [-8, 0]),
        ("im2col", "dilation", [1, 1, 1]),
        ("col2im", "kernel_size", [1 << 20, 1]),
        ("col2im", "padding", [1 << 30, 0]),
    ],
)
def test_a_file_with_window_arguments_out_of_bounds_is_refused(tmp_path, op, name, value):
    path, _, _ = _window_file(tmp_path)
    crafted = _with_argument(path, tmp_path / "crafted.pt2", op, name, value)
    with pytest.raises(BadFile) as caught:
        load(crafted)
    message = str(caught.value)
    assert message.startswith(f"{crafted}: refused, node {op} calls aten.{op}.default with ")
    assert f"{name}={value}: two ints from " in message and "\n" not in message
