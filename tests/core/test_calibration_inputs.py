"""calibrate: a batch whose structure differs from the captured example is an error naming
the input by its path (``d['y']``, ``scale``) and the fix, before any observer sees it."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import quantree as qt
from quantree.core.calibrate import BadBatch


class DictAndScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, d: dict[str, torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        return self.linear(d["x"]) * scale + d["y"]


def _d(b: int = 2, **changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"x": torch.randn(b, 4), "y": torch.randn(b, 3)}
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


@pytest.fixture(scope="module")
def prepared() -> torch.fx.GraphModule:
    gm = qt.capture(DictAndScale().eval(), (_d(),), {"scale": 2.0})
    return qt.prepare(gm, qt.Int8Quantizer())


BAD = {
    "missing key": (((_d(y=None),), {"scale": 2.0}), r"d lacks key\(s\) 'y'"),
    "extra key": (((_d(z=torch.randn(2, 3)),), {"scale": 2.0}), r"d has key\(s\) 'z'"),
    "list for dict": (
        (([torch.randn(2, 4), torch.randn(2, 3)],), {"scale": 2.0}),
        r"d is a list, the program takes a dict",
    ),
    "float64": (
        ((_d(x=torch.randn(2, 4).double()),), {"scale": 2.0}),
        r"d\['x'\] as torch\.float64, .*captured with torch\.float32.*\.to\(torch\.float32\)",
    ),
    "integers for floats": (
        ((_d(x=torch.randint(0, 3, (2, 4))),), {"scale": 2.0}),
        r"d\['x'\] as torch\.int64",
    ),
    "tensor for a python number": (
        ((_d(),), {"scale": torch.tensor(2.0)}),
        r"scale as a tensor .*python float 2\.0 as a constant",
    ),
    "another python number": (((_d(),), {"scale": 3.0}), r"scale as float 3\.0.*constant"),
    "python number for a tensor": (((_d(y=1.0),), {"scale": 2.0}), r"d\['y'\] as a float"),
    "missing keyword": (((_d(),), {}), r"keyword argument\(s\) none, the program takes"),
    "rank": (((_d(x=torch.randn(2, 1, 4)),), {"scale": 2.0}), r"d\['x'\] with shape"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_batch_unlike_the_example_names_its_path(
    prepared: torch.fx.GraphModule, case: str
) -> None:
    batch, said = BAD[case]
    good = ((_d(),), {"scale": 2.0})
    with pytest.raises(BadBatch, match=r"calibration batch 1 .*" + said) as raised:
        qt.calibrate(prepared, [good, batch], progress=False)
    assert raised.value.index == 1
    assert "; " in str(raised.value)  # a fix follows the problem


def test_the_captured_batch_structure_still_calibrates(prepared: torch.fx.GraphModule) -> None:
    """Batch sizes vary (the batch is dynamic), dict order does not matter."""
    d = _d(5)
    reordered = {"y": d["y"], "x": d["x"]}
    assert (
        qt.calibrate(
            prepared, [((_d(),), {"scale": 2.0}), ((reordered,), {"scale": 2.0})], progress=False
        )
        == 2
    )


class Flatten(nn.Module):
    """The sequence length is fixed: the linear reads the flattened (length x features)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


def test_another_static_sequence_length_names_the_dimension_and_the_fix() -> None:
    prepared = qt.prepare(qt.capture(Flatten(), (torch.randn(2, 2, 3),)), qt.Int8Quantizer())
    qt.calibrate(prepared, [(torch.randn(5, 2, 3),)], progress=False)  # another batch: fine
    with pytest.raises(BadBatch, match=r"x\.size\(\)\[1\] == 2.*dynamic_shapes="):
        qt.calibrate(prepared, [(torch.randn(2, 3, 3),)], progress=False)


class State(NamedTuple):
    h: torch.Tensor
    c: torch.Tensor


class NamedTupleAndDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, state: State, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.linear(state.h) + state.c + extra["bias"]


def test_a_namedtuple_and_a_dict_are_two_arguments_not_args_and_kwargs() -> None:
    """A two-item batch ``(tuple, dict)`` used to be read as ``(args, kwargs)`` whatever
    the program takes."""
    model = NamedTupleAndDict().eval()

    def batch(b: int) -> tuple[State, dict[str, torch.Tensor]]:
        return State(torch.randn(b, 4), torch.randn(b, 4)), {"bias": torch.randn(b, 4)}

    args = batch(6)
    q = qt.quantize(
        model, batch(2), [batch(2), batch(3), args], progress=False, backend="reference"
    )
    with torch.no_grad():
        assert qt.sqnr(model(*args), q(*args)) >= 25.0
    with pytest.raises(BadBatch, match=r"state\.c .*|state is a"):
        qt.calibrate(
            qt.prepare(qt.capture(model, batch(2)), qt.Int8Quantizer()),
            [((torch.randn(2, 4), torch.randn(2, 4)), {"bias": torch.randn(2, 4)})],
            progress=False,
        )
