"""Values that hold -inf by design stay float automatically (``recipes.infinities``).

A small log-space recurrence as xLSTM's chunkwise mLSTM computes it: log-sigmoid forget
gates summed with ``cumsum``, their pairwise differences masked with ``where(causal, d,
-inf)``, a max stabiliser, ``exp``, then a matmul with the values. It quantizes with the
default recipe and no rule of the user's: the values the -inf reaches stay float, one
warning names them, the ``exp`` that ends them and everything after is quantized again, and
the lowered model is within 20 dB of float. An overflow nothing put there on purpose is
still refused at calibration.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.backends import CPU
from quantree.core.qdq import is_quantize
from quantree.recipes.infinities import carrying_infinities

T = 12


class LogGates(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fgate = nn.Linear(16, 1)
        self.value = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [1, T, 16]
        b = nn.functional.logsigmoid(self.fgate(x)).squeeze(-1).cumsum(-1)  # [1, T]
        d = b[:, :, None] - b[:, None, :]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        d = torch.where(causal, d, -float("inf"))
        m = d.max(-1, keepdim=True).values
        w = torch.exp(d - m)
        return self.out(torch.relu(w @ self.value(x)))


class Overflow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * 1e30 * 1e30)


def _data(n: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(1, T, 16, generator=g),) for _ in range(n)]


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


def test_log_space_recurrence_quantizes_with_its_infinities_float() -> None:
    torch.manual_seed(0)
    model = LogGates().eval()
    calib = _data(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", qt.QuantreeWarning)
        ref = qt.quantize(model, calib[0], calib, backend=qt.REFERENCE, progress=False)
    by_design = [w for w in caught if "by design" in str(w.message)]
    assert len(by_design) == 1
    text = str(by_design[0].message)
    named = text.split("reading them: ")[1].split(". No integer")[0]
    assert "where" in named and "max" in named and "exp" not in named
    # the exp output (the matmul's input) is quantized again; nothing holding -inf is
    quantized = {n.args[0] for n in ref.graph.nodes if is_quantize(n)}
    names = {getattr(n, "name", "") for n in quantized}
    assert any(name.startswith("exp") for name in names)
    assert not any(name.startswith(("where", "sub_1", "max")) for name in names)
    lowered = qt.lower(ref, CPU)
    x = _data(9)[-1]
    assert _sqnr(model(*x), lowered(*x)) > 20


def test_the_analysis_stops_at_exp() -> None:
    gm = torch.export.export(LogGates().eval(), _data(1)[0]).module()
    found = {n.target.__name__.split(".")[0] for n in carrying_infinities(gm.graph)}
    assert {"where", "max", "sub"} <= found
    assert not found & {"exp", "matmul", "linear", "relu", "cumsum", "log_sigmoid_forward"}


def test_an_overflow_is_still_refused() -> None:
    calib = _data(2)
    with pytest.raises(qt.QuantreeError, match="computed NaN or infinity"):
        qt.quantize(Overflow().eval(), calib[0], calib, backend=qt.REFERENCE, progress=False)


def test_exponents_stay_float_back_to_where_they_were_made() -> None:
    """The log-gate sums (cumsum of log-sigmoid) and the stabiliser an exp reads are float;
    the log-sigmoid made the log values: its output is float, the linear it reads is not."""
    from quantree.recipes.infinities import exponents

    gm = torch.export.export(LogGates().eval(), _data(1)[0]).module()
    found = {n.target.__name__.split(".")[0] for n in exponents(gm.graph)}
    assert {"sub", "max", "cumsum", "log_sigmoid"} <= found
    assert not found & {"exp", "matmul", "relu", "linear"}


class PaddedAttention(nn.Module):
    """A key padding mask filled with -inf, read by ``nn.MultiheadAttention`` (one fused
    attention call), then a linear: the mask is the only non-finite value."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [1, T, 16]
        pad = torch.zeros(1, T, dtype=torch.bool)
        pad[:, T - 3 :] = True
        mask = torch.zeros(1, T).masked_fill(pad, -float("inf"))
        y, _ = self.attn(x, x, x, key_padding_mask=mask, need_weights=False)
        return self.out(y)


def test_a_masked_attention_ends_the_masks_infinities() -> None:
    """The attention's softmax ends the mask's -inf: what it returns and everything after it
    is finite, so the linear after it is quantized (its input and weight); a query, key or
    value holding an infinity would still make the attention's output one."""
    gm = torch.export.export(PaddedAttention().eval(), _data(1)[0]).module()
    found = carrying_infinities(gm.graph)
    attention = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert attention and not set(attention) & found
    assert any("masked_fill" in str(n.target) for n in found)
    model = PaddedAttention().eval()
    calib = _data(8)
    ref = qt.quantize(model, calib[0], calib, backend=qt.REFERENCE, progress=False)
    out_linear = [n for n in ref.graph.nodes if "linear" in str(n.target)][-1]
    assert all(is_quantize(a.args[0]) or "dequantize" in str(a.target)
               for a in out_linear.all_input_nodes[:2])  # fmt: skip
    x = _data(9)[-1]
    assert _sqnr(model(*x), ref(*x)) > 30


class TimeStepLimit(nn.Module):
    """Mamba-2's time step: ``clamp(softplus(dt), 0, inf)`` (``time_step_limit`` defaults to
    ``(0.0, inf)``), then products the next linear reads."""

    def __init__(self, low: float = 0.0, high: float = float("inf")) -> None:
        super().__init__()
        self.dt = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)
        self.low, self.high = low, high

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = torch.clamp(nn.functional.softplus(self.dt(x)), self.low, self.high)
        return self.out(dt * x)


@pytest.mark.parametrize(
    ("low", "high", "carries"),
    [
        (0.0, float("inf"), False),
        (-float("inf"), 1.0, False),
        (-float("inf"), float("inf"), False),
        (float("inf"), float("inf"), True),
        (0.0, -float("inf"), True),
        (0.0, float("nan"), True),
    ],
)
def test_an_infinite_clamp_bound_writes_no_infinity(low: float, high: float, carries: bool) -> None:
    """A bound of +inf above (-inf below) never binds; +inf below, -inf above or NaN does
    write a non-finite value."""
    gm = torch.export.export(TimeStepLimit(low, high).eval(), _data(1)[0]).module()
    found = {str(n.target) for n in carrying_infinities(gm.graph)}
    assert any("clamp" in t for t in found) == carries
    assert any("linear" in t or "mul" in t for t in found) == carries


def test_the_linear_after_an_unbounded_clamp_is_quantized() -> None:
    model = TimeStepLimit().eval()
    calib = _data(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", qt.QuantreeWarning)
        ref = qt.quantize(model, calib[0], calib, backend=qt.REFERENCE, progress=False)
    assert not [w for w in caught if "by design" in str(w.message)]
    out_linear = [n for n in ref.graph.nodes if "linear" in str(n.target)][-1]
    assert "dequantize" in str(out_linear.args[0].target)
