"""matching: find the same tensors in a float graph and its quantized graph, and record them.

A float graph and the graph ``convert`` made from it share node names (convert only inserts
quantize/dequantize nodes), so a Value ``(node, path)`` of the float graph is found in the
quantized graph by name: its leaf carrier (the ``getitem`` chain), then the dequantize of the
quantize that follows it, which is the value quantization leaves behind. When a pass replaced
the node (cells decomposition, a lowered kernel), its ``getitem`` leaves often survive under
their own names and are used instead. ``Recorder`` runs a GraphModule and hands the chosen
tensors to a sink; observers are skipped, so recording a prepared model changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from quantree.core.graphs import fetch_attr
from quantree.core.observing.observers import Observer
from quantree.core.qdq import DEQUANTIZE_OPS, PER_CHANNEL_OPS, QUANTIZE_OPS
from quantree.core.stages import OBSERVER_KEY, OUTPUT_GRID_KEY, REPLACES_KEY, VALUE_OF_KEY
from quantree.core.values import Path, arg_at, get_at, is_getitem, leaves_with_paths
from quantree.recipes.int8 import kept_interval
from quantree.recurrent.call import RecurrentCall
from quantree.recurrent.split_layers import SPLITTABLE, layer_name

VALUE, WEIGHT, OUTPUT = "value", "weight", "output"
Key = tuple[str, str, Path]  # (kind, node name, leaf path or argument path)
Watch = dict[fx.Node, list[tuple[Key, Path | None]]]  # None: every leaf of the output
Sink = Callable[[Key, Any], None]


@dataclass(frozen=True)
class Described:
    """How a row is shown: its name, the op that made it, its position in the graph."""

    name: str
    op: str
    order: int


@dataclass
class Plan:
    """What to record while one graph runs: node outputs, and node inputs (constants)."""

    outputs: Watch
    inputs: Watch
    grids: dict[fx.Node, tuple[float, int]] = field(default_factory=dict)
    """Kernels whose int8 outputs are read dequantized, with their (scale, zero_point)."""
    read_at: dict[Key, tuple[str, Path]] = field(default_factory=dict)
    """Quantized graph only: the node (and leaf path in its output) each key is read at."""
    missing: dict[Key, str] = field(default_factory=dict)
    """Quantized graph only: keys found nowhere, and why."""


def describe_quantization(node: fx.Node) -> str:
    """``int8`` / ``int16 per-channel`` for a quantize or dequantize node."""
    name = str(node.args[-1]).replace("torch.", "")
    return f"{name} per-channel" if node.target in PER_CHANNEL_OPS else name


def op_name(node: fx.Node) -> str:
    if node.op == "call_function":
        name = str(getattr(node.target, "__name__", node.target))
        return f"aten.{name}" if hasattr(node.target, "_schema") else name
    if node.op == "call_module":
        return f"module {node.target}"
    return str(node.op)


def is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _is_observer(node: fx.Node) -> bool:
    return node.op == "call_module" and OBSERVER_KEY in node.meta


def _is_recorded(node: fx.Node) -> bool:
    if node.op not in ("placeholder", "call_function", "call_module") or is_getitem(node):
        return False
    return not _is_observer(node) and node.target not in QUANTIZE_OPS + DEQUANTIZE_OPS


def carrier(node: fx.Node, path: Path) -> tuple[fx.Node, Path]:
    """The getitem node holding leaf ``path`` of ``node`` and what remains of the path."""
    for i, part in enumerate(path):
        nxt = next((u for u in node.users if is_getitem(u) and u.args[1] == part), None)
        if nxt is None:
            return node, path[i:]
        node = nxt
    return node, ()


def _dequantized_after(node: fx.Node) -> tuple[fx.Node, str] | None:
    for q in node.users:
        if q.target in QUANTIZE_OPS:
            for dq in q.users:
                if dq.target in DEQUANTIZE_OPS:
                    return dq, describe_quantization(q)
    return None


def float_plan(gm: fx.GraphModule) -> tuple[Plan, dict[Key, Described], dict[Key, torch.Tensor]]:
    """Record every float node's output leaves; describe and fetch the float constants."""
    watch: Watch = {}
    described: dict[Key, Described] = {}
    weights: dict[Key, torch.Tensor] = {}
    for order, node in enumerate(gm.graph.nodes):
        if _is_recorded(node):
            watch[node] = [((VALUE, node.name, ()), None)]
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
                if value.is_floating_point():
                    arg_path: Path = (head, *path)  # type: ignore[assignment]
                    key = (WEIGHT, node.name, arg_path)
                    label = f"{leaf.target} -> {node.name}{list(arg_path)}"
                    described[key] = Described(label, op_name(node), order)
                    weights[key] = value
    return Plan(watch, {}), described, weights


def describe_value(nodes: dict[str, tuple[int, fx.Node]], key: Key) -> Described:
    """``lstm[1]``, or ``gates_split[0] (i_pre)`` when the leaf's getitem has its own name,
    or ``lstm_l1[0] (lstm[0])`` for a Value standing for one of a removed node's (the last
    layer of a stacked call prepare split holds the user's layer's output).

    ``nodes`` maps node names to (position, node): ``{n.name: (i, n) for i, n in ...}``.
    """
    order, node = nodes[key[1]]
    suffix = "".join(f"[{p!r}]" for p in key[2])
    leaf, rest = carrier(node, key[2])
    origin = leaf.meta.get(VALUE_OF_KEY) if not rest else None
    if origin is not None:
        shown = f"{origin[0]}" + "".join(f"[{p!r}]" for p in origin[1])
        return Described(f"{node.name}{suffix} ({shown})", op_name(node), order)
    named = leaf is not node and not rest and not leaf.name.startswith("getitem")
    name = f"{node.name}{suffix}" + (f" ({leaf.name})" if named else "")
    return Described(name, op_name(node), order)


def quantized_plan(
    gm: fx.GraphModule, float_gm: fx.GraphModule, keys: Iterable[Key]
) -> tuple[Plan, dict[Key, str]]:
    """Where each float key is read in the quantized graph, and how it is quantized there.

    A key found nowhere gets the reason in ``plan.missing``; where one is read is in
    ``plan.read_at`` (the quantized node and the leaf path inside its output)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    float_by_name = {n.name: n for n in float_gm.graph.nodes}
    kernels = {n.meta[REPLACES_KEY][0]: n for n in gm.graph.nodes if REPLACES_KEY in n.meta}
    origins = {n.meta[VALUE_OF_KEY]: n for n in gm.graph.nodes if VALUE_OF_KEY in n.meta}
    live = live_nodes(float_gm)
    plan, how = Plan({}, {}), {}
    for key in keys:
        kind, name, path = key
        if kind == WEIGHT:
            name, path = split_weight(float_by_name[name], path, by_name)
            user = by_name.get(name)
            if user is None or is_getitem(user):
                plan.missing[key] = (
                    "held inside a backend's kernel (packed), not a tensor the graph reads"
                    if kernels
                    else f"the op reading it ({name}) was replaced: read inside, not compared"
                )
                continue
            plan.inputs.setdefault(user, []).append((key, path))
            plan.read_at[key] = (name, path)
            try:
                source = arg_at(user, path)
            except (IndexError, KeyError, TypeError):
                continue
            if isinstance(source, fx.Node) and source.target in DEQUANTIZE_OPS:
                how[key] = describe_quantization(source)
            continue
        if kind != VALUE:
            continue
        found = _locate(key, float_by_name[name], by_name, kernels, origins, live)
        if isinstance(found, str):
            plan.missing[key] = found
            continue
        leaf, rest = found
        if REPLACES_KEY in leaf.meta and not rest:  # a backend's kernel computes this Value
            plan.outputs.setdefault(leaf, []).append((key, ()))
            plan.read_at[key] = (leaf.name, ())
            grid = leaf.meta.get(OUTPUT_GRID_KEY)
            if grid is not None:
                plan.grids[leaf] = grid
            how[key] = "int8 kernel" if grid is not None else "kernel, float out"
            continue
        dequantized = _dequantized_after(leaf) if not rest else None
        if dequantized is not None:
            plan.outputs.setdefault(dequantized[0], []).append((key, ()))
            plan.read_at[key] = (dequantized[0].name, ())
            how[key] = dequantized[1]
        else:
            plan.outputs.setdefault(leaf, []).append((key, rest))
            plan.read_at[key] = (leaf.name, rest)
    return plan, how


def _locate(
    key: Key,
    float_node: fx.Node,
    by_name: dict[str, fx.Node],
    kernels: dict[str, fx.Node],
    origins: dict[tuple[str, Path], fx.Node],
    live: set[fx.Node],
) -> tuple[fx.Node, Path] | str:
    """The quantized node holding float Value ``key`` and the path left inside its output,
    or why there is none. By name first (convert keeps names); then the surviving leaf
    carrier, a kernel that records the carrier, or a node recording the Value's origin (a
    stacked recurrent call split into layers)."""
    _, name, path = key
    node = by_name.get(name)
    if node is not None and not is_getitem(node):
        return carrier(node, path)
    f_carrier, rest = carrier(float_node, path)
    kernel = kernels.get(f_carrier.name) if not rest else None
    if kernel is not None:
        return kernel, ()
    origin = origins.get((name, tuple(path)))
    if origin is not None:
        return origin, ()
    node = by_name.get(f_carrier.name) if f_carrier is not float_node else None
    if node is not None:
        return carrier(node, rest)
    if not rest and f_carrier not in live:
        return "unused by the model: the quantized model does not compute it"
    if float_node.op == "call_function" and not float_node.all_input_nodes:
        return "a constant the graph makes (zeros): the quantized graph folds or remakes it"
    return f"no node of the quantized graph computes it ({name} was replaced or removed)"


def live_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose value reaches the graph's output (or an in-place write into one)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    live, todo = {output}, [output]
    while todo:
        for source in todo.pop().all_input_nodes:
            if source not in live:
                live.add(source)
                todo.append(source)
    return live


def split_weight(float_node: fx.Node, path: Path, by_name: dict[str, fx.Node]) -> tuple[str, Path]:
    """Where a layer call reads the constant at ``path`` of a stacked recurrent call that
    prepare split into layers (``recurrent/split_layers.py``): the weights of layer ``l`` are
    the ``l``-th run of the stacked call's parameter list. Unchanged for any other call."""
    name = float_node.name
    split = layer_name(name, 0) in by_name and name not in by_name
    if split and len(path) == 2 and float_node.target in SPLITTABLE:
        params = float_node.args[path[0]]  # type: ignore[index]
        layers = RecurrentCall.parse(float_node).num_layers
        if isinstance(params, list | tuple) and isinstance(path[1], int) and layers > 1:
            per = len(params) // layers
            layer, index = divmod(path[1], per)
            if layer_name(name, layer) in by_name:
                return layer_name(name, layer), (path[0], index)
    return name, path


def fused_producer(gm: fx.GraphModule, float_gm: fx.GraphModule, name: str) -> fx.Node | None:
    """The float node a backend's kernel for Value ``name`` absorbed, if any.

    A conv followed by relu becomes one kernel whose output is relu's Value, so the row
    would read "relu" while the layer the user wrote is the conv. The producer is the
    float node that feeds ``name`` alone and has no counterpart of its own in ``gm``
    (neither a node of that name nor a kernel that records it).
    """
    node = next((n for n in float_gm.graph.nodes if n.name == name), None)
    if node is None or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    producer = node.args[0]
    if producer.op != "call_function" or len(producer.users) != 1 or is_getitem(producer):
        return None
    names = {n.name for n in gm.graph.nodes}
    replaced = {n.meta[REPLACES_KEY][0] for n in gm.graph.nodes if REPLACES_KEY in n.meta}
    return None if producer.name in names or producer.name in replaced else producer


def output_quantization(gm: fx.GraphModule) -> list[str | None]:
    """For each flat output of ``gm``: how it is quantized, if it comes from a dequantize."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [
        describe_quantization(leaf)
        if isinstance(leaf, fx.Node) and leaf.target in DEQUANTIZE_OPS
        else None
        for _, leaf in leaves_with_paths(output.args[0])
    ]


class Recorder(fx.Interpreter):
    """Runs a GraphModule, handing the tensors ``plan`` names to ``sink``; skips observers."""

    def __init__(self, gm: fx.GraphModule, plan: Plan, sink: Sink) -> None:
        super().__init__(gm)
        self.plan, self.sink = plan, sink

    def run_node(self, n: fx.Node) -> Any:
        if _is_observer(n) or (
            n.op == "call_module" and isinstance(self.fetch_attr(str(n.target)), Observer)
        ):
            return None  # observers return nothing anyone reads; do not update them
        for key, arg_path in self.plan.inputs.get(n, ()):
            arg = arg_at(n, arg_path if arg_path is not None else key[2])
            if isinstance(arg, fx.Node) and arg in self.env:
                self.sink(key, self.env[arg])
        out = super().run_node(n)
        grid = self.plan.grids.get(n)
        seen = out if grid is None else (out.float() - grid[1]) * grid[0]
        for key, path in self.plan.outputs.get(n, ()):
            if path is None:
                for leaf_path, leaf in leaves_with_paths(seen):
                    self.sink((key[0], key[1], leaf_path), leaf)
            else:
                self.sink(key, get_at(seen, path))
        return out


class _Recording(torch.nn.Module):
    """Stands in for a nested GraphModule: runs it under a Recorder, counting calls."""

    def __init__(self, gm: fx.GraphModule, plan: Plan, sink_for: Callable[[int], Sink]) -> None:
        super().__init__()
        self.gm, self.plan, self.sink_for, self.calls = gm, plan, sink_for, 0

    def forward(self, *args: Any) -> Any:
        sink = self.sink_for(self.calls)
        self.calls += 1
        return Recorder(self.gm, self.plan, sink).run(*args)


@contextmanager
def recording_nested(
    model: torch.nn.Module,
    plans: dict[str, Plan],
    sink_for: Callable[[str, int], Sink],
) -> Iterator[None]:
    """Record inside the nested graphs named in ``plans`` while the block runs ``model``.

    Each call of a nested graph gets its own sink (``sink_for(name, call_index)``); the
    original submodules are put back afterwards.
    """
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    try:
        for name, plan in plans.items():
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            original = getattr(parent, attr)
            assert isinstance(original, fx.GraphModule)
            setattr(parent, attr, _Recording(original, plan, _bind(sink_for, name)))
            swapped.append((parent, attr, original))
        yield
    finally:
        for parent, attr, original in reversed(swapped):
            setattr(parent, attr, original)


def _bind(sink_for: Callable[[str, int], Sink], name: str) -> Callable[[int], Sink]:
    return lambda call: sink_for(name, call)


# Where every op that reads a tensor clamps it (a ReLU after a residual add), the default
# recipe calibrates its grid on the clamped values (``QuantSpec.clamped``): no op sees the
# values discarded, so compare measures such a row as the readers see it, both tensors
# clamped (before, a residual sum read only by a ReLU was by far the worst row).
def _readers(gm: fx.GraphModule, node: fx.Node) -> Iterator[fx.Node]:
    """The ops reading ``node``, seen through the observers of a prepared graph (the
    identity, placed between the tensor and its readers)."""
    for user in node.users:
        if user.op == "call_module" and isinstance(gm.get_submodule(str(user.target)), Observer):
            yield from _readers(gm, user)
        else:
            yield user


def read_interval(gm: fx.GraphModule, node: fx.Node) -> tuple[float, float] | None:
    """The smallest interval holding what each reader of ``node`` keeps, when every reader
    clamps it; None when one reader does not (it sees the whole tensor) or there is none."""
    kept = [kept_interval(reader) for reader in _readers(gm, node)]
    if not kept:
        return None
    if any(k is None for k in kept):
        return None
    lows, highs = zip(*(k for k in kept if k is not None), strict=True)
    return min(lows), max(highs)
