"""compare: the numeric debugger, per-tensor SQNR between a float model and its quantized one.

Both models run on the same batches under ``torch.fx.Interpreter``. Every Value of the float
graph (each float leaf of each node's output, so all three leaves of an ``aten.lstm``) is
matched by node name and leaf path in the quantized graph and read there *after* its
quantize -> dequantize, so the error shown is the error quantization leaves at that point.
Constant inputs (weights) are compared at the op that reads them, and the model outputs
always are, so a lowered model whose ops became kernels still gets its output rows.
Graphs nested in both models (the cell body of a cells-mode layer, run once per time step)
are compared too, call by call, when the float model has them: pass the prepared model as
the float reference (its observers are the identity and are not run). Signal and noise
energies accumulate over every batch and call before the ratio is taken.

Each float tensor is kept as a copy taken when its op ran: torch.export keeps in-place ops
(``relu_`` of ``ReLU(inplace=True)``, ``add_`` of ``out += identity``), which would otherwise
overwrite the reference before the quantized tensor is compared with it. A stacked recurrent
call that prepare split into layers is found through the nodes that record which of its
leaves they hold (``VALUE_OF_KEY``), so its rows keep the user's layer. A float tensor with
no counterpart is listed in ``Comparison.unmatched`` with the reason, never dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from quantree.core.calibrate import as_args
from quantree.core.graphs import nested_graphs
from quantree.core.normalizing.normalize import normalize
from quantree.core.stages import STAGE_KEY
from quantree.core.values import leaves_with_paths
from quantree.recurrent.capture import capture
from quantree.tools.comparison import Comparison, RowKind, TensorRow
from quantree.tools.matching import (
    OUTPUT,
    VALUE,
    WEIGHT,
    Described,
    Key,
    Plan,
    Recorder,
    Sink,
    describe_value,
    float_plan,
    fused_producer,
    is_float,
    op_name,
    output_quantization,
    quantized_plan,
    read_interval,
    recording_nested,
)
from quantree.tools.time_steps import (
    call_sqnrs,
    cell_state,
    layer_label,
    module_path,
    output_series,
    step_energies,
    step_sqnrs,
    time_axis,
)
from quantree.tools.unmatched import (
    NEVER_RAN,
    NO_OUTPUT,
    NOT_A_GRAPH,
    Unmatched,
    shapes_differ,
)

ROOT = ""


def fresh(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A copy of every tensor in ``args``: a model that writes into its input in place
    would otherwise hand the next model (and the user) a changed batch."""
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, args)


@dataclass
class _Stat:
    described: Described
    quantization: str = "float"
    shape: tuple[int, ...] = ()
    signal: float = 0.0
    noise: float = 0.0
    seen: bool = False
    missing: str = ""  # why the quantized model has no counterpart (while not seen)
    owner: str = ""  # the float node whose module the row belongs to, when not the key's
    time_axis: int | None = None
    step_signal: torch.Tensor | None = None
    step_noise: torch.Tensor | None = None
    layer: str = ""
    series: str = ""
    reverse: bool = False  # per call: a reverse cell loop (its first call is the last step)
    call_signal: list[float] | None = None  # per call of a cell body: one call is one step
    call_noise: list[float] | None = None
    clamped: tuple[float, float] | None = None  # every reader keeps only this interval

    def add_call(self, call: int, signal: float, noise: float) -> None:
        if self.call_signal is None or self.call_noise is None:
            return
        while len(self.call_signal) <= call:
            self.call_signal.append(0.0)
            self.call_noise.append(0.0)
        self.call_signal[call] += signal
        self.call_noise[call] += noise

    def steps(self) -> tuple[float, ...]:
        if self.step_signal is not None and self.step_noise is not None:
            return step_sqnrs(self.step_signal, self.step_noise)
        if self.call_signal and self.call_noise:
            return call_sqnrs(self.call_signal, self.call_noise, self.reverse)
        return ()

    def add_steps(self, reference: torch.Tensor, test: torch.Tensor) -> None:
        """Accumulate per-step energies; sequences of another length (a new batch shape)
        are not added step by step."""
        if self.time_axis is None or reference.dim() <= self.time_axis:
            return
        signal, noise = step_energies(reference, test, self.time_axis)
        if self.step_signal is None or self.step_noise is None:
            self.step_signal, self.step_noise = signal, noise
        elif self.step_signal.shape == signal.shape:
            self.step_signal, self.step_noise = self.step_signal + signal, self.step_noise + noise


class _Session:
    """The float reference of the current batch and the running energies, per scope."""

    def __init__(self, float_gm: fx.GraphModule, quantized: torch.nn.Module) -> None:
        self.float_gm = float_gm
        self.quantized = quantized
        nested_q = nested_graphs(quantized) if isinstance(quantized, fx.GraphModule) else {}
        nested_f = nested_graphs(float_gm)
        self.graphs = {ROOT: float_gm, **{n: g for n, g in nested_f.items() if n in nested_q}}
        self.float_plans: dict[str, Plan] = {}
        self.weights: dict[str, dict[Key, torch.Tensor]] = {}
        self.stats: dict[tuple[str, Key], _Stat] = {}
        self.clamps: dict[tuple[str, Key], tuple[float, float]] = {
            (scope, (VALUE, n.name, ())): interval
            for scope, gm in self.graphs.items()
            for n in gm.graph.nodes
            if (interval := read_interval(gm, n)) is not None
        }
        for index, (scope, gm) in enumerate(self.graphs.items()):
            plan, described, weights = float_plan(gm)
            self.float_plans[scope], self.weights[scope] = plan, weights
            for key, d in described.items():
                self.stats[(scope, key)] = _Stat(self._scoped(scope, d, index))
        self.reference: dict[tuple[str, int], dict[Key, torch.Tensor]] = {}
        self.quantized_plans: dict[str, Plan] | None = None
        self.weights_done: set[tuple[str, Key]] = set()
        self.modules: dict[str, str] = {}  # float node name -> the user's module path

    @staticmethod
    def _scoped(scope: str, d: Described, index: int) -> Described:
        if scope == ROOT:
            return d
        return Described(f"{scope}/{d.name}", d.op, 100_000 * index + d.order)

    def keeper(self, scope: str, call: int) -> Sink:
        store = self.reference.setdefault((scope, call), dict(self.weights[scope]))

        def keep(key: Key, value: Any) -> None:
            if is_float(value):  # a copy: a later in-place op (relu_, add_) writes into it
                store[key] = value.detach().clone()

        return keep

    def accumulator(self, scope: str, call: int) -> Sink:
        store = self.reference.get((scope, call), {})

        def accumulate(key: Key, value: Any) -> None:
            ref = store.get(key)
            if ref is None or not is_float(value):
                return
            if value.shape != ref.shape:
                self.stats[(scope, key)].missing = shapes_differ(tuple(ref.shape), value.shape)
                return
            if key[0] == WEIGHT:
                if (scope, key) in self.weights_done:
                    return
                self.weights_done.add((scope, key))
            stat = self.stats[(scope, key)]
            r, v = ref.double(), value.detach().double()
            stat.clamped = self.clamps.get((scope, key))
            if stat.clamped is not None:  # what every reader sees (matching.read_interval)
                r, v = r.clamp(*stat.clamped), v.clamp(*stat.clamped)
            signal = float(r.pow(2).sum())
            noise = float((r - v).pow(2).sum())
            stat.signal, stat.noise = stat.signal + signal, stat.noise + noise
            stat.add_steps(*((r, v) if stat.clamped is not None else (ref, value.detach())))
            stat.add_call(call, signal, noise)
            stat.shape, stat.seen = tuple(ref.shape), True

        return accumulate

    def run_float(self, args: tuple[Any, ...]) -> None:
        self.reference.clear()
        args = fresh(args)
        nested = {s: p for s, p in self.float_plans.items() if s != ROOT}
        with torch.no_grad(), recording_nested(self.float_gm, nested, self.keeper):
            out = Recorder(self.float_gm, self.float_plans[ROOT], self.keeper(ROOT, 0)).run(*args)
        keep = self.keeper(ROOT, 0)
        for i, (path, leaf) in enumerate(leaves_with_paths(out)):
            key = (OUTPUT, "output", path)
            keep(key, leaf)
            if (ROOT, key) not in self.stats:
                name = "output" + "".join(f"[{p!r}]" for p in path)
                self.stats[(ROOT, key)] = _Stat(Described(name, "output", 10**9 + i))
        if self.quantized_plans is None:
            self._plan_quantized()

    def _value_stat(
        self,
        scope: str,
        gm: fx.GraphModule,
        nodes: dict[str, tuple[int, fx.Node]],
        key: Key,
        described: Described,
    ) -> _Stat:
        """A Value's statistics; per step for a recurrent output or a cell loop's state."""
        node = nodes[key[1]][1]
        axis = time_axis(node, key[2], gm)
        if axis is not None:
            layer, series = layer_label(node), output_series(node)
            return _Stat(described, time_axis=axis, layer=layer, series=series)
        state = cell_state(self.float_gm, scope, key[1]) if scope != ROOT else None
        if state is None or key[2]:
            return _Stat(described)
        cells, series, reverse = state
        owner = next((n for n in self.float_gm.graph.nodes if n.target == cells), None)
        layer = layer_label(owner) if owner is not None else cells
        return _Stat(described, layer=layer, series=series, reverse=reverse,
                     call_signal=[], call_noise=[])  # fmt: skip

    def _plan_quantized(self) -> None:
        self.quantized_plans = {}
        for scope, gm in self.graphs.items():
            keys = self.reference.get((scope, 0), {})
            nodes = {n.name: (i, n) for i, n in enumerate(gm.graph.nodes)}
            index = list(self.graphs).index(scope)
            for key in keys:
                if key[0] == VALUE and (scope, key) not in self.stats:
                    described = self._scoped(scope, describe_value(nodes, key), index)
                    self.stats[(scope, key)] = self._value_stat(scope, gm, nodes, key, described)
            if not isinstance(self.quantized, fx.GraphModule):
                for (s, key), stat in self.stats.items():
                    if s == scope and key[0] != OUTPUT:
                        stat.missing = NOT_A_GRAPH
                continue
            target = self.quantized if scope == ROOT else self.quantized.get_submodule(scope)
            assert isinstance(target, fx.GraphModule)
            plan, how = quantized_plan(target, gm, [k for s, k in self.stats if s == scope])
            self.quantized_plans[scope] = plan
            for key, reason in plan.missing.items():
                self.stats[(scope, key)].missing = reason
            for key, text in how.items():
                stat = self.stats[(scope, key)]
                stat.quantization = text
                producer = fused_producer(target, gm, key[1]) if key[0] == VALUE else None
                if producer is not None and "kernel" in text:  # conv+relu: named by the conv
                    absorbed = getattr(nodes[key[1]][1].target, "_opname", key[1])
                    fused = f"{producer.name} (+{absorbed})"
                    order = nodes[producer.name][0]
                    stat.described = self._scoped(
                        scope, Described(fused, op_name(producer), order), index
                    )
                    stat.owner = producer.name
                    inner = self.stats.get((scope, (VALUE, producer.name, ())))
                    if inner is not None:
                        inner.missing = f"fused into a kernel: read as row {fused}"
        if isinstance(self.quantized, fx.GraphModule):
            outputs = [k for s, k in self.stats if s == ROOT and k[0] == OUTPUT]
            for key, how_out in zip(outputs, output_quantization(self.quantized), strict=False):
                if how_out is not None:
                    self.stats[(ROOT, key)].quantization = how_out

    def run_quantized(self, args: tuple[Any, ...]) -> None:
        plans = self.quantized_plans or {}
        args = fresh(args)
        with torch.no_grad():
            if isinstance(self.quantized, fx.GraphModule):
                nested = {s: p for s, p in plans.items() if s != ROOT}
                with recording_nested(self.quantized, nested, self.accumulator):
                    sink = self.accumulator(ROOT, 0)
                    out = Recorder(self.quantized, plans[ROOT], sink).run(*args)
            else:
                out = self.quantized(*args)
        accumulate = self.accumulator(ROOT, 0)
        for path, leaf in leaves_with_paths(out):
            accumulate((OUTPUT, "output", path), leaf)
        for (_, key), stat in self.stats.items():
            if key[0] == OUTPUT and not stat.seen and not stat.missing:
                stat.missing = NO_OUTPUT

    def _module(self, scope: str, name: str) -> str:
        """The user's module path of node ``name``; inside a nested graph (a cells-mode
        body), the module of the root node that runs it."""
        if scope != ROOT:
            owner = next(
                (
                    n
                    for n in self.float_gm.graph.nodes
                    if n.op == "call_module" and scope.startswith(f"{n.target}.")
                ),
                None,
            )
            return module_path(owner) if owner is not None else ""
        if not self.modules:
            self.modules = {n.name: module_path(n) for n in self.float_gm.graph.nodes}
        return self.modules.get(name, "")

    def unmatched(self) -> list[Unmatched]:
        found: list[tuple[int, Unmatched]] = []
        for (scope, key), stat in self.stats.items():
            if stat.seen:
                continue
            d = stat.described
            node = key[1] if scope == ROOT else f"{scope}/{key[1]}"
            found.append((d.order, Unmatched(d.name, node, d.op, stat.missing or NEVER_RAN)))
        return [u for _, u in sorted(found, key=lambda f: (f[0], f[1].name))]

    def rows(self) -> list[TensorRow]:
        rows, plans = [], self.quantized_plans or {}
        for (scope, key), stat in self.stats.items():
            if not stat.seen:
                continue
            d = stat.described
            node = key[1] if scope == ROOT else f"{scope}/{key[1]}"
            rows.append(
                TensorRow(
                    d.name,
                    node,
                    key[2],
                    RowKind(key[0]),
                    d.op,
                    stat.quantization,
                    stat.shape,
                    stat.signal,
                    stat.noise,
                    d.order,
                    steps := stat.steps(),
                    stat.layer if steps else "",
                    stat.series if steps else "",
                    plans[scope].read_at.get(key) if scope in plans else None,
                    self._module(scope, stat.owner or key[1]) if key[0] != OUTPUT else "",
                    stat.clamped,
                )
            )
        rows.sort(key=lambda r: (r.sqnr_db, r.order, r.name))
        return rows


def compare(
    float_model: torch.nn.Module,
    quantized_model: torch.nn.Module,
    data: Iterable[Any],
) -> Comparison:
    """Per-tensor SQNR of ``quantized_model`` against ``float_model`` over ``data``.

    ``float_model`` is an ``nn.Module`` (captured here on the first batch) or a captured or
    prepared GraphModule (prepared: the cells of a cells-mode layer and each layer of a
    stacked recurrent call, which prepare splits, are compared too);
    ``quantized_model`` is the output of ``convert`` or ``lower`` (any module works for the
    output rows). ``data`` is an iterable of argument tuples. Neither model is changed.
    """
    session: _Session | None = None
    count = 0
    for batch in data:
        args = as_args(batch)
        if session is None:
            float_gm = (
                float_model
                if isinstance(float_model, fx.GraphModule)
                else capture(float_model, args)
            )
            if STAGE_KEY not in float_gm.meta:  # captured: compare with what prepare sees
                float_gm = normalize(float_gm)
            session = _Session(float_gm, quantized_model)
        session.run_float(args)
        session.run_quantized(args)
        count += 1
    if session is None:
        return Comparison((), count)
    return Comparison(tuple(session.rows()), count, tuple(session.unmatched()))
