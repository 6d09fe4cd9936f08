"""An independent per-op SQNR, to check ``qt.compare`` against: written apart from it.

Every node of both graphs is run by a plain ``fx.Interpreter`` that keeps a *copy* of each
node's output taken the moment the node ran, so an in-place op later in the graph (``relu_``,
``add_``) cannot change what was kept. A row's float tensor is the copy of its node's output
in the float graph; its quantized tensor is the copy at the node compare says it read
(``TensorRow.read_at``), an int8 kernel's output dequantized with its grid. Signal and noise
energies are summed over the batches in float64 before the ratio, as compare states it does.
A row compare says every reader clamps (``TensorRow.clamped``, checked against the float
graph's readers here) has both tensors clamped to that interval first, as compare states.
Rows inside nested graphs (a cells-mode body) are not covered: the float models these tests
pass are user modules, which have none.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten_with_path, tree_map

import quantree as qt
from quantree.core.normalizing.normalize import normalize
from quantree.core.stages import OUTPUT_GRID_KEY
from quantree.tools.compare import TensorRow

BOUND_DB = 0.5
"""How far a compare row may be from the independent measurement (the issue's bound)."""


def _copy(x: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, x)


class Copying(fx.Interpreter):
    """Runs a GraphModule, keeping a copy of every node's output; observers are not run."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.copies: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_module" and isinstance(self.fetch_attr(str(n.target)), qt.Observer):
            return None
        out = super().run_node(n)
        self.copies[n.name] = _copy(out)
        return out


def _leaf(value: Any, path: Iterable[Any]) -> Any:
    for part in path:
        value = value[part]
    return value


def _arg(node: fx.Node, path: tuple[Any, ...]) -> Any:
    value: Any = node.args[path[0]] if isinstance(path[0], int) else node.kwargs[path[0]]
    return _leaf(value, path[1:])


def float_graph(model: torch.nn.Module, args: tuple[Any, ...]) -> fx.GraphModule:
    """The graph compare runs for a user's module: captured, then normalized as prepare is."""
    return normalize(qt.capture(model, args))


def independent_sqnrs(
    float_gm: fx.GraphModule,
    quantized: fx.GraphModule,
    rows: Iterable[TensorRow],
    batches: Iterable[tuple[Any, ...]],
) -> dict[str, float]:
    """The SQNR of each root-scope row of a comparison, measured from copies as above."""
    rows = [r for r in rows if "/" not in r.node]
    by_name = {n.name: n for n in quantized.graph.nodes}
    float_nodes = {n.name: n for n in float_gm.graph.nodes}
    signal = dict.fromkeys((r.name for r in rows), 0.0)
    noise = dict.fromkeys((r.name for r in rows), 0.0)
    with torch.no_grad():
        for args in batches:
            f_run, q_run = Copying(float_gm), Copying(quantized)
            f_out = _copy(f_run.run(*_copy(args)))
            q_out = _copy(q_run.run(*_copy(args)))
            f_leaves = dict(tree_flatten_with_path(f_out)[0])
            q_leaves = dict(tree_flatten_with_path(q_out)[0])
            for r in rows:
                want, got = _pair(r, f_run, q_run, float_nodes, by_name, f_leaves, q_leaves)
                w, g = want.double(), got.double()
                if r.clamped is not None:
                    _assert_all_readers_clamp(float_nodes[r.node], r.clamped)
                    w, g = w.clamp(*r.clamped), g.clamp(*r.clamped)
                signal[r.name] += float(w.pow(2).sum())
                noise[r.name] += float((w - g).pow(2).sum())
    return {
        name: math.inf
        if noise[name] == 0
        else -math.inf
        if signal[name] == 0
        else 10 * math.log10(signal[name] / noise[name])
        for name in signal
    }


def _pair(
    r: TensorRow,
    f_run: Copying,
    q_run: Copying,
    float_nodes: dict[str, fx.Node],
    by_name: dict[str, fx.Node],
    f_leaves: dict[Any, Any],
    q_leaves: dict[Any, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    if r.kind.value == "output":
        ((key, want),) = [(k, v) for k, v in f_leaves.items() if _same_path(k, r.path)]
        return want, q_leaves[key]
    assert r.read_at is not None, r
    at, at_path = r.read_at
    if r.kind.value == "weight":
        want_node = _arg(float_nodes[r.node], tuple(r.path))
        got_node = _arg(by_name[at], tuple(at_path))
        return f_run.copies[want_node.name], q_run.copies[got_node.name]
    want = _leaf(f_run.copies[r.node], r.path)
    got = _leaf(q_run.copies[at], at_path)
    grid = by_name[at].meta.get(OUTPUT_GRID_KEY)
    if grid is not None and not got.is_floating_point():
        got = (got.float() - grid[1]) * grid[0]
    return want, got


_CLAMPS = {"relu": (0.0, math.inf), "relu_": (0.0, math.inf), "relu6": (0.0, 6.0)}


def _assert_all_readers_clamp(node: fx.Node, interval: tuple[float, float]) -> None:
    """The readers this helper knows (relu, relu_, relu6) all keep ``interval`` (an
    observer's readers stand for it: it is the identity)."""
    readers = [r for u in node.users for r in (u.users if u.op == "call_module" else [u])]
    kept = {_CLAMPS.get(getattr(u.target, "_opname", "")) for u in readers}
    assert kept == {interval}, f"{node.name}: readers {list(node.users)} keep {kept}"


def _same_path(key: Any, path: tuple[Any, ...]) -> bool:
    parts = tuple(getattr(k, "idx", getattr(k, "key", k)) for k in key)
    return parts == tuple(path)


def assert_rows_match(
    comparison: qt.Comparison,
    float_gm: fx.GraphModule,
    quantized: fx.GraphModule,
    batches: list[tuple[Any, ...]],
    bound_db: float = BOUND_DB,
) -> dict[str, float]:
    """Every root-scope row of ``comparison`` within ``bound_db`` of the independent SQNR;
    returns the independent figures. Two figures both above 100 dB count as equal: both say
    the tensor is exact up to float rounding, whose size is not what either measures. A zero
    float tensor with noise (a fresh attention's in-projection bias that bias correction
    moved) is -inf in both."""
    measured = independent_sqnrs(float_gm, quantized, comparison.rows, batches)
    off = []
    for r in comparison.rows:
        if r.name not in measured:
            continue
        want, got = measured[r.name], r.sqnr_db
        if want == got or (math.isnan(want) and math.isnan(got)):
            continue  # both exact, both a zero float tensor (-inf); or both NaN (a -inf mask)
        both_exact = want > 100 and got > 100
        if not (abs(want - got) <= bound_db or both_exact):
            off.append(f"{r.name}: compare {got:.2f} dB, independent {want:.2f} dB")
    assert not off, "\n".join(off)
    return measured
