"""torchao's pt2e quantizers drive qt.prepare; where pt2e stops (tuples), quantree goes on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("torchao", reason="pt2e quantizer tests need torchao (pip install torchao)")

from torchao.quantization.pt2e import MinMaxObserver, PerChannelMinMaxObserver
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
    SharedQuantizationSpec,
)
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)

import quantree as qt
from quantree.core.qdq import DEQUANTIZE_OPS, QUANTIZE_OPS, params_of

from support import batches

aten = torch.ops.aten
WARN = "ignore::quantree.QuantreeWarning"


def x86() -> X86InductorQuantizer:
    return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())


def xnnpack():
    mod = pytest.importorskip("torchao.testing.pt2e._xnnpack_quantizer")
    return mod.XNNPACKQuantizer().set_global(mod.get_symmetric_quantization_config())


class CnnBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 32, 3, stride=2)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.c1(x)))
        x = nn.functional.max_pool2d(x, 2)
        x = torch.relu(self.c2(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class ConvLstm(nn.Module):
    """A conv front end (pt2e's part), an LSTM (quantree's), a linear head (pt2e's)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, (1, 3), padding=(0, 1))
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        y = torch.relu(self.conv(x)).squeeze(2).transpose(1, 2)
        out, _ = self.lstm(y)
        return self.head(out)


def placement(gm: torch.fx.GraphModule) -> list[tuple[str, tuple[str, ...], bool]]:
    """Per compute op in order: target, what each tensor input reads, whether it is quantized."""
    rows = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target in QUANTIZE_OPS + DEQUANTIZE_OPS:
            continue
        kinds = []
        for arg in node.all_input_nodes:
            if arg.target in DEQUANTIZE_OPS:
                kinds.append(f"dq:{arg.args[-1]}:{'c' if len(arg.args) == 7 else 't'}")
            elif arg.op == "get_attr":
                kinds.append("const")
            else:
                kinds.append("float")
        quantized = any(u.target in QUANTIZE_OPS for u in node.users)
        rows.append((str(node.target), tuple(kinds), quantized))
    return rows


def activation_scales(gm: torch.fx.GraphModule) -> list[float]:
    return [
        float(n.args[1])
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target in QUANTIZE_OPS and len(n.args) == 6
    ]


def torchao_reference(model, data, quantizer):
    prepared = prepare_pt2e(torch.export.export(model, data[0]).module(), quantizer)
    for batch in data:
        prepared(*batch)
    return convert_pt2e(prepared)


def quantree_reference(model, data, quantizer):
    prepared = qt.prepare(qt.capture(model, data[0]), quantizer)
    qt.calibrate(prepared, data, progress=False)
    return qt.convert(prepared)


@pytest.mark.filterwarnings(WARN)
@pytest.mark.parametrize("make", [x86, xnnpack], ids=["x86_inductor", "xnnpack"])
def test_same_placement_and_parameters_as_torchao(make):
    torch.manual_seed(0)
    model = CnnBn().eval()
    data = batches((2, 3, 16, 16), n=6)
    theirs = torchao_reference(model, data, make())
    ours = quantree_reference(model, data, make())
    assert placement(ours) == placement(theirs)
    # min-max observers agree closely; torchao's and quantree's histogram searches differ a little
    ours_scales, their_scales = activation_scales(ours), activation_scales(theirs)
    assert len(ours_scales) == len(their_scales) > 0
    for a, b in zip(ours_scales, their_scales, strict=True):
        assert a == pytest.approx(b, rel=0.05)
    with torch.no_grad():
        assert qt.sqnr(theirs(*data[0]), ours(*data[0])) > 25


@pytest.mark.filterwarnings(WARN)
def test_x86_reference_compiles_with_torch_compile():
    torch.manual_seed(0)
    model = CnnBn().eval()
    data = batches((2, 3, 16, 16), n=4)
    ours = quantree_reference(model, data, x86())
    compiled = torch.compile(ours)
    with torch.no_grad():
        assert qt.sqnr(ours(*data[1]), compiled(*data[1])) > 30


class ExecuTorchStyleRecurrentQuantizer(Quantizer):
    """Annotates aten.lstm / aten.gru the way ExecuTorch backends write annotations, with one
    output spec per leaf (pt2e's own prepare would only observe a single-tensor output)."""

    act = QuantizationSpec(torch.int8, MinMaxObserver, -128, 127, torch.per_tensor_affine)
    weight = QuantizationSpec(
        torch.int8, PerChannelMinMaxObserver, -127, 127, torch.per_channel_symmetric, ch_axis=0
    )

    def annotate(self, model):
        for node in model.graph.nodes:
            if node.target not in (aten.lstm.input, aten.gru.input):
                continue
            x, hx, params = node.args[:3]
            states = list(hx) if isinstance(hx, list | tuple) else [hx]
            inputs = {x: self.act, **dict.fromkeys(states, self.act)}
            inputs.update({p: self.weight for p in params if p.meta["val"].dim() == 2})
            outputs = (self.act, *(SharedQuantizationSpec((s, node)) for s in states))
            node.meta["quantization_annotation"] = QuantizationAnnotation(
                input_qspec_map=inputs, output_qspec=outputs, _annotated=True
            )
        return model

    def validate(self, model):
        return None


class TwoRecurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 12, batch_first=True)
        self.gru = nn.GRU(12, 12, batch_first=True)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        out2, h2 = self.gru(out)
        return out2, (h, c), h2


def _quantized_leaves(ref: torch.fx.GraphModule, target) -> list[bool]:
    node = next(n for n in ref.graph.nodes if n.target == target)
    leaves = sorted(
        (u for u in node.users if u.target is __import__("operator").getitem),
        key=lambda u: u.args[1],
    )
    return [any(v.target in QUANTIZE_OPS for v in leaf.users) for leaf in leaves]


@pytest.mark.filterwarnings(WARN)
def test_per_leaf_output_specs_quantize_every_leaf():
    torch.manual_seed(0)
    model = TwoRecurrent().eval()
    data = batches((3, 7, 6), n=6)
    ref = quantree_reference(model, data, ExecuTorchStyleRecurrentQuantizer())
    assert _quantized_leaves(ref, aten.lstm.input) == [True, True, True]
    assert _quantized_leaves(ref, aten.gru.input) == [True, True]
    dq_weights = [
        n
        for n in ref.graph.nodes
        if n.target in DEQUANTIZE_OPS and n.args[0].op == "get_attr" and params_of(n, ref).axis == 0
    ]
    assert len(dq_weights) == 4  # w_ih, w_hh of each layer
    with torch.no_grad():
        for f, q in zip(
            torch.utils._pytree.tree_leaves(model(*data[0])),
            torch.utils._pytree.tree_leaves(ref(*data[0])),
            strict=True,
        ):
            assert qt.sqnr(f, q) > 25


@pytest.mark.filterwarnings(WARN)
def test_output_spec_on_getitem_users_quantizes_that_leaf():
    class OnGetitems(ExecuTorchStyleRecurrentQuantizer):
        def annotate(self, model):
            import operator

            super().annotate(model)
            for node in model.graph.nodes:
                if node.target in (aten.lstm.input, aten.gru.input):
                    node.meta["quantization_annotation"].output_qspec = None
                    for user in node.users:
                        if user.target is operator.getitem:
                            user.meta["quantization_annotation"] = QuantizationAnnotation(
                                output_qspec=self.act, _annotated=True
                            )
            return model

    torch.manual_seed(0)
    model = TwoRecurrent().eval()
    data = batches((3, 7, 6), n=4)
    ref = quantree_reference(model, data, OnGetitems())
    assert _quantized_leaves(ref, aten.lstm.input) == [True, True, True]


@pytest.mark.filterwarnings(WARN)
def test_torchao_quantizer_composed_with_recurrent_rules():
    torch.manual_seed(0)
    model = ConvLstm().eval()
    data = batches((2, 4, 1, 9), n=6)
    ref = quantree_reference(model, data, qt.from_pt2e(x86()) + qt.recurrent_rules())
    assert _quantized_leaves(ref, aten.lstm.input) == [True, True, True]
    rows = {target: kinds for target, kinds, _ in placement(ref)}
    assert rows["aten.conv2d.default"][:2] == ("dq:torch.uint8:t", "dq:torch.int8:c")
    assert rows["aten.linear.default"][:2] == ("dq:torch.uint8:t", "dq:torch.int8:c")
    assert rows["aten.lstm.input"][0] == "dq:torch.int8:t"
    # pt2e alone leaves the LSTM float: its placement on the rest is what quantree keeps
    alone = {t: k for t, k, _ in placement(torchao_reference(model, data, x86()))}
    assert alone["aten.conv2d.default"][:2] == rows["aten.conv2d.default"][:2]
    assert all(not k.startswith("dq") for k in alone["aten.lstm.input"])
    with torch.no_grad():
        assert qt.sqnr(model(*data[0]), ref(*data[0])) > 20


def test_prepare_refuses_other_objects():
    gm = qt.capture(nn.Linear(2, 2).eval(), (torch.randn(1, 2),))
    with pytest.raises(qt.QuantreeError, match="pt2e Quantizer"):
        qt.prepare(gm, object())
