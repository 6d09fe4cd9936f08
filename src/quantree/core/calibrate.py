"""calibrate: run a prepared model over data so its observers collect statistics.

Over 400 lines: the checks of a batch against the captured program (arity, names, dtypes,
ranks, shape guards, finiteness) are most of it, each with the fix its error suggests;
split them out (``core/capturing/``) when they grow.

A calibration item is an argument tuple (a lone tensor stands for ``(tensor,)``) or, for a
model captured with keyword example inputs, an ``(args, kwargs)`` pair: a tuple or list of
the positional arguments followed by a dict of the keyword ones.

Each batch is checked against the captured program before it runs (number of arguments,
keyword names, dtypes, ranks and export's shape guard), so a batch the program cannot take
is reported as a :class:`BadBatch` naming its index and the fix, and it never reaches an
observer: the statistics gathered so far stay clean.

Inside a ``torch.distributed`` process group each process calibrates on its own shard and
the statistics are merged at the end (``quantree.core.observing.distributed``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.fx._pytree as fx_pytree
from torch.utils._pytree import TreeSpec, tree_flatten_with_path, tree_structure, tree_unflatten
from tqdm.auto import tqdm

from quantree.core.capturing.input_trees import describe_path, structure_difference
from quantree.core.capturing.layout import CHANNEL_NOTE, Shape, layout_fix
from quantree.core.capturing.shape_guards import ShapeGuardFailed
from quantree.core.errors import QuantreeError
from quantree.core.observing.distributed import calibrate_across, in_process_group
from quantree.core.observing.observers import NonFiniteValues

GUARDS_MODULE = "_guards_fn"  # the submodule torch.export's ``module()`` calls to check shapes
_GUARD_PREFIXES = ("Guard failed: ", "Expected input at ")  # export's two guard styles
Call = tuple[tuple[Any, ...], dict[str, Any]]


class BadBatch(QuantreeError):
    """A calibration item the captured program cannot take; ``index`` says which one."""

    def __init__(self, index: int, problem: str, fix: str) -> None:
        super().__init__(f"calibration batch {index} {problem}; {fix}")
        self.index = index
        self.problem = problem
        self.fix = fix


def as_args(batch: Any) -> tuple[Any, ...]:
    """A calibration item is an argument tuple; a lone tensor stands for ``(tensor,)``."""
    return tuple(batch) if isinstance(batch, tuple | list) else (batch,)


def as_call(batch: Any, index: int, spec: TreeSpec | None = None) -> Call:
    """The positional and keyword arguments of one calibration item.

    A pair ``(tuple or list, dict)`` is read as ``(args, kwargs)``; anything else is the
    argument tuple itself. A lone dict is refused rather than guessed at: which of its
    entries were captured as positional arguments is not ours to decide. Given the captured
    ``spec``, a pair is read as two positional arguments where the program takes two and no
    keywords (a model taking a NamedTuple and a dict).
    """
    if (
        spec is not None
        and isinstance(batch, tuple | list)
        and len(batch) == 2
        and spec.child(0).num_children == 2
        and spec.child(1).num_children == 0
    ):
        return tuple(batch), {}
    if isinstance(batch, Mapping):
        raise BadBatch(
            index,
            f"is a {type(batch).__name__}",
            "give keyword arguments as an (args, kwargs) pair, e.g. ((x,), {'y': y}), with "
            "the arguments the model was captured with positionally in args",
        )
    if (
        isinstance(batch, tuple | list)
        and len(batch) == 2
        and isinstance(batch[0], tuple | list)
        and isinstance(batch[1], Mapping)
    ):
        return tuple(batch[0]), dict(batch[1])
    return as_args(batch), {}


def _captured(module: torch.nn.Module) -> tuple[fx.GraphModule, TreeSpec] | None:
    """The graph and the ``(args, kwargs)`` tree torch.export captured it with, if it was."""
    if not isinstance(module, fx.GraphModule):
        return None
    info = getattr(module.graph._codegen, "pytree_info", None)
    spec = getattr(info, "in_spec", None)
    if not isinstance(spec, TreeSpec) or spec.num_children != 2:
        return None
    return module, spec


def _arity_fix(got: int, takes: int) -> str:
    if got > takes == 1 and got == 2:
        return (
            "if the items are (input, target) pairs, keep only the inputs, "
            "e.g. [(x,) for x, _ in loader]"
        )
    if got > takes:
        return f"keep only the model's arguments, e.g. [tuple(b[:{takes}]) for b in loader]"
    return f"give all {takes} positional argument(s) of the captured call in every item"


def _check_arity(spec: TreeSpec, call: Call, index: int) -> None:
    args, kwargs = call
    takes, names = spec.child(0).num_children, sorted(spec.child(1).context or [])
    if len(args) != takes:
        raise BadBatch(
            index,
            f"has {len(args)} argument(s), the program takes {takes}",
            _arity_fix(len(args), takes),
        )
    if sorted(kwargs) != names:
        raise BadBatch(
            index,
            f"has keyword argument(s) {sorted(kwargs) or 'none'}, the program takes "
            f"{names or 'none'}",
            "pass exactly the keyword arguments the model was captured with, each batch an "
            f"(args, kwargs) pair, e.g. [((x,), {{{', '.join(repr(n) + ': ...' for n in names)}}})]"
            if names and not kwargs
            else "pass exactly the keyword arguments the model was captured with",
        )


def _shape(tensor: torch.Tensor) -> str:
    """Sizes; ``*`` for one the capture left dynamic (torch prints those as ``s0``)."""
    return "(" + ", ".join(str(d) if isinstance(d, int) else "*" for d in tensor.shape) + ")"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{_shape(value)} {value.dtype}"
    return type(value).__name__


def _check_constant(name: str, value: Any, captured: Any, index: int) -> None:
    """A python number, string or bool the example passed: torch.export bakes its value into
    the program (and guards it), so a batch must pass the same value, not a tensor."""
    if isinstance(value, torch.Tensor):
        raise BadBatch(
            index,
            f"gives {name} as a tensor {_describe(value)}, the program was captured with the "
            f"python {type(captured).__name__} {captured!r} as a constant",
            f"pass {captured!r} there, or capture the model with a tensor in the example to "
            "make it an input",
        )
    if type(value) is not type(captured) or value != captured:
        raise BadBatch(
            index,
            f"gives {name} as {type(value).__name__} {value!r}, the program was captured with "
            f"the constant {type(captured).__name__} {captured!r} (torch.export bakes python "
            "values into the graph)",
            f"pass {captured!r} in every batch, or capture the model with a tensor in the "
            "example to make it an input",
        )


def _check_leaf(name: str, value: Any, captured: torch.Tensor, index: int) -> None:
    """A tensor of the captured rank and dtype (int32 and int64 indices are interchangeable)."""
    want = _describe(captured)
    if not isinstance(value, torch.Tensor):
        raise BadBatch(
            index,
            f"gives {name} as a {type(value).__name__}, the program takes a tensor {want}",
            "pass the arguments in the order and structure the model was captured with",
        )
    floating = value.is_floating_point() or captured.is_floating_point()
    if value.dtype != captured.dtype and floating:
        raise BadBatch(
            index,
            f"gives {name} as {value.dtype}, the program was captured with {captured.dtype}",
            f"convert it, e.g. {name}.to({captured.dtype})",
        )
    if value.dim() != captured.dim():
        raise BadBatch(
            index,
            f"gives {name} with shape {_shape(value)}, the program takes {want}",
            "give tensors of the rank the model was captured with",
        )


def _dynamic_example(guard: str, captured: dict[str, Shape] | None = None) -> str:
    """A ``dynamic_shapes`` value that frees the dimension the guard pinned.

    ``Dim.AUTO``: a named ``Dim`` fails where a length has a lower bound (a conv's kernel
    size). The dimensions that vary already (the batch, by default) are named too, since
    ``dynamic_shapes`` replaces them; a single input's captured shape says which.
    """
    found = re.match(r"(\w+)\.size\(\)\[(\d+)\]", guard)
    name, dim = (found.group(1), int(found.group(2))) if found else ("x", 0)
    shapes = list((captured or {}).values())
    varying = {d for d, size in enumerate(shapes[0]) if size is None} if len(shapes) == 1 else set()
    dims = ", ".join(f"{d}: torch.export.Dim.AUTO" for d in sorted({dim, *varying}))
    return f"{{'{name}': {{{dims}}}}}"


def _shape_error(
    index: int, guard: str, leaves: dict[str, Any], captured: dict[str, Shape] | None = None
) -> BadBatch:
    shapes = ", ".join(f"{name} {_describe(v)}" for name, v in leaves.items())
    problem = f"fails the program's shape guard {guard} (the batch has {shapes})"
    for name, shape in (captured or {}).items():
        value = leaves.get(name)
        fix = layout_fix(name, value.shape, shape) if isinstance(value, torch.Tensor) else None
        if fix is not None:
            return BadBatch(index, problem, fix)
    dim = re.match(r"\w+\.size\(\)\[(\d+)\]", guard)
    return BadBatch(
        index,
        problem,
        "torch.export fixes every dimension not declared dynamic: declare it when capturing, "
        f"e.g. dynamic_shapes={_dynamic_example(guard, captured)} for qt.quantize, qt.capture or "
        "torch.export.export, or use batches of the captured shape"
        + (CHANNEL_NOTE if dim is not None and dim.group(1) != "0" else ""),
    )


def guard_failure(error: BaseException) -> str | None:
    """The failed condition if ``error`` is a torch.export shape guard failing, else None."""
    if isinstance(error, ShapeGuardFailed):
        return error.guard
    if not isinstance(error, AssertionError | RuntimeError):
        return None
    text = str(error).strip()
    for prefix in _GUARD_PREFIXES:
        if text.startswith(prefix):
            return text.removeprefix("Guard failed: ").splitlines()[0]
    return None


def _run_guards(module: fx.GraphModule, leaves: dict[str, Any], index: int) -> None:
    """Export's shape guard, run before the graph so no observer sees a batch it rejects.

    (In the graph the guard runs after the placeholders' observers.) prepare drops the guard
    of a graph with cell loops, which take any sequence length; then there is none to run.
    """
    for node in module.graph.find_nodes(op="call_module", target=GUARDS_MODULE):
        values = [leaves[arg.name] for arg in node.args if isinstance(arg, fx.Node)]
        try:
            module.get_submodule(GUARDS_MODULE)(*values)
        except (AssertionError, ShapeGuardFailed) as error:
            guard = guard_failure(error)
            if guard is None:
                raise
            cause = error.__cause__ if isinstance(error, ShapeGuardFailed) else None
            captured = {
                arg.name: _captured_shape(arg) for arg in node.args if isinstance(arg, fx.Node)
            }
            raise _shape_error(index, guard, leaves, captured) from cause or error


def _captured_shape(node: fx.Node) -> Shape:
    """A placeholder's captured sizes, ``None`` where a dimension was left dynamic."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return ()
    return tuple(d if isinstance(d, int) else None for d in val.shape)


def _positional_names(gm: fx.GraphModule, spec: TreeSpec) -> list[str] | None:
    """The names of the captured program's positional parameters, if its code says them."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    names = [str(a) for a in getattr(info, "orig_args", [])][: spec.child(0).num_children]
    return names or None


def _flatten(
    gm: fx.GraphModule, spec: TreeSpec, call: Call, placeholders: int, index: int
) -> list[Any]:
    """The batch's leaves in placeholder order, as the graph's own forward flattens them.

    Its structure must be the example's: torch's flatten reads a dict by the captured keys
    only, so a key the example lacked would be dropped without a word (and a model that
    tests ``"mask" in inputs`` would compute something else than it does in float).
    """
    try:
        got = tree_structure(call)
    except Exception:  # not a pytree torch knows: the count check below says what is wrong
        got = None
    found = structure_difference(spec, got, _positional_names(gm, spec)) if got else None
    if found:
        raise BadBatch(
            index,
            f"differs in structure from the captured example: {found}",
            "give every batch the containers, keys and python values of the example",
        )
    try:
        flat = list(fx_pytree.tree_flatten_spec(call, spec))
    except Exception:  # the count check below says what is wrong
        flat = []
    if len(flat) != placeholders:
        raise BadBatch(
            index,
            "has arguments nested differently from the captured example "
            f"(the program takes {placeholders} leaves in the structure {spec})",
            "pass nested arguments (e.g. an (h, c) state) with the structure of the example",
        )
    return flat


def leaf_names(gm: fx.GraphModule, spec: TreeSpec, count: int) -> list[str]:
    """Each leaf of the captured ``(args, kwargs)`` as a user names it (``argument 0 ('d')
    ['x']``), in placeholder order; numbered where the spec does not give ``count`` leaves."""
    if spec.num_leaves != count:
        return [f"input {i}" for i in range(count)]
    names = _positional_names(gm, spec)
    paths = [p for p, _ in tree_flatten_with_path(tree_unflatten(list(range(count)), spec))[0]]
    return [describe_path(p, names) for p in paths]


def _check_finite(index: int, leaves: dict[str, Any]) -> None:
    for name, value in leaves.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            bad = ~torch.isfinite(value)
            if bool(bad.any()):
                where = tuple(int(i) for i in bad.nonzero()[0])
                raise BadBatch(
                    index,
                    f"holds NaN or infinity in {name} {_describe(value)} "
                    f"({int(bad.sum())} value(s), the first at {where})",
                    "remove the batch or clean it (e.g. torch.nan_to_num) before calibrating: "
                    "ranges are calibrated on finite data only",
                )


def check_batch(module: torch.nn.Module, call: Call, index: int) -> None:
    """Raise :class:`BadBatch` if a graph from torch.export cannot take ``call``.

    Modules not captured by torch.export are not checked: they check their own inputs.
    """
    args, kwargs = call
    _check_finite(index, {f"argument {i}": v for i, v in enumerate(args)} | kwargs)
    captured = _captured(module)
    if captured is None:
        return
    gm, spec = captured
    _check_arity(spec, call, index)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    flat = _flatten(gm, spec, call, len(placeholders), index)
    names = leaf_names(gm, spec, len(placeholders))
    for node, value, name in zip(placeholders, flat, names, strict=True):
        example = node.meta.get("val")
        if isinstance(example, torch.Tensor):
            _check_leaf(name, value, example, index)
        elif isinstance(example, int | float | bool | str):
            _check_constant(name, value, example, index)
    _run_guards(gm, {node.name: v for node, v in zip(placeholders, flat, strict=True)}, index)


def _non_finite_constants(module: torch.nn.Module) -> list[str]:
    """Names of the float parameters and buffers of ``module`` holding NaN or infinity."""
    return [
        name
        for name, t in (*module.named_parameters(), *module.named_buffers())
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]


def _size_differences(module: torch.nn.Module, call: Call) -> list[str]:
    """Where the batch's tensors differ in size from the captured example's, as text."""
    captured = _captured(module)
    if captured is None:
        return []
    gm, spec = captured
    try:
        flat = list(fx_pytree.tree_flatten_spec(call, spec))
    except Exception:
        return []
    found = []
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), flat, strict=False):
        example = node.meta.get("val")
        if not isinstance(example, torch.Tensor) or not isinstance(value, torch.Tensor):
            continue
        for dim, (want, got) in enumerate(zip(example.shape, value.shape, strict=False)):
            if isinstance(want, int) and want != got:
                found.append(f"{node.target} dimension {dim} is {got}, captured as {want}")
    return found


def _run(prepared: torch.nn.Module, call: Call, index: int) -> None:
    """One batch; errors name the batch, and say what to fix where we can tell."""
    args, kwargs = call
    try:
        prepared(*args, **kwargs)
    except NonFiniteValues as error:
        bad = _non_finite_constants(prepared)
        cause = (
            f"the model's parameters or buffers {', '.join(bad[:5])} hold NaN or infinity"
            if bad
            else "an op overflowed or divided by zero, or a mask filled it with -inf"
        )
        raise QuantreeError(
            f"calibration batch {index} is finite, but the model computed NaN or infinity at "
            f"{error.label}: {cause}. Fix the model (finite weights, a numerically stable "
            "op) before quantizing it; for a -inf mask, leave the op reading it float "
            "(rules=(qt.Rule((op,), lambda n: qt.Annotation()),)) or mask with a finite "
            "value (torch.finfo(dtype).min)"
        ) from error
    except BadBatch:
        raise
    except ShapeGuardFailed as error:  # said in calibration's terms: the batch's index
        named = {f"argument {i}": v for i, v in enumerate(args)} | kwargs
        raise _shape_error(index, error.guard, named) from error.__cause__ or error
    except QuantreeError as error:
        if error.args and isinstance(error.args[0], str):
            error.args = (f"calibration batch {index}: {error.args[0]}", *error.args[1:])
        raise
    except Exception as error:
        guard = guard_failure(error)
        if guard is not None:
            named = {f"argument {i}": v for i, v in enumerate(args)} | kwargs
            raise _shape_error(index, guard, named) from error
        differences = _size_differences(prepared, call)
        if differences:
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise BadBatch(
                index,
                f"fails inside the program ({type(error).__name__}: {first}) and differs from "
                f"the captured example: {'; '.join(differences)}",
                "give tensors of the captured sizes (only dimensions declared dynamic at "
                "capture, and a cells-mode sequence length, may change)",
            ) from error
        error.add_note(f"raised by calibration batch {index}")
        raise


def check_calibration_data(data: Any, *, allow_empty: bool = False) -> None:
    """Refuse calibration data that cannot be iterated, or a collection with no batches.

    ``allow_empty``: a process's shard may be empty when others have batches.
    """
    if data is None or isinstance(data, torch.Tensor | str | bytes | Mapping):
        what = "None" if data is None else type(data).__name__
        raise QuantreeError(
            f"calibration data must be an iterable of argument tuples (a list, a DataLoader), "
            f"got {what}; e.g. [(x1,), (x2,)]"
        )
    if not isinstance(data, Iterable):
        raise QuantreeError(
            f"calibration data must be an iterable of argument tuples (a list, a DataLoader), "
            f"got {type(data).__name__}"
        )
    if not allow_empty and hasattr(data, "__len__") and len(data) == 0:  # type: ignore[arg-type]
        raise QuantreeError(
            "calibration data has 0 batches: give at least one argument tuple of "
            "representative inputs, e.g. [(x1,), (x2,)]"
        )


def calibrate(
    prepared: torch.nn.Module,
    data: Iterable[Any],
    *,
    progress: bool = True,
    merge: bool = True,
) -> int:
    """Feed every batch of ``data`` to ``prepared``; returns the number of batches.

    Inside a ``torch.distributed`` process group of two or more processes (gloo on CPU,
    e.g. under ``torchrun``; another backend gets a gloo group of its ranks) ``data`` is this
    process's shard (``quantree.shard``), and the observers' statistics are merged across
    the processes at the end, so every process leaves with the statistics one process gets
    from all shards in rank order; the count returned is then over all processes. It is a
    collective: every process calls it, one with an empty shard too, and an error on one
    process is raised on all of them (as ``RankFailed`` on the others) before anything is
    merged. ``merge=False`` keeps each process's statistics its own
    (``quantree.merge_statistics`` merges them later).

    Raises :class:`BadBatch` (a QuantreeError) for a batch the captured program cannot take,
    and QuantreeError for data that is not an iterable of batches or gave none.
    """
    if merge and in_process_group():
        show = progress and dist.get_rank() == 0
        return calibrate_across(prepared, lambda: _feed(prepared, data, show, allow_empty=True))
    return _feed(prepared, data, progress, allow_empty=False)


def _feed(prepared: torch.nn.Module, data: Iterable[Any], progress: bool, allow_empty: bool) -> int:
    check_calibration_data(data, allow_empty=allow_empty)
    count = 0
    total = len(data) if hasattr(data, "__len__") else None  # type: ignore[arg-type]
    with torch.no_grad():
        captured = _captured(prepared)
        spec = captured[1] if captured else None
        for batch in tqdm(data, total=total, desc="calibrating", disable=not progress, leave=False):
            call = as_call(batch, count, spec)
            check_batch(prepared, call, count)
            _run(prepared, call, count)
            count += 1
    if not count and not allow_empty:
        raise QuantreeError(
            "calibration data gave 0 batches (an exhausted iterator or an empty loader?): "
            "give at least one argument tuple of representative inputs"
        )
    return count
