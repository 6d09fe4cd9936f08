"""shape_guards: a captured model called with a shape it cannot take says which input, the
shape it was captured with, and how to capture that dimension dynamic.

torch.export checks every call against the shapes it captured in a ``_guards_fn`` submodule
that raises ``AssertionError: Guard failed: feats.size()[0] == 4``: neither the captured
shape nor the fix. The guard function is wrapped, not replaced: torch.export's guards stay
the one source of truth (and are what re-export traces through), the wrapper only explains
their failure.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.fx as fx

from quantree.core.capturing.layout import CHANNEL_NOTE, layout_fix
from quantree.core.errors import QuantreeError

GUARDS = "_guards_fn"
_EXPLAINED = "_quantree_explained"
_FIXED_BY_CODE = "_quantree_fixed_by_code"

M = TypeVar("M", bound=torch.nn.Module)
Shape = tuple[int | None, ...]  # None: a dimension the capture left dynamic


class ShapeGuardFailed(QuantreeError):
    """A call refused by a shape guard; ``guard`` is the failed condition, for callers that
    explain it in their own terms (calibration names the batch)."""

    def __init__(self, message: str, guard: str) -> None:
        super().__init__(message)
        self.guard = guard


def explain_shape_guards(module: M) -> M:
    """Make ``module``'s shape guard raise a ``QuantreeError`` that says what to do.

    Returns ``module`` (changed in place: call it on modules quantree made, never on the
    user's). A module without a guard (a cells-mode graph drops it) is returned as it is.
    """
    guard = getattr(module, GUARDS, None)
    if not isinstance(module, fx.GraphModule) or guard is None or getattr(guard, _EXPLAINED, False):
        return module
    call = next(
        (n for n in module.graph.nodes if n.op == "call_module" and n.target == GUARDS), None
    )
    if call is None:
        return module
    names = _argument_names(module)
    nodes = [a for a in call.args if isinstance(a, fx.Node)]
    inputs = [(names.get(a.name, a.name), _captured(a)) for a in nodes]
    position = {a.name: i for i, a in enumerate(nodes)}
    check = guard.forward

    def forward(*args: Any) -> Any:
        try:
            return check(*args)
        except AssertionError as error:
            if not str(error).startswith("Guard failed"):
                raise
            text = str(error)
            condition = text.removeprefix("Guard failed: ").splitlines()[0]
            notes = {
                (position[node], dim): note
                for (node, dim), note in getattr(guard, _FIXED_BY_CODE, {}).items()
                if node in position
            }
            raise ShapeGuardFailed(shape_message(inputs, args, text, notes), condition) from error

    guard.forward = forward
    setattr(guard, _EXPLAINED, True)
    if _reads_only_sizes(check) and type(guard).__call__ is torch.nn.Module.__call__:
        guard.__class__ = PassedShapes
        guard.passed = set()
    return module


class PassedShapes(torch.nn.Module):
    """A shape guard that remembers the input shapes it passed.

    torch.export's guard function asserts one size at a time inside a dynamo config patch,
    on every model call: on a small LSTM that alone was about the gap to ONNX Runtime.
    Its conditions read input
    sizes only (checked when it is wrapped), so
    shapes that passed once pass again: a call with plain tensors of those shapes is one
    tuple lookup. Anything else (fake tensors while exporting, a new shape, non-tensor
    inputs) runs the guard as before, through ``Module.__call__``, so re-export traces it.
    """

    passed: set[tuple[torch.Size, ...]]
    _MAX_REMEMBERED = 64  # distinct shapes kept; a model fed ever new batch sizes forgets

    def __call__(self, *args: Any) -> Any:
        tensor = torch.Tensor
        if len(args) == 1 and type(args[0]) is tensor:  # one input: no generator
            key: tuple[torch.Size, ...] = (args[0].shape,)
        elif all(type(a) is tensor for a in args):
            key = tuple(a.shape for a in args)
        else:
            return super().__call__(*args)
        if key in self.passed:
            return None
        result = super().__call__(*args)
        if len(self.passed) >= self._MAX_REMEMBERED:
            self.passed.clear()
        self.passed.add(key)
        return result


_SIZE_ONLY = {"torch", "_assert", "size", "math", "isnan", "inf", "max", "min"}
"""Names a size-only guard reads: torch's assert, sizes, and the builtins ``max``/``min`` of
them (a recurrent layer after pooling over a dynamic length guards ``max(...)``: CRNN)."""


def _reads_only_sizes(check: Any) -> bool:
    """Whether torch.export's guard function (inside its dynamo wrapper) reads nothing of
    its inputs but their sizes (and sympy's integer functions of them)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    allowed = _SIZE_ONLY | set(SYMPY_INTERP)
    inner = [
        c.cell_contents
        for c in (getattr(check, "__closure__", None) or ())
        if callable(c.cell_contents) and hasattr(c.cell_contents, "__code__")
    ]
    if len(inner) != 1:
        return False
    code = inner[0].__code__
    return bool(code.co_names) and set(code.co_names) <= allowed and not code.co_freevars


BATCH_DIM = "torch.export.Dim('batch')"


def _argument_names(module: fx.GraphModule) -> dict[str, str]:
    """Placeholder name -> the ``forward`` parameter it is, where each parameter is one tensor.

    ``dynamic_shapes`` is keyed by the parameter's name (``input``), which the placeholder's
    may not be (``input_1``); nested inputs keep the placeholder's.
    """
    info = getattr(module.graph._codegen, "pytree_info", None)
    spec = getattr(info, "in_spec", None)
    orig = [str(a) for a in getattr(info, "orig_args", None) or []]
    placeholders = [n.name for n in module.graph.nodes if n.op == "placeholder"]
    if spec is None or spec.num_children != 2 or len(placeholders) != len(orig):
        return {}
    args, kwargs = spec.children()
    if kwargs.num_children or any(not c.is_leaf() for c in args.children()):
        return {}
    return dict(zip(placeholders, orig, strict=True))


def _captured(node: fx.Node) -> Shape | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(d if isinstance(d, int) else None for d in val.shape)


def _text(shape: Sequence[int | None]) -> str:
    return "(" + ", ".join("*" if d is None else str(d) for d in shape) + ")"


def note_fixed_by_code(module: torch.nn.Module, placeholder: str, dim: int, note: str) -> None:
    """Say why an input's (``placeholder``'s) dimension ``dim`` is fixed and what frees it, for
    the error a call at another size raises in place of the ``dynamic_shapes`` fix.

    A capture pass that finds the model's own code fixing a size (a Python loop unrolled over
    it) knows what ``dynamic_shapes`` cannot: export would specialise the size again. Kept
    on the guard, which every copy of the module shares with the wrapper that reads it.
    """
    guard = getattr(module, GUARDS, None)
    if guard is None:
        return
    notes = guard.__dict__.setdefault(_FIXED_BY_CODE, {})
    notes[(placeholder, dim)] = note


def _constrained_dims(
    guard: str, inputs: Sequence[tuple[str, Shape | None]], args: Sequence[Any]
) -> list[tuple[int, int, int]]:
    """``(input, dimension, size)`` the failed guard condition reads that the capture left
    dynamic: the model's code, not the capture, limits them."""
    found = []
    for name, dim in dict.fromkeys(re.findall(r"(\w+)\.size\(\)\[(\d+)\]", guard)):
        for i, ((input_name, captured), arg) in enumerate(zip(inputs, args, strict=False)):
            d = int(dim)
            if (
                input_name == name
                and captured is not None
                and d < len(captured)
                and captured[d] is None
                and isinstance(arg, torch.Tensor)
                and d < arg.dim()
            ):
                found.append((i, d, int(arg.shape[d])))
    return found


def shape_message(
    inputs: Sequence[tuple[str, Shape | None]],
    args: Sequence[Any],
    guard: str,
    notes: dict[tuple[int, int], str] | None = None,
) -> str:
    """Each input whose shape differs from its captured one, and the fix: ``dynamic_shapes``,
    or what ``notes`` says frees a dimension the model's code fixes."""
    parts, fixes, noted = [], [], []
    for index, ((name, captured), arg) in enumerate(zip(inputs, args, strict=False)):
        if captured is None or not isinstance(arg, torch.Tensor):
            continue
        got = tuple(arg.shape)
        permuted = layout_fix(f"input '{name}'", got, captured, code=name)
        if permuted is not None:
            return f"{permuted} ({guard})"
        if len(got) != len(captured):
            parts.append(
                f"input '{name}' has {len(got)} dimensions {_text(got)}, captured with "
                f"{len(captured)} {_text(captured)}"
            )
            continue
        fixed = [
            d for d, (g, c) in enumerate(zip(got, captured, strict=True)) if c not in (g, None)
        ]
        if not fixed:
            continue
        parts.append(
            f"input '{name}' has shape {_text(got)}, captured with {_text(captured)}: "
            f"dimension {', '.join(map(str, fixed))} was fixed at capture"
        )
        by_code = {d: (notes or {}).get((index, d)) for d in fixed}
        noted += [n for n in dict.fromkeys(by_code.values()) if n and n not in noted]
        unexplained = [d for d in fixed if not by_code[d]]
        if unexplained:
            # Dim.AUTO where a length may have a lower bound (a conv needs its kernel's size);
            # the dimensions that vary already are named too: dynamic_shapes replaces them
            free = sorted({*unexplained, *(d for d, c in enumerate(captured) if c is None)})
            dims = ", ".join(
                f"{d}: {BATCH_DIM if d == 0 and d in fixed else 'torch.export.Dim.AUTO'}"
                for d in free
            )
            fixes.append(f"{name!r}: {{{dims}}}")
    if not parts:
        constrained = _constrained_dims(guard, inputs, args)
        noted = [n for n in dict.fromkeys((notes or {}).get(k[:2]) for k in constrained) if n]
        where = "; ".join(
            f"input '{inputs[i][0]}' dimension {d} (size {size}) was captured dynamic, but the "
            "model's code constrains it"
            for i, d, size in constrained
        )
        if noted:
            return f"{where} ({guard}). " + " ".join(noted)
        if constrained:
            return (
                f"{where} ({guard}): dynamic_shapes cannot free what the code fixes. Run at a "
                "size the condition allows, or capture (quantize) at the size you run at"
            )
    what = "; ".join(parts) or "an input's shape is not one the model was captured for"
    if noted and not fixes:
        return f"{what} ({guard}). " + " ".join(noted)
    fix = (
        f"dynamic_shapes={{{', '.join(fixes)}}}"
        if fixes
        else "dynamic_shapes= naming the dimensions that vary"
    )
    return (
        f"{what} ({guard}). Where the model can take other sizes, capture it dynamic: "
        f"qt.quantize(model, example_args, data, {fix}) (qt.capture takes the same); for a "
        "saved .pt2, quantize the float model again with it"
        + (CHANNEL_NOTE if any(not f.endswith(f"{{0: {BATCH_DIM}}}") for f in fixes) else "")
        + "".join(f" {n}" for n in noted)
    )
