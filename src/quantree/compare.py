"""compare: the numeric debugger, per-tensor SQNR between a float model and its quantized one.

Both models run side by side on the same batches under ``torch.fx.Interpreter``. Every Value
of the float graph (each float leaf of each node's output, so all three leaves of an
``aten.lstm``) is matched by node name and leaf path in the quantized graph, where convert
keeps the names of the original ops; the quantized side is read *after* the leaf's
quantize -> dequantize, so the error shown is the error quantization adds there. Constant
inputs (weights) are compared at the op that reads them, and the model outputs always are,
so a lowered model whose ops were replaced by kernels still gets its output rows.
Signal and noise energies accumulate over all batches before the ratio is taken.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from quantree.calibrate import as_args
from quantree.capture import capture
from quantree.graphs import fetch_attr
from quantree.prepare import OBSERVER_KEY
from quantree.values import Path, arg_at, get_at, is_getitem, leaves_with_paths

qd = torch.ops.quantized_decomposed
QUANTIZE_OPS = (qd.quantize_per_tensor.default, qd.quantize_per_channel.default)
DEQUANTIZE_OPS = (qd.dequantize_per_tensor.default, qd.dequantize_per_channel.default)

Key = tuple[str, str, Path]  # (kind, node name, path)
Watch = dict[fx.Node, list[tuple[Key, Path | None]]]  # None: every leaf of the output


class RowKind(enum.Enum):
    """What a row measures: a node's output leaf, a constant an op reads, or a model output."""

    VALUE = "value"
    WEIGHT = "weight"
    OUTPUT = "output"


@dataclass(frozen=True)
class TensorRow:
    """SQNR of one tensor over every compared batch."""

    name: str  # e.g. "lstm[1]", "head.weight -> linear[1]", "output"
    node: str
    path: Path
    kind: RowKind
    op: str
    quantization: str  # "int8", "int16", "int8 per-channel", or "float" (no q/dq found)
    shape: tuple[int, ...]
    signal: float  # sum of squares of the float tensor
    noise: float  # sum of squares of (float - quantized)
    order: int  # position in the float graph

    @property
    def sqnr_db(self) -> float:
        if self.noise == 0.0:
            return math.inf
        return 10.0 * math.log10(max(self.signal, 1e-30) / self.noise)

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "node": self.node,
            "path": list(self.path),
            "kind": self.kind.value,
            "op": self.op,
            "quantization": self.quantization,
            "shape": list(self.shape),
            "sqnr_db": self.sqnr_db,
        }


@dataclass(frozen=True)
class Comparison:
    """The rows of :func:`compare`, worst SQNR first."""

    rows: tuple[TensorRow, ...]
    batches: int

    def records(self) -> list[dict[str, Any]]:
        return [row.record() for row in self.rows]

    def row(self, name: str) -> TensorRow:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no row named {name!r}; rows: {[r.name for r in self.rows]}")

    @property
    def outputs(self) -> tuple[TensorRow, ...]:
        return tuple(r for r in self.rows if r.kind is RowKind.OUTPUT)

    def render(self, limit: int | None = None) -> str:
        rows = self.rows[:limit] if limit is not None else self.rows
        width = max([len("tensor"), *(len(r.name) for r in rows)])
        opw = max([len("op"), *(len(r.op) for r in rows)])
        lines = [
            f"per-tensor SQNR over {self.batches} batch(es), worst first",
            f"{'tensor':<{width}}  {'op':<{opw}}  {'quantized as':<18}  {'shape':<16}  SQNR dB",
        ]
        for r in rows:
            shape = "x".join(str(s) for s in r.shape) or "scalar"
            lines.append(
                f"{r.name:<{width}}  {r.op:<{opw}}  {r.quantization:<18}  {shape:<16}  "
                f"{r.sqnr_db:7.1f}"
            )
        if limit is not None and len(self.rows) > limit:
            lines.append(f"... and {len(self.rows) - limit} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _op_name(node: fx.Node) -> str:
    if node.op == "call_function":
        name = str(getattr(node.target, "__name__", node.target))
        return name if not hasattr(node.target, "_schema") else f"aten.{name}"
    if node.op == "call_module":
        return f"module {node.target}"
    return str(node.op)


def _is_recorded(node: fx.Node) -> bool:
    if node.op not in ("placeholder", "call_function", "call_module") or is_getitem(node):
        return False
    if node.op == "call_module" and OBSERVER_KEY in node.meta:
        return False
    return node.target not in QUANTIZE_OPS + DEQUANTIZE_OPS


def _carrier(node: fx.Node, path: Path) -> tuple[fx.Node, Path]:
    """The getitem node holding leaf ``path`` of ``node`` and what remains of the path."""
    for i, part in enumerate(path):
        nxt = next((u for u in node.users if is_getitem(u) and u.args[1] == part), None)
        if nxt is None:
            return node, path[i:]
        node = nxt
    return node, ()


def _dequantized_after(node: fx.Node) -> tuple[fx.Node, str] | None:
    """The dequantize of ``node``'s quantize (its q -> dq pair) and how it quantizes."""
    for q in node.users:
        if q.target not in QUANTIZE_OPS:
            continue
        for dq in q.users:
            if dq.target in DEQUANTIZE_OPS:
                return dq, describe_quantization(q)
    return None


def describe_quantization(q: fx.Node) -> str:
    """``int8`` / ``int16 per-channel`` for a quantize or dequantize node."""
    dtype = q.args[-1]
    name = str(dtype).replace("torch.", "")
    per_channel = q.target in (qd.quantize_per_channel.default, qd.dequantize_per_channel.default)
    return f"{name} per-channel" if per_channel else name


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


class _Recorder(fx.Interpreter):
    """Runs a GraphModule and hands chosen tensors to ``sink``."""

    def __init__(
        self,
        gm: fx.GraphModule,
        outputs: Watch,
        inputs: Watch,
        sink: Callable[[Key, Any], None],
    ) -> None:
        super().__init__(gm)
        self.watch_out, self.watch_in, self.sink = outputs, inputs, sink

    def run_node(self, n: fx.Node) -> Any:
        for key, arg_path in self.watch_in.get(n, ()):
            arg = arg_at(n, arg_path or key[2])
            if isinstance(arg, fx.Node) and arg in self.env:
                self.sink(key, self.env[arg])
        out = super().run_node(n)
        for key, path in self.watch_out.get(n, ()):
            if path is None:  # every leaf, each under its own path
                for leaf_path, leaf in leaves_with_paths(out):
                    self.sink((key[0], key[1], leaf_path), leaf)
            else:
                self.sink(key, get_at(out, path))
        return out


@dataclass
class _Info:
    name: str
    op: str
    order: int
    quantization: str = "float"
    shape: tuple[int, ...] = ()
    signal: float = 0.0
    noise: float = 0.0
    seen: bool = False


def _float_plan(
    gm: fx.GraphModule,
) -> tuple[Watch, dict[Key, _Info], dict[Key, torch.Tensor]]:
    """Which float nodes to record, the rows' descriptions, and the constant weights."""
    watch: Watch = {}
    infos: dict[Key, _Info] = {}
    weights: dict[Key, torch.Tensor] = {}
    for order, node in enumerate(gm.graph.nodes):
        if _is_recorded(node):
            watch[node] = [((RowKind.VALUE.value, node.name, ()), None)]
        if node.op != "call_function" or is_getitem(node):
            continue
        for head, root in [*enumerate(node.args), *node.kwargs.items()]:
            for path, leaf in leaves_with_paths(root):
                if not isinstance(leaf, fx.Node) or leaf.op != "get_attr":
                    continue
                try:
                    value = fetch_attr(gm, str(leaf.target))
                except (AttributeError, AssertionError):
                    continue
                if not value.is_floating_point():
                    continue
                arg_path: Path = (head, *path)  # type: ignore[assignment]
                key = (RowKind.WEIGHT.value, node.name, arg_path)
                label = f"{leaf.target} -> {node.name}{list(arg_path)}"
                infos[key] = _Info(label, _op_name(node), order)
                weights[key] = value
    return watch, infos, weights


def _quantized_plan(
    gm: fx.GraphModule, float_gm: fx.GraphModule, keys: Iterable[Key]
) -> tuple[Watch, Watch, dict]:
    """Where each float key is read in the quantized graph, and how it is quantized there."""
    by_name = {n.name: n for n in gm.graph.nodes}
    float_by_name = {n.name: n for n in float_gm.graph.nodes}
    outs: Watch = {}
    ins: Watch = {}
    how: dict[Key, str] = {}
    for key in keys:
        kind, name, path = key
        if kind == RowKind.OUTPUT.value:
            continue  # compared on the model's returned values
        if kind == RowKind.WEIGHT.value:
            user = by_name.get(name)
            if user is not None and not is_getitem(user):
                ins.setdefault(user, []).append((key, path))
                try:
                    source = arg_at(user, path)
                except (IndexError, KeyError, TypeError):
                    continue
                if isinstance(source, fx.Node) and source.target in DEQUANTIZE_OPS:
                    how[key] = describe_quantization(source)
            continue
        node = by_name.get(name)
        if node is None or is_getitem(node):
            # The op was replaced (a cells decomposition, a lowered kernel): its getitem
            # leaves often survive under their own names.
            f_carrier, rest = _carrier(float_by_name[name], path)
            node = by_name.get(f_carrier.name) if f_carrier.name != name else None
            if node is None:
                continue
            carrier, rest = _carrier(node, rest)
        else:
            carrier, rest = _carrier(node, path)
        found = _dequantized_after(carrier) if not rest else None
        if found is not None:
            outs.setdefault(found[0], []).append((key, ()))
            how[key] = found[1]
        else:
            outs.setdefault(carrier, []).append((key, rest))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat = [leaf for _, leaf in leaves_with_paths(output.args[0])]
    output_keys = [k for k in keys if k[0] == RowKind.OUTPUT.value]
    for key, leaf in zip(output_keys, flat, strict=False):
        if isinstance(leaf, fx.Node) and leaf.target in DEQUANTIZE_OPS:
            how[key] = describe_quantization(leaf)
    return outs, ins, how


def _run(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    outs: Watch,
    ins: Watch,
    sink: Callable[[Key, Any], None],
) -> Any:
    if isinstance(model, fx.GraphModule):
        return _Recorder(model, outs, ins, sink).run(*args)
    return model(*args)


def compare(
    float_model: torch.nn.Module,
    quantized_model: torch.nn.Module,
    data: Iterable[Any],
) -> Comparison:
    """Per-tensor SQNR of ``quantized_model`` against ``float_model`` over ``data``.

    ``float_model`` is an ``nn.Module`` (captured here on the first batch) or a captured or
    prepared GraphModule; ``quantized_model`` the output of ``convert`` or ``lower`` (any
    module works for the output rows). ``data`` is an iterable of argument tuples.
    """
    float_gm: fx.GraphModule | None = None
    stats: dict[Key, _Info] = {}
    reference: dict[Key, torch.Tensor] = {}
    plan: Any = None
    count = 0

    def keep(key: Key, value: Any) -> None:
        if _is_float(value):
            reference[key] = value.detach()

    def accumulate(key: Key, value: Any) -> None:
        ref = reference.get(key)
        if ref is None or not _is_float(value) or value.shape != ref.shape:
            return
        info = stats[key]
        r = ref.double()
        info.signal += float(r.pow(2).sum())
        info.noise += float((r - value.detach().double()).pow(2).sum())
        info.shape, info.seen = tuple(ref.shape), True

    with torch.no_grad():
        for batch in data:
            args = as_args(batch)
            if float_gm is None:
                float_gm = (
                    float_model
                    if isinstance(float_model, fx.GraphModule)
                    else capture(float_model, args)
                )
                watch, weight_infos, weights = _float_plan(float_gm)
                stats.update(weight_infos)
            reference.clear()
            reference.update(weights)
            float_out = _Recorder(float_gm, watch, {}, keep).run(*args)
            for i, (path, leaf) in enumerate(leaves_with_paths(float_out)):
                keep((RowKind.OUTPUT.value, "output", path), leaf)
                if (RowKind.OUTPUT.value, "output", path) not in stats:
                    suffix = "".join(f"[{p!r}]" for p in path)
                    stats[(RowKind.OUTPUT.value, "output", path)] = _Info(
                        f"output{suffix}", "output", 1_000_000 + i
                    )
            if plan is None:
                _describe_values(float_gm, reference, stats)
                plan = ({}, {}, {})
                if isinstance(quantized_model, fx.GraphModule):
                    plan = _quantized_plan(quantized_model, float_gm, list(stats))
                for key, text in plan[2].items():
                    stats[key].quantization = text
            q_out = _run(quantized_model, args, plan[0], plan[1], accumulate)
            for path, leaf in leaves_with_paths(q_out):
                accumulate((RowKind.OUTPUT.value, "output", path), leaf)
            count += 1
    rows = [
        TensorRow(
            info.name,
            key[1],
            key[2],
            RowKind(key[0]),
            info.op,
            info.quantization,
            info.shape,
            info.signal,
            info.noise,
            info.order,
        )
        for key, info in stats.items()
        if info.seen
    ]
    rows.sort(key=lambda r: (r.sqnr_db, r.order, r.name))
    return Comparison(tuple(rows), count)


def _describe_values(
    gm: fx.GraphModule, reference: dict[Key, torch.Tensor], stats: dict[Key, _Info]
) -> None:
    """A row for every float leaf the first float run produced."""
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    nodes = {n.name: n for n in gm.graph.nodes}
    for key in reference:
        kind, name, path = key
        if kind != RowKind.VALUE.value or key in stats:
            continue
        suffix = "".join(f"[{p!r}]" for p in path)
        stats[key] = _Info(f"{name}{suffix}", _op_name(nodes[name]), order[name])
