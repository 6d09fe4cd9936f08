"""Per-op behaviour of the default recipe beyond the nested cases: conv, bn folding, pools."""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import quantree as qt

from support import assert_prepared_exact, batches, calls, output_sqnrs, qd, run


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU6(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.conv1d = nn.Conv1d(4, 4, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x, seq):
        return self.head(self.features(x)), torch.relu(self.conv1d(seq)).mean(-1)


def test_conv_net_is_fully_quantized_with_batch_norm_folded():
    torch.manual_seed(0)
    model = ConvNet().eval()
    with torch.no_grad():
        bn = model.features[1]
        (
            bn.running_mean.uniform_(-1, 1),
            bn.running_var.uniform_(0.5, 2.0),
            bn.weight.uniform_(0.5, 2),
        )
    data = batches((2, 3, 12, 12), (2, 4, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)  # every op has a rule
        prepared, ref = run(model, data)
    assert not calls(ref, torch.ops.aten.batch_norm.default)
    assert len(calls(ref, torch.ops.aten.conv2d.default)) == 2
    with torch.no_grad():  # folding changes rounding only
        for a, b in zip(model(*data[0]), prepared(*data[0]), strict=True):
            assert torch.allclose(a, b, atol=1e-5)
    assert min(output_sqnrs(model, ref, data[0])) >= 25.0


def test_prepared_equals_float_exactly_without_batch_norm():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AvgPool2d(2)).eval()
    data = batches((2, 3, 8, 8))
    prepared, ref = run(model, data)
    assert_prepared_exact(model, prepared, data[0])
    assert min(output_sqnrs(model, ref, data[0])) >= 25.0


class Activations(nn.Module):
    """Every activation with a rule of its own, functional and in place (as export keeps them)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.in_place = nn.Sequential(
            nn.SiLU(inplace=True),
            nn.Hardswish(inplace=True),
            nn.LeakyReLU(inplace=True),
            nn.ELU(inplace=True),
            nn.Hardsigmoid(inplace=True),
        )

    def forward(self, x):
        y = self.fc(x)
        outs = [
            torch.nn.functional.gelu(y),
            torch.nn.functional.silu(y),
            torch.nn.functional.hardswish(y),
            torch.nn.functional.hardsigmoid(y),
            torch.nn.functional.elu(y),
            torch.nn.functional.leaky_relu(y, 0.1),
            torch.nn.functional.relu6(y),
            torch.softmax(y, -1),
            self.in_place(y * 1.0),
        ]
        z = y * 1.0
        z.add_(y)
        z.mul_(y)
        z.sub_(y)
        torch.nn.functional.hardtanh_(z)
        return (*outs, z.relu_())


def test_activations_and_in_place_ops_are_quantized():
    torch.manual_seed(0)
    model = Activations().eval()
    data = batches((4, 8), n=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)  # every op has a rule
        prepared, ref = run(model, data)
    assert_prepared_exact(model, prepared, data[0])
    float_ops = [
        n
        for n in ref.graph.nodes
        if n.op == "call_function"
        and n.target is not operator.getitem
        and n.target.namespace != "quantized_decomposed"
    ]
    for node in float_ops:  # each op's result is quantized where it is produced
        assert any(u.target is qd.quantize_per_tensor.default for u in node.users), node.name
    assert min(output_sqnrs(model, ref, data[0])) >= 25.0


class MaskedAttention(nn.Module):
    """Location-style attention (Tacotron2): energies masked with -inf, softmax, bmm."""

    def __init__(self) -> None:
        super().__init__()
        self.energy = nn.Linear(8, 1)

    def forward(self, memory: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        energies = self.energy(memory).squeeze(-1).masked_fill(mask, float("-inf"))
        weights = torch.softmax(energies, 1)
        return torch.bmm(weights.unsqueeze(1), memory)


def test_softmax_of_energies_masked_with_infinity_reads_them_in_float():
    """Calibration once failed with "NaN or infinite values at softmax.input[0]"."""
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True  # padding
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 5, 8, generator=g), mask) for _ in range(4)]
    model = MaskedAttention().eval()
    ref = qt.quantize(model, data[0], data, progress=False, backend="reference")
    (softmax,) = calls(ref, torch.ops.aten.softmax.int)
    assert "dequantize" not in str(softmax.args[0].target)
    with torch.no_grad():
        out = ref(*data[1])
        assert torch.isfinite(out).all()
        assert qt.sqnr(model(*data[1]), out) > 25.0


class AttentionWeights(nn.Module):
    """nn.MultiheadAttention's averaged weights alone (no matmul reads the softmax, so the
    graph is quantized EVERY_OP): the key padding mask, -inf where padded, is added to the
    scores by ``baddbmm``."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.mha(x, x, x, key_padding_mask=mask)[1])


class CausalWeights(AttentionWeights):
    """The same with nn.Transformer's causal mask, ``triu(full(-inf), 1)``."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.mha(x, x, x, attn_mask=causal)[1])


class AdditiveMask(nn.Module):
    """Scores plus a mask built with -inf, then softmax and log_softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        additive = torch.zeros(mask.shape).masked_fill(mask, float("-inf"))
        scores = self.score(x).squeeze(-1) + additive
        pooled = (scores.softmax(-1).unsqueeze(-1) * x).sum(1)
        return pooled, scores.log_softmax(-1)


@pytest.mark.parametrize("make", [AttentionWeights, CausalWeights, AdditiveMask])
def test_scores_summed_with_an_infinite_mask_stay_float(make):
    """Calibration once refused these: "the model computed NaN or infinity at group ..
    (softmax.input[0])" (the walk to the mask stopped at the sum)."""
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 5, 8, generator=g), mask) for _ in range(4)]
    torch.manual_seed(0)
    model = make().eval()
    ref = qt.quantize(model, data[0], data, progress=False, backend="reference")
    with torch.no_grad():
        wants, gots = tree_leaves(model(*data[1])), tree_leaves(ref(*data[1]))
        for want, got in zip(wants, gots, strict=True):
            assert torch.equal(torch.isfinite(want), torch.isfinite(got))
            finite = torch.isfinite(want)
            assert qt.sqnr(want[finite], got[finite]) > 25.0


class SeparableAttention(nn.Module):
    """MobileViT-v2's block: conv, group norm over all channels, a context vector summed
    over the patches (softmax-weighted), no matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.norm = nn.GroupNorm(1, 8)
        self.qkv = nn.Conv2d(8, 17, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(self.conv(x))).split([1, 8, 8], dim=1)
        context = (k * torch.softmax(q, dim=-1)).sum(dim=-1, keepdim=True)
        return torch.relu(v) * context


def test_group_norm_and_sum_have_rules_under_both_activation_points():
    """Both were once named as ops no rule matches (MobileViT-v2: 30 of them)."""
    torch.manual_seed(0)
    model, data = SeparableAttention().eval(), batches((2, 4, 6, 6), n=6)
    every = qt.Int8Quantizer(activations=qt.ActivationPoints.EVERY_OP)
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)  # every op has a rule
        _, auto = run(model, data)  # group norm: what weights read, the rest float
        _, ref = run(model, data, every)
    dq, q = qd.dequantize_per_tensor.default, qd.quantize_per_tensor.default
    for target in (torch.ops.aten.group_norm.default, torch.ops.aten.sum.dim_IntList):
        (float_node,) = calls(auto, target)
        assert float_node.args[0].target is not dq
        (node,) = calls(ref, target)
        assert node.args[0].target is dq
        assert [u.target for u in node.users] == [q]
    assert min(output_sqnrs(model, ref, data[0])) >= 25.0  # measured 30.0 dB
