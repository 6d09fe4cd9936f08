"""capture: the batch varies for every way a model takes its inputs, or one warning says not.

Each model routes its inputs through a linear layer (quantized) and an add, is calibrated
on 16 batches of 4 and one each of 3 and 7 (so no test input is clipped), and called at
batches of 3 and 7. The quantized output is compared with the
float model's: SQNR >= 25 dB (int8 activations and weights on a 4 -> 3 linear measure
35-45 dB here).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import quantree as qt

Make = Callable[[int, torch.Generator], tuple[tuple[Any, ...], dict[str, Any]]]


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)


class Kwargs(Base):
    def forward(self, x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + kwargs["y"]


class DefaultAndKwargs(Base):
    def forward(self, x: torch.Tensor, y: Any = None, **kwargs: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + y + kwargs["z"]


class KeywordOnly(Base):
    def forward(self, x: torch.Tensor, *, y: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return self.linear(x) * scale + y


class HuggingFaceStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.linear = nn.Linear(4, 3)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> torch.Tensor:
        assert input_ids is not None and attention_mask is not None
        return self.linear(self.embed(input_ids)) * attention_mask.unsqueeze(-1)


class DictInput(Base):
    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.linear(inputs["x"]) + inputs["y"]


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


class DataclassInput(Base):
    def forward(self, pair: Pair) -> torch.Tensor:
        return self.linear(pair.x) + pair.y


class NamedPair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class NamedTupleInput(Base):
    def forward(self, pair: NamedPair) -> torch.Tensor:
        return self.linear(pair.x) + pair.y


class VarArgsAndKeyword(Base):
    def forward(self, x: torch.Tensor, *rest: torch.Tensor, bias: Any = None) -> torch.Tensor:
        return self.linear(x) + rest[0] + bias


def _xy(b: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 4, generator=g), torch.randn(b, 3, generator=g)


def _ids(b: int, g: torch.Generator) -> dict[str, Any]:
    return {
        "input_ids": torch.randint(0, 10, (b, 6), generator=g),
        "attention_mask": (torch.rand(b, 6, generator=g) > 0.3).float(),
    }


CASES: dict[str, tuple[type[nn.Module], Make]] = {
    "**kwargs": (Kwargs, lambda b, g: ((_xy(b, g)[0],), {"y": _xy(b, g)[1]})),
    "default and **kwargs": (
        DefaultAndKwargs,
        lambda b, g: ((_xy(b, g)[0],), {"y": _xy(b, g)[1], "z": _xy(b, g)[1]}),
    ),
    "keyword-only": (KeywordOnly, lambda b, g: ((_xy(b, g)[0],), {"y": _xy(b, g)[1]})),
    "hugging face keywords": (HuggingFaceStyle, lambda b, g: ((), _ids(b, g))),
    "dict": (DictInput, lambda b, g: ((dict(zip("xy", _xy(b, g), strict=True)),), {})),
    "dataclass": (DataclassInput, lambda b, g: ((Pair(*_xy(b, g)),), {})),
    "namedtuple": (NamedTupleInput, lambda b, g: ((NamedPair(*_xy(b, g)),), {})),
    "*args and keyword": (
        VarArgsAndKeyword,
        lambda b, g: ((*_xy(b, g),), {"bias": _xy(b, g)[1]}),
    ),
}


def _state(model: nn.Module) -> tuple[bool, dict[str, torch.Tensor]]:
    return model.training, {k: v.clone() for k, v in model.state_dict().items()}


def _same_state(
    a: tuple[bool, dict[str, torch.Tensor]], b: tuple[bool, dict[str, torch.Tensor]]
) -> bool:
    return (
        a[0] == b[0]
        and a[1].keys() == b[1].keys()
        and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    )


def _quantize(
    model: nn.Module, make: Make, backend: str = "reference", extra: tuple[Any, ...] = ()
) -> tuple[Any, list[str]]:
    g = torch.Generator().manual_seed(0)
    example = make(4, g)
    data = [make(4, g) for _ in range(16)] + list(extra)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", qt.QuantreeWarning)
        q = qt.quantize(
            model, example[0], data, example_kwargs=example[1], backend=backend, progress=False
        )
    said = [str(w.message) for w in caught if issubclass(w.category, qt.QuantreeWarning)]
    return q, said


@pytest.mark.parametrize("case", list(CASES))
def test_every_signature_keeps_a_varying_batch(case: str) -> None:
    kind, make = CASES[case]
    torch.manual_seed(0)
    model = kind().eval()
    before = _state(model)
    g = torch.Generator().manual_seed(1)
    calls = [make(batch, g) for batch in (3, 7)]
    q, said = _quantize(model, make, extra=tuple(calls))  # no test input is clipped
    assert not [s for s in said if "fixed shapes" in s], said
    for args, kwargs in calls:
        with torch.no_grad():
            want, got = model(*args, **kwargs), q(*args, **kwargs)
        assert got.shape == want.shape
        assert qt.sqnr(want, got) >= 25.0
    assert _same_state(before, _state(model))


@pytest.mark.parametrize("case", ["**kwargs", "dataclass"])
def test_lowered_models_keep_a_varying_batch(case: str) -> None:
    kind, make = CASES[case]
    torch.manual_seed(0)
    model = kind().eval()
    args, kwargs = make(7, torch.Generator().manual_seed(1))
    q, said = _quantize(model, make, backend="cpu", extra=((args, kwargs),))
    assert not [s for s in said if "fixed shapes" in s], said
    with torch.no_grad():
        assert qt.sqnr(model(*args, **kwargs), q(*args, **kwargs)) >= 25.0


def test_a_var_keyword_model_takes_dynamic_shapes_spelled_by_its_parameters() -> None:
    """torch.export (2.13) refuses every dynamic_shapes for a **kwargs that collects
    arguments; the ``{"kwargs": {...}}`` spelling of its own signature is accepted here."""
    model = Kwargs().eval()
    batch = torch.export.Dim("batch")
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    gm = qt.capture(
        model, (x,), {"y": y}, dynamic_shapes={"x": {0: batch}, "kwargs": {"y": {0: batch}}}
    )
    x, y = torch.randn(9, 4), torch.randn(9, 3)
    assert torch.equal(gm(x, y=y), model(x, y=y))


class Linear(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_a_fixed_batch_is_one_warning_and_a_clear_error_at_another_batch() -> None:
    """An example batch of 1 is always fixed by torch.export; that used to pass silently."""
    model = Linear().eval()
    data = [(torch.randn(1, 4),) for _ in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", qt.QuantreeWarning)
        q = qt.quantize(model, data[0], data, progress=False, backend="reference")
    said = [str(w.message) for w in caught if issubclass(w.category, qt.QuantreeWarning)]
    assert len(said) == 1, said
    assert "fixed shapes" in said[0] and "batch size is 1" in said[0]
    assert "dynamic_shapes=" in said[0]
    with pytest.raises(qt.QuantreeError, match=r"captured with \(1, 4\)"):
        q(torch.randn(3, 4))


def test_fixing_the_batch_on_purpose_does_not_warn() -> None:
    model = Linear().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        gm = qt.capture(model, (torch.randn(1, 4),), dynamic_batch=False)
    with pytest.raises(qt.QuantreeError, match=r"captured with \(1, 4\)"):
        gm(torch.randn(2, 4))


def test_the_keyword_view_leaves_the_model_alone() -> None:
    """Capture exports a shallow view of a **kwargs model with its own forward; the model
    keeps its forward, parameters and mode."""
    model = Kwargs().train()
    before = _state(model)
    qt.capture(model, (torch.randn(2, 4),), {"y": torch.randn(2, 3)})
    assert "forward" not in vars(model)
    assert _same_state(before, _state(model))
    assert model.training
