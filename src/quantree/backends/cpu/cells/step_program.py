"""A folded loop whose lowered step is one region program, run natively for every step.

A loop folded from a Python loop over time (``recurrent.unrolled.StepLoop``) whose step is
not a recurrent cell (a selective scan, a Light-GRU written with modules) would run its
lowered step op by op in Python, slower than float. Its lowered body is given to the region
pass (``passes/regions.py``) with no minimum size: where every op of the step lands in one
program (the identity casts, full slices and size-1 selects export leaves dropped first),
the loop becomes ``NativeProgramLoop``, which cuts each per-step input into a ``[T, ...]``
buffer and runs the program for every step in one ``quantree.program_loop`` call. Anything
else keeps the Python loop (and the backend's warning that says so).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from quantree.backends.cpu.cells.loop_plan import LoopPlan, layout
from quantree.backends.cpu.cells.program_loop import checked_loop
from quantree.backends.cpu.passes.casts import drop_identity_casts
from quantree.backends.cpu.passes.regions import fuse_regions
from quantree.core.graphs import copy_graph_module, fetch_attr
from quantree.recurrent.unrolled.step_loop import StepLoop, StepOutput

aten = torch.ops.aten
TABLES = ("code", "fcode", "slots", "in_slots", "out_slots")
SIZE_ONE = {aten.select.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims}
PLANS_KEPT = 8
"""Input layouts a loop keeps a checked call for (others run the op in full)."""
LISTS = ("in_shapes", "in_ranks", "out_shapes", "out_ranks", "out_dtypes", "in_coeffs",
         "out_coeffs", "sym")  # fmt: skip


class NativeProgramLoop(nn.Module):
    """``StepLoop``'s call ``(*states, *sources, *invariants) -> (*final_states, *outputs)``
    with the step as one native program."""

    quantree_read_only_buffers = True  # the program and its constants (core.constants)

    def __init__(
        self, loop: StepLoop, args: dict[str, Any], roles: list[tuple[str, int]],
        consts: list[Tensor], results: list[int], feed: list[int],
    ) -> None:  # fmt: skip
        super().__init__()
        self.n_states, self.inputs, self.outputs = loop.n_states, loop.inputs, loop.outputs
        self.steps_captured, self.free = loop.steps_captured, loop.free
        for k in TABLES:
            self.register_buffer(k, args[k])
        for i, c in enumerate(consts):
            self.register_buffer(f"const{i}", c)
        self.n_consts = len(consts)
        self.lists = {k: [int(v) for v in args[k]] for k in LISTS}
        self.roles = roles
        """Per program input: ("state" | "source" | "invariant", index) or ("const", i)."""
        self.results = results
        """Per body output (states, then per-step outputs): the program output it is."""
        self.feed = feed
        self.plans: dict[Any, LoopPlan] = {}
        """The checked call per input layout (``loop_plan.py``); never saved or copied."""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["plans"] = {}  # a copy plans with its own tensors
        return state

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        buffers: Any = self._buffers
        consts = [buffers[f"const{i}"] for i in range(self.n_consts)]
        tables = [buffers[k] for k in TABLES]
        key = layout(args)
        plan = self.plans.get(key) if key is not None else None
        if plan is not None and plan.matches([*tables, *consts]):
            outs = plan.run_args(args)
        else:
            outs = self._call(args, consts, tables, key)
        n = self.n_states
        finals = [outs[i][-1] for i in self.results[:n]]
        collected = []
        for spec, i in zip(self.outputs, self.results[n:], strict=True):
            collected.append(_joined(outs[i], spec))
        return (*finals, *collected)

    def _call(
        self, args: tuple[Tensor, ...], consts: list[Tensor], tables: list[Tensor], key: Any
    ) -> list[Tensor]:
        """The op in full (every check, then the kernel); planned for plain tensors where
        every input is an argument or a view of one read in place."""
        n, m = self.n_states, len(self.inputs)
        states, sources, invariants = args[:n], args[n : n + m], args[n + m :]
        steps = StepLoop.length(self, sources)  # type: ignore[arg-type]
        cut = [_per_step(src, spec, steps) for src, spec in zip(sources, self.inputs, strict=True)]
        pick = {"state": states, "source": cut, "invariant": invariants}
        inputs = [consts[i] if role == "const" else pick[role][i] for role, i in self.roles]
        stepped = [int(role == "source") for role, _ in self.roles]
        call: Any = (inputs, consts, *tables, *(self.lists[k] for k in LISTS), stepped, self.feed)
        if key is None or layout(inputs) is None:  # export's fake tensors: the op
            return torch.ops.quantree.program_loop(*call)  # type: ignore[no-any-return]
        outs, steps, size = checked_loop(*call)
        plan = LoopPlan(inputs, stepped, [*tables, *consts], consts, tables, outs, self.feed,
                        steps, size)  # fmt: skip
        places = _places(self.roles, plan.dense, args, cut, list(self.inputs), steps, n, m)
        if places is None:
            return outs
        plan.pick(places)
        if len(self.plans) >= PLANS_KEPT:
            self.plans.clear()
        self.plans[key] = plan
        return outs


def _places(
    roles: list[tuple[str, int]], in_place: tuple[bool, ...], args: tuple[Tensor, ...],
    cut: list[Tensor], specs: list[Any], steps: int, n: int, m: int,
) -> list[tuple[int, int | None, Any]] | None:  # fmt: skip
    """Per program input, the loop argument it is read from, the byte offset of a per-step
    input's first step in it (None: the argument itself, made dense) and, for per-step
    inputs copied out (reversed, or rows not evenly spaced), the cut that makes them; None
    where an input is a constant."""
    places: list[tuple[int, int | None, Any]] = []
    for (role, i), keep in zip(roles, in_place, strict=True):
        if role == "const":
            return None
        if role != "source":
            places.append((i if role == "state" else n + m + i, None, None))
            continue
        src, view = args[n + i], cut[i]
        shared = view.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
        if keep and shared:
            places.append((n + i, view.data_ptr() - src.data_ptr(), None))
        else:
            spec = specs[i]
            places.append((n + i, None, lambda x, s=spec: _per_step(x, s, steps).contiguous()))
    return places


def _per_step(src: Tensor, spec: Any, steps: int) -> Tensor:
    """Step ``t``'s slice of ``src`` as row ``t`` of one ``[T, ...]`` tensor (a view where
    the steps run forwards)."""
    size = src.shape[spec.dim]
    if spec.width > 0:
        return _windows(src, spec, steps)
    first = spec.start if spec.stride > 0 else size - 1 - spec.start
    moved = _to_front(src, spec.dim)
    if spec.stride > 0:  # a view: program_loop reads evenly spaced rows in place
        return moved.narrow(0, first, steps)
    return moved.narrow(0, first - steps + 1, steps).flip(0).contiguous()


def _windows(src: Tensor, spec: Any, steps: int) -> Tensor:
    """Adjacent ``narrow`` inputs (a chunkwise recurrence's chunk ``t``: ``src.narrow(dim,
    start + t width, width)``) as ``[T, ...]``: the span they cover split into ``T`` windows
    and moved to the front (a view where they run forwards)."""
    dim = spec.dim % src.dim()
    first = spec.start if spec.stride > 0 else src.shape[dim] - spec.width - spec.start
    low = first if spec.stride > 0 else first - (steps - 1) * spec.width
    span = src.narrow(dim, low, steps * spec.width)
    split = span.reshape([*src.shape[:dim], steps, spec.width, *src.shape[dim + 1 :]])
    moved = _to_front(split, dim)
    return moved if spec.stride > 0 else moved.flip(0).contiguous()


def _joined(values: Tensor, spec: StepOutput) -> Tensor:
    """The ``stack``/``cat``/``last`` of the per-step ``values`` [T, ...]."""
    if spec.kind == "last":
        return values[-1]
    if spec.reverse:
        values = values.flip(0)
    if spec.kind == "stack":
        return _from_front(values, spec.dim % values.dim()).contiguous()
    dim = spec.dim % (values.dim() - 1)
    moved = _from_front(values, dim)
    shape = [*moved.shape[:dim], moved.shape[dim] * moved.shape[dim + 1], *moved.shape[dim + 2 :]]
    return moved.reshape(shape)


# permute, not movedim: a saved model holds only Core ATen ops (saved/checks/vocabulary.py)
def _to_front(t: Tensor, dim: int) -> Tensor:
    dim %= t.dim()
    return t.permute([dim, *(d for d in range(t.dim()) if d != dim)])


def _from_front(t: Tensor, dim: int) -> Tensor:
    order = list(range(1, t.dim()))
    order.insert(dim, 0)
    return t.permute(order)


def native_program_loop(loop: StepLoop) -> NativeProgramLoop | None:
    """The native loop computing ``loop`` (lowered), or None where its step is not one
    program or its per-step inputs are not single steps or adjacent windows (``narrow``s),
    in order or reversed."""
    if not loop.inputs or any(abs(s.stride) != max(s.width, 1) for s in loop.inputs):
        return None
    body = copy_graph_module(loop.body)
    _simplify(body)
    drop_identity_casts(body, inputs=True)
    fuse_regions(body, min_ops=1, math=True)
    program = [n for n in body.graph.nodes if n.op == "call_function"
               and n.target == torch.ops.quantree.program.default]  # fmt: skip
    if len(program) != 1:
        return None
    call = program[0]
    for n in body.graph.nodes:
        inside = n.target is operator.getitem and n.args[0] is call
        if n.op == "call_function" and n is not call and not inside:
            return None
    output = next(n for n in body.graph.nodes if n.op == "output")
    results = []
    for r in output.args[0]:  # type: ignore[union-attr]
        if not (isinstance(r, fx.Node) and r.target is operator.getitem and r.args[0] is call):
            return None
        results.append(int(r.args[1]))  # type: ignore[arg-type]
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    n, m = loop.n_states, len(loop.inputs)
    a: Any = call.args
    names = ("inputs", "consts", *TABLES, *LISTS[:5])
    args = dict(zip(names, a, strict=False))
    extra = list(a[len(names) :])
    args.update(in_coeffs=[], out_coeffs=[], sym=[])
    if extra:
        args.update(in_coeffs=extra[0], out_coeffs=extra[1], sym=extra[2])
    if not args["in_coeffs"]:  # a static program: every size fixed
        args["in_coeffs"] = [0] * len(args["in_shapes"])
        args["out_coeffs"] = [0] * len(args["out_shapes"])
    for k in TABLES:
        args[k] = fetch_attr(body, str(args[k].target))
    consts = [fetch_attr(body, str(c.target)) for c in args["consts"]]
    roles: list[tuple[str, int]] = []
    for x in args["inputs"]:
        if x.op == "get_attr":
            roles.append(("const", len(consts)))
            consts.append(fetch_attr(body, str(x.target)))
            continue
        i = placeholders.index(x)
        roles.append(("state", i) if i < n else ("source", i - n) if i < n + m
                     else ("invariant", i - n - m))  # fmt: skip
    if not any(role == "source" for role, _ in roles):
        return None
    feed = [-1] * len(args["out_dtypes"])
    for j in range(n):
        if ("state", j) in roles and feed[results[j]] != -1:
            return None
        if ("state", j) in roles:
            feed[results[j]] = roles.index(("state", j))
    for o, f in enumerate(feed):  # a state no per-step output reads: its last value only
        if f >= 0 and o not in results[n:]:
            feed[o] = -f - 2
    return NativeProgramLoop(loop, args, roles, consts, results, feed)


def _simplify(body: fx.GraphModule) -> None:
    """Drop what export leaves that computes nothing: slices of a whole dimension; selects
    of a size-1 one, squeezes and unsqueezes become reshapes (which programs take as views)."""
    for n in list(body.graph.nodes):
        a: Any = n.args
        if n.target == aten.slice.Tensor and len(a) >= 2:
            start = a[2] if len(a) > 2 else 0
            end = a[3] if len(a) > 3 else None
            step = a[4] if len(a) > 4 else 1
            if start in (0, None) and (end is None or end >= 2**62) and step == 1:
                n.replace_all_uses_with(a[0])
                body.graph.erase_node(n)
        elif n.target in SIZE_ONE and isinstance(a[0], fx.Node):
            val, src = n.meta.get("val"), a[0].meta.get("val")
            if not isinstance(val, Tensor) or not isinstance(src, Tensor):
                continue
            if n.target == aten.select.int and src.shape[a[1]] != 1:
                continue
            if sum(not isinstance(d, int) for d in val.shape) > 1:
                continue
            shape = [d if isinstance(d, int) else -1 for d in val.shape]
            with body.graph.inserting_before(n):
                view = body.graph.call_function(aten.reshape.default, (a[0], shape))
            view.meta = dict(n.meta)
            n.replace_all_uses_with(view)
            body.graph.erase_node(n)
    body.graph.lint()
    body.recompile()
