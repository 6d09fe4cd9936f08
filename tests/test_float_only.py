"""The recipes never annotate integer side chains (``quantree.recipes.float_only``).

Random models interleave a float path (linear, split/unbind, cat, add) with an index chain
built from ``arange`` through the same ops (unbind, split, cat, add, view, transpose) and
consumed by ``index_select`` / python indexing of the float path. Every one quantizes with
the recipes as they are; the integer chain's nodes carry no quantization; on a calibrated
batch the quantized model is within 25 dB of float. A user's rule that puts a spec on an
integer tensor is still refused, naming the node.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantree as qt
from quantree.core.qdq import is_dequantize, is_quantize


class IndexChains(nn.Module):
    def __init__(self, ops: list[str], width: int) -> None:
        super().__init__()
        self.ops = ops
        self.fc = nn.Linear(8, 8)
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = torch.arange(self.width)
        y = self.fc(x)
        for op in self.ops:
            if op == "unbind":  # python indexing with the integer leaves, as tolist() loops do
                parts = idx.unbind(0)
                y = torch.stack([y[:, int(i)] for i in parts], 1)
            elif op == "split":
                a, b = idx.split([1, self.width - 1])
                idx = torch.cat([b, a])
            elif op == "add":
                idx = (idx + 1) % self.width
            elif op == "flip":
                idx = idx.view(1, -1).transpose(0, 1).reshape(-1).flip(0)
            elif op == "select":
                y = y.index_select(1, idx)
            elif op == "float":
                y = y + idx.float().view(1, -1, 1) * 0.01
        return torch.relu(y)


def _integer_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    out = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not val.is_floating_point():
            out.append(node)
    return out


@settings(max_examples=12, deadline=None)
@given(
    ops=st.lists(
        st.sampled_from(["unbind", "split", "add", "flip", "select", "float"]),
        min_size=1,
        max_size=5,
    ),
    width=st.integers(2, 5),
)
def test_random_integer_side_chains_are_never_annotated(ops: list[str], width: int) -> None:
    torch.manual_seed(0)
    model = IndexChains(ops, width).eval()
    data = [(torch.randn(3, width, 8),) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qt.QuantreeWarning)
        reference = qt.quantize(model, data[0], data, backend=qt.REFERENCE, progress=False)
    for node in _integer_nodes(reference):
        assert not any(is_quantize(user) for user in node.users), node.name
        assert not any(is_dequantize(arg) for arg in node.all_input_nodes), node.name
    (x,) = data[1]  # a calibrated batch: the bound checks the chains, not unseen ranges
    with torch.no_grad():
        assert float(qt.sqnr(model(x), reference(x))) >= 25.0


def test_a_users_spec_on_an_integer_tensor_is_still_refused() -> None:
    model = IndexChains(["unbind"], 3).eval()
    x = torch.randn(2, 3, 8)
    rule = qt.Rule((torch.ops.aten.unbind,), lambda n: qt.Annotation(inputs={(0,): qt.QuantSpec()}))
    with pytest.raises(qt.QuantreeError, match=r"unbind .*not a float tensor"):
        qt.prepare(qt.capture(model, (x,)), qt.Int8Quantizer(rules=(rule,)))


class FloatIndexMath(nn.Module):
    """Encodec's padding arithmetic: a true division of integer tensors gives a float, then
    ``add`` and ``ceil`` before ``to(int64)`` make an index."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("stride", torch.tensor(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [1, 6, 8]
        n = torch.arange(x.shape[1])
        idx = torch.ceil(n / self.stride + 0.5).to(torch.int64).clamp(max=x.shape[1] - 1)
        return self.fc(x).index_select(1, idx)


def test_float_index_math_from_integers_is_not_annotated() -> None:
    torch.manual_seed(0)
    model = FloatIndexMath().eval()
    data = [(torch.randn(1, 6, 8),) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = qt.quantize(model, data[0], data, backend="reference", progress=False)
    quantized = {n.args[0].name for n in ref.graph.nodes if is_quantize(n)}
    assert not any(name.startswith(("div", "add", "ceil")) for name in quantized)
    for args in data:
        got, want = ref(*args), model(*args)
        assert float(10 * torch.log10(want.pow(2).sum() / (want - got).pow(2).sum())) > 30


class Spectrogram(nn.Module):
    """HDemucs's front: an STFT (complex), ``view_as_real``, a normalisation, a conv2d."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.register_buffer("window", torch.hann_window(32))

    def forward(self, wave: torch.Tensor) -> torch.Tensor:  # [1, 256]
        spec = torch.stft(wave, 32, 8, window=self.window, return_complex=True)
        x = torch.view_as_real(spec).permute(0, 3, 1, 2)  # [1, 2, freq, frames]
        return self.conv((x - x.mean()) / (1e-5 + x.std()))


def test_a_complex_spectrum_is_data_not_index_math() -> None:
    """It prepared with the conv's input dropped as index math and its bias still derived
    from it: "DerivedSpec ... derives from conv2d.input[0], which has no spec"."""
    torch.manual_seed(0)
    model = Spectrogram().eval()
    data = [(torch.randn(1, 256),) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = qt.quantize(model, data[0], data, backend="reference", progress=False)
    conv = next(n for n in ref.graph.nodes if n.target is torch.ops.aten.conv2d.default)
    assert is_dequantize(conv.args[0])
    for args in data:
        got, want = ref(*args), model(*args)
        assert float(10 * torch.log10(want.pow(2).sum() / (want - got).pow(2).sum())) > 25
