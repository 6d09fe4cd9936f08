"""quantize: what becomes of models that mutate state, train, switch grad/autocast, or
return things that are not float tensors. Defined here:

- The user's model is never changed: parameters, buffers and its training flag are
  bit-equal after quantize (and after calling the quantized model).
- A model in train mode is captured in eval mode (quantization is for inference: batch
  norm reads its running statistics) and left in train mode.
- A buffer written in place by an op the recipe would quantize (a counter) is a
  QuantreeError naming the op and the fix; a buffer written by a copy (a KV cache) stays
  float state of the quantized model, never the user's tensor.
- ``torch.no_grad`` inside forward: its region stays float, named in a QuantreeWarning.
  ``torch.autocast`` inside forward: a QuantreeError at capture naming it.
- None, python numbers and strings among the outputs pass through unchanged; int and bool
  tensor outputs are computed from the quantized graph and keep their dtype.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import quantree as qt


def _snapshot(model: nn.Module) -> tuple[bool, dict[str, torch.Tensor]]:
    return model.training, {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: tuple[bool, dict[str, torch.Tensor]]) -> bool:
    now = _snapshot(model)
    return now[0] == before[0] and all(torch.equal(now[1][k], v) for k, v in before[1].items())


def _data(n: int = 6, batch: int = 4) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 4, generator=g),) for _ in range(n)]


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


@pytest.mark.parametrize("train", [False, True])
def test_an_in_place_counter_is_an_error_naming_the_op(train: bool) -> None:
    model = Counter().train(train)
    before = _snapshot(model)
    with pytest.raises(qt.QuantreeError, match=r"add_.*writes calls in place"):
        qt.quantize(model, _data()[0], _data(), progress=False, backend="reference")
    assert _unchanged(model, before)


class Cache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.cache.copy_(y.detach()[:4])
        return y + self.cache.mean()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_cache_written_in_forward_is_the_quantized_models_own_state(backend: str) -> None:
    model = Cache().eval()
    before = _snapshot(model)
    data = _data()
    q = qt.quantize(model, data[0], data, backend=backend, progress=False)
    q(torch.randn(5, 4))
    assert _unchanged(model, before)


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


def test_a_model_in_train_mode_is_quantized_as_in_eval_mode_and_left_training() -> None:
    torch.manual_seed(0)
    model = Normed()
    model.norm.running_mean.uniform_(-1, 1)
    model.norm.running_var.uniform_(0.5, 2)
    model.train()
    before = _snapshot(model)
    data = _data()
    q = qt.quantize(model, data[0], data, progress=False, backend="reference")
    assert _unchanged(model, before) and model.training
    x = data[0][0]
    with torch.no_grad():
        want = model.eval()(x)  # running statistics, not the batch's
    model.train()
    assert qt.sqnr(want, q(x)) >= 25.0


class GradAndAutocast(nn.Module):
    def __init__(self, autocast: bool) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.autocast = autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = self.first(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            z = self.second(y)
        return z.float()


def test_no_grad_inside_forward_stays_float_and_is_named() -> None:
    model = GradAndAutocast(autocast=False).eval()
    data = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", qt.QuantreeWarning)
        q = qt.quantize(model, data[0], data, progress=False, backend="reference")
    said = " ".join(str(w.message) for w in caught if issubclass(w.category, qt.QuantreeWarning))
    assert "wrap_with_set_grad_enabled" in said
    x = data[1][0]
    with torch.no_grad():
        assert qt.sqnr(model(x), q(x)) >= 25.0


def test_autocast_inside_forward_is_an_error_at_capture() -> None:
    """It used to quantize and then fail on every call with torch's "Tensor dtype
    mismatch! Expected: BFloat16, Got: float"."""
    model = GradAndAutocast(autocast=True).eval()
    with pytest.raises(qt.QuantreeError, match=r"autocast inside forward.*Remove"):
        qt.capture(model, _data()[0])


class ManyOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        y = self.linear(x)
        return {
            "y": y,
            "none": None,
            "count": 3,
            "scale": 1.5,
            "name": "logits",
            "index": y.argmax(-1),
            "positive": y > 0,
            "total": (y > 0).sum(),
        }


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_non_float_outputs_pass_through_and_keep_their_types(backend: str) -> None:
    model = ManyOutputs().eval()
    data = _data()
    q = qt.quantize(model, data[0], data, backend=backend, progress=False)
    x = data[2][0]
    with torch.no_grad():
        want, got = model(x), q(x)
    assert list(got) == list(want)
    for key in ("none", "count", "scale", "name"):
        assert got[key] == want[key] and type(got[key]) is type(want[key])
    for key in ("index", "positive", "total"):
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape
    assert qt.sqnr(want["y"], got["y"]) >= 25.0
    assert (got["index"] == want["index"]).float().mean() >= 0.5  # argmax of close logits
