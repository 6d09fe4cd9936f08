"""inspect's vocabulary: int8 data movement and fused conv+relu are int8, native ops are
counted, and a model in memory and its saved .pt2 name their nodes alike."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.tools import inspection
from quantree.tools.inspection import INT8_KERNEL, INT8_MOVE, SIMULATED, op_statuses, summary


class ConvReluTranspose(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 3)
        self.lin = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x)).transpose(1, 2)
        return self.lin(y)


@pytest.fixture(scope="module")
def reference() -> tuple[torch.fx.GraphModule, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    data = [(torch.randn(2, 8, 10),) for _ in range(4)]
    model = ConvReluTranspose().eval()
    return qt.quantize(model, data[0], data, progress=False, backend="reference"), data


def _by_name(gm: torch.fx.GraphModule) -> dict[str, inspection.OpStatus]:
    return {o.node: o for o in op_statuses(gm)}


def test_transpose_between_int8_qdq_and_fused_conv_relu_are_int8(reference) -> None:
    gm, _ = reference
    ops = _by_name(gm)
    assert ops["transpose"].status == INT8_MOVE
    assert ops["conv1d"].status == SIMULATED and ops["conv1d"].fused_with == "relu"
    assert ops["relu"].status == SIMULATED and ops["relu"].fused_with == "conv1d"
    text = summary(gm, "ref")
    assert "stay in float" not in text and "0 computing in float" in text
    assert "run natively on int8: 0 of 4 op(s)" in text


def test_lowered_native_ops_and_int8_transpose_count_as_int8(reference, tmp_path: Path) -> None:
    from quantree.backends import CPU, save
    from quantree.backends.cpu.saved.serialize import fold_saved_recipes
    from quantree.tools.files import load_program

    gm, data = reference
    lowered = qt.lower(gm, CPU)
    ops = _by_name(lowered)
    assert ops["conv1d"].status == INT8_KERNEL and ops["linear"].status == INT8_KERNEL
    assert ops["transpose"].status == INT8_MOVE and ops["transpose"].native
    text = summary(lowered, "m")
    assert "stay in float" not in text
    assert "run natively on int8: 3 of 3 op(s) (int8 kernel 2, int8 data movement 1)" in text
    # the report reads the model in memory, `quantree inspect` the saved file: same words
    path = tmp_path / "m.pt2"
    save(lowered, path, data[0])
    saved = load_program(path).module()
    fold_saved_recipes(saved, path)  # as `quantree inspect` does: derived constants, not ops
    assert summary(saved, "m") == text


def test_node_names_drop_the_overload_a_backend_adds() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.transpose.int, (x, 0, 1))
    node.name = "transpose_int"
    other = graph.call_function(torch.ops.aten.transpose.int, (x, 0, 1))
    other.name = "transpose_int_1"
    assert inspection.node_name(node) == "transpose"
    assert inspection.node_name(other) == "transpose_1"
    assert inspection.node_name(x) == "x"


def test_per_channel_qparams_computed_by_the_graph_are_described_not_crashed_on() -> None:
    """A per-channel dequantize whose scale is a computed node, not an attribute (found on
    torchvision's regnet_y_400mf: ``inspect`` raised AttributeError on a None scale)."""
    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    scale_src = graph.placeholder("scale_src")
    scale = graph.call_function(torch.ops.aten.abs.default, (scale_src,))
    zp = graph.call_function(torch.ops.aten.zeros_like.default, (scale_src,))
    dq = graph.call_function(
        torch.ops.quantized_decomposed.dequantize_per_channel.default,
        (q, scale, zp, 0, -127, 127, torch.int8),
    )
    graph.output(dq)
    gm = torch.fx.GraphModule(nn.Module(), graph)
    described = inspection._scheme(gm, dq)
    assert described == "per-channel axis 0, scale from abs, zero_point from zeros_like"
    scale.meta["val"] = torch.tensor([0.5, 0.25])
    zp.meta["val"] = torch.tensor([0, 1])
    described = inspection._scheme(gm, dq)
    assert described == "per-channel axis 0 (2 ch), scale 0.25..0.5, zero_point 0..1"


def test_a_per_channel_scale_that_requires_grad_is_read_without_a_torch_warning() -> None:
    """A loaded .pt2 can hold its scales as parameters (requires_grad): reading one as a
    number made torch warn "Converting a tensor with requires_grad=True to a scalar" under
    ``quantree inspect``."""
    root = nn.Module()
    root.scale = nn.Parameter(torch.tensor([0.5, 0.25]))
    root.register_buffer("zp", torch.tensor([0, 1]))
    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    dq = graph.call_function(
        torch.ops.quantized_decomposed.dequantize_per_channel.default,
        (q, graph.get_attr("scale"), graph.get_attr("zp"), 0, -127, 127, torch.int8),
    )
    graph.output(dq)
    gm = torch.fx.GraphModule(root, graph)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        described = inspection._scheme(gm, dq)
    assert described == "per-channel axis 0 (2 ch), scale 0.25..0.5, zero_point 0..1"
