"""Property: any nested pytree of inputs (tuples, lists, dicts, namedtuples and dataclasses
of tensors, mixed with python values and None) goes through quantize + lower, and the
quantized model returns the user's structure and types, close to the reference graph, at
two batch sizes other than the example's.

The model maps every tensor leaf ``x_i`` (batch x 4) to ``relu(linear(x_i)) + mix(x_0)``
and rebuilds the input's tree around the results, python values passed through, so the
output tree is the input tree. Thresholds: lowered against reference >= 30 dB (both are the
same int8 arithmetic, differing only in rounding order; one int8 step on these ranges is
about 40 dB), and >= 20 dB against float (int8 linears on unclipped inputs: calibration
sees the test batches too). ``QUANTREE_TREE_EXAMPLES`` sets the number of examples (6).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._pytree import tree_flatten, tree_structure, tree_unflatten

import quantree as qt

EXAMPLES = int(os.environ.get("QUANTREE_TREE_EXAMPLES", "6"))
FEATURES = 4


class Pair(NamedTuple):
    first: Any
    second: Any


@dataclasses.dataclass
class Box:
    inner: Any
    other: Any


TENSOR = "tensor"  # a placeholder leaf, replaced by a (batch x 4) tensor per batch


def _trees() -> st.SearchStrategy[Any]:
    python = st.sampled_from([None, 3, 1.5, "tag", True])
    leaves = st.one_of(st.just(TENSOR), st.just(TENSOR), python)

    def nodes(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.lists(children, min_size=1, max_size=3).map(tuple),
            st.lists(children, min_size=1, max_size=3),
            st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3),
            st.builds(Pair, children, children),
            st.builds(Box, children, children),
        )

    return st.recursive(leaves, nodes, max_leaves=5).filter(
        lambda t: 1 <= tree_flatten(t)[0].count(TENSOR) <= 4
    )


def _fill(tree: Any, batch: int, g: torch.Generator) -> Any:
    leaves, spec = tree_flatten(tree)
    filled = [torch.randn(batch, FEATURES, generator=g) if v == TENSOR else v for v in leaves]
    return tree_unflatten(filled, spec)


class Routes(nn.Module):
    def __init__(self, tensors: int) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(FEATURES, FEATURES) for _ in range(tensors))
        self.mix = nn.Linear(FEATURES, FEATURES)

    def forward(self, tree: Any, *, scale: Any = None) -> Any:
        leaves, spec = tree_flatten(tree)
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        shared = self.mix(tensors[0])
        out, i = [], 0
        for v in leaves:
            if isinstance(v, torch.Tensor):
                y = torch.relu(self.linears[i](v)) + shared
                out.append(y * scale if isinstance(scale, torch.Tensor) else y)
                i += 1
            else:
                out.append(v)
        return tree_unflatten(out, spec)


def _same_types(want: Any, got: Any) -> None:
    assert tree_structure(want) == tree_structure(got)
    for w, g in zip(tree_flatten(want)[0], tree_flatten(got)[0], strict=True):
        assert type(w) is type(g)
        if isinstance(w, torch.Tensor):
            assert w.dtype == g.dtype and w.shape == g.shape
        else:
            assert w == g


def _floats(tree: Any) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)])


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(tree=_trees(), keyword=st.booleans())
@example(  # every kind of node and python value at once
    tree={"a": Pair(TENSOR, [TENSOR, None, "tag"]), "b": Box(3, (TENSOR, 1.5, True))},
    keyword=True,
)
def test_random_input_trees_quantize_lower_and_keep_their_structure(
    tree: Any, keyword: bool
) -> None:
    torch.manual_seed(0)
    model = Routes(tree_flatten(tree)[0].count(TENSOR)).eval()
    g = torch.Generator().manual_seed(0)

    def call(batch: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs = {"scale": torch.rand(batch, 1, generator=g) + 0.5} if keyword else {}
        return (_fill(tree, batch, g),), kwargs

    tests = [call(3), call(6)]
    data = [call(4) for _ in range(8)] + tests
    example = call(4)
    reference = qt.quantize(
        model, example[0], data, example_kwargs=example[1], progress=False, backend="reference"
    )
    lowered = qt.lower(reference, "cpu")
    for args, kwargs in tests:
        with torch.no_grad():
            want = model(*args, **kwargs)
            ref, low = reference(*args, **kwargs), lowered(*args, **kwargs)
        _same_types(want, ref)
        _same_types(want, low)
        assert qt.sqnr(_floats(ref), _floats(low)) >= 30.0
        assert qt.sqnr(_floats(want), _floats(low)) >= 20.0
