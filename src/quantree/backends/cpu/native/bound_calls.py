"""Native calls bound to one graph node: the contract checked once, then guarded per call.

A layer's op gets the same constants on every call of a lowered graph (packed weight, row
sums, scales, bias, geometry integers), so its contract (``native/checks.py``, the one source
of truth) need not be re-proven per call: ``bind`` runs it once, on the first call of the
node (``direct.py`` holds one binding per node), and records what the verdict rests on. A
call then checks only what can change: the activation's type, dtype and the dimensions the
contract read (indexed reads), that the graph's other arguments are the ones judged, and that
each constant is still the tensor that was checked. Anything else (a first call, a miss) runs
the full contract again and binds anew, or raises ``NativeArgumentError`` before the kernel.

The ways a constant changes after binding, and how each is seen (``Binding``):

- ``setattr`` of another tensor on the module, ``load_state_dict(assign=True)``: the graph
  passes another object; the identity differs.
- ``load_state_dict``, ``copy_`` and every other in-place op (``resize_``, ``set_``,
  ``as_strided_``): the version counter moves.
- ``.data =`` (no version bump) and ``torch.utils.swap_tensors``: the data pointer moves.
  A ``.data`` view of the checked storage that starts at the same address (and so keeps the
  pointer) is harmless: the binding holds an alias of every checked storage, so that memory
  stays alive and no other allocation can take its address; the kernel reads the checked
  bytes with the checked geometry.
- A crafted file: its constants are only ever run after a full check (the first call).
- ``torch.ops.quantree.*`` called by the user does not come here: each op runs its contract.

A per-call verdict cache keyed by these stamps was no cheaper than the checks it replaced
(docs/backends.md, "Native argument checks"; benchmarks/README.md, branch ``bind``): the
gain here is that the key is read from the
arguments the call already holds, and the kernel takes the pointers recorded with it (no
per-call ``ptr`` of the constants, no ``packed_depth``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.args import NativeArgs
from quantree.backends.cpu.native.packing import packed_depth
from quantree.backends.cpu.ops.conv1d import run_conv16, stages_in_bounds, takes_small
from quantree.backends.cpu.ops.gemm import (
    Conv2dPlan,
    LinearPlan,
    as_conv2d_geometry,
    conv2d_plan,
    is_depthwise,
    linear_plan,
    run_conv2d,
    run_conv2d_plan,
    run_linear,
    run_linear_plan,
)
from quantree.backends.cpu.ops.pool import run_max_pool2d
from quantree.backends.cpu.ops.wide import run_linear16

PLAIN = torch.Tensor


class Binding:
    """One node's op with its contract checked on the arguments of a call, reusable while a
    call's arguments are the same in everything the contract read.

    The verdict rests on: the activation (position 0 in every bound op) being a plain tensor
    of the dtype and rank it had, with the same size along ``axis`` (the channels the
    weight's depth was checked against; other sizes only size the output, which torch
    allocates); each constant tensor being the one checked, unchanged (``stamps``: identity,
    version, data pointer); every other argument equal to the one judged (``rest``: the
    integers, lists and floats the graph spells out). Subclasses name the constants'
    positions and ``axis``, check the contract (``verdict``: what the kernel needs besides
    the pointers) and run the op's unchecked body.
    """

    positions: tuple[int, ...] = ()
    axis = -1

    def __init__(self, fallback: Callable[..., Any]) -> None:
        self.fallback = fallback
        """The op itself, for arguments that are not plain tensors (export's fake ones)."""
        self.unbind()

    def unbind(self) -> None:
        self.unbound: Callable[[tuple[Any, ...]], Any] = self.miss
        self.fast: Callable[[tuple[Any, ...]], Any] = self.unbound
        """The call: the guarded kernel once bound (``guarded``), else the full check."""
        self.pointers: tuple[int | None, ...] = ()
        self.keep: tuple[Tensor, ...] = ()
        self.derived: Any = None

    @property
    def bound(self) -> bool:
        return self.fast is not self.unbound

    def __getstate__(self) -> dict:  # a copied graph binds its own constants
        return {"fallback": self.fallback}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["fallback"])  # type: ignore[misc]

    def __call__(self, args: tuple[Any, ...]) -> Any:
        """The op on ``args`` (a tuple: the caller's, not re-packed)."""
        return self.fast(args)

    def miss(self, args: tuple[Any, ...]) -> Any:
        """A call the binding does not cover: export's fake tensors go to the op, anything
        else is checked in full and bound."""
        if not all(type(t) is PLAIN for t in _tensors(args)):
            return self.fallback(*args)
        return self.bind(args)

    def bind(self, args: tuple[Any, ...]) -> Any:
        """Check the whole contract on ``args`` (raises before any kernel), record, run."""
        self.unbind()
        derived = self.verdict(args)
        tensors = [args[i] for i in self.positions]
        given = [(i, t) for i, t in zip(self.positions, tensors, strict=True) if t is not None]
        held = NativeArgs(self.fallback.__name__)  # dense copies of strided constants
        pointers = tuple(
            held.input(f"argument {i}", t) for i, t in zip(self.positions, tensors, strict=True)
        )
        self.derived, self.pointers = derived, pointers
        # the checked storages (and any dense copies the pointers address) stay alive
        self.keep = (*(t.detach() for _, t in given), held)  # type: ignore[arg-type]
        stamps = tuple((i, t, t._version, t.data_ptr()) for i, t in given)
        self.fast = guarded(self, args, stamps)
        return self.run(args, pointers, derived)

    def verdict(self, args: tuple[Any, ...]) -> Any:
        raise NotImplementedError

    def run(self, args: tuple[Any, ...], pointers: tuple[int | None, ...], derived: Any) -> Any:
        raise NotImplementedError


class BoundLinear(Binding):
    """``linear(x, weight, offset, scale, bias, out_features, out_scale, out_zero_point,
    relu)``: the verdict rests on x being int8 with K channels."""

    positions = (1, 2, 3, 4)

    def verdict(self, args: tuple[Any, ...]) -> Any:
        check.linear(*args[:6])
        return packed_depth(args[1])

    plans_kept = 8
    """Input shapes a node keeps a kernel call for (``BoundConv2d.plans_kept``)."""

    def unbind(self) -> None:
        super().unbind()
        self.plans: dict[torch.Size, LinearPlan] = {}

    def run(self, args: tuple[Any, ...], pointers: tuple[int | None, ...], derived: Any) -> Any:
        x, _, offset, scale, bias, n, out_scale, out_zp, relu = args
        plan = self.plans.get(x.shape) if self.plans_kept else None
        if plan is None:
            if x.shape[-1] == 0:  # no product (K = 0): the op's own answer, not kept
                return run_linear(x, derived, pointers, offset, scale, bias, n, out_scale,
                                  out_zp, relu)  # fmt: skip
            plan = linear_plan(x.shape, derived, pointers, n, out_scale, out_zp, relu)
            if len(self.plans) < self.plans_kept:
                self.plans[x.shape] = plan
        return run_linear_plan(x, plan)


class BoundLinear16(Binding):
    """``linear16(x, x_scale, quant_min, quant_max, weight, offset, scale, bias,
    out_features)``: x of any dtype with K channels."""

    positions = (4, 5, 6, 7)

    def verdict(self, args: tuple[Any, ...]) -> Any:
        check.linear16(args[0], *args[4:9])
        check.positive("linear16", "x_scale", args[1])
        return packed_depth(args[4])

    def run(self, args: tuple[Any, ...], pointers: tuple[int | None, ...], derived: Any) -> Any:
        x, x_scale, qmin, qmax, *_, out_features = args
        return run_linear16(x, x_scale, qmin, qmax, derived, pointers, out_features)


class BoundConv2d(Binding):
    """``conv2d(x, weight, offset, scale, bias, out_channels, kernel, stride, padding,
    dilation, x_zero_point, out_scale, out_zero_point, relu, groups)``: x int8 ``[N, C, H,
    W]`` with C channels (H and W only size the output, which torch allocates)."""

    positions = (1, 2, 3, 4)
    axis = 1

    def verdict(self, args: tuple[Any, ...]) -> Any:
        x, weight, offset, scale, bias, oc, kernel, stride, padding, dilation, zp = args[:11]
        groups = args[14] if len(args) > 14 else 1
        check.conv2d(x, weight, offset, scale, bias, oc, kernel, stride, padding, dilation, zp,
                     groups)  # fmt: skip
        return 0 if is_depthwise(int(x.shape[1]), oc, groups) else packed_depth(weight)

    plans_kept = 8
    """Input shapes a node keeps a kernel call for (a model sees few; more are derived anew;
    0: none kept or read, every call derives its own, as before plans: benchmarks/amx_ab.py)."""

    def unbind(self) -> None:
        super().unbind()
        self.plans: dict[torch.Size, Conv2dPlan] = {}
        """The kernel call per input shape, made from this binding's pointers (a new binding
        starts with none)."""

    def run(self, args: tuple[Any, ...], pointers: tuple[int | None, ...], derived: Any) -> Any:
        x = args[0]
        plan = self.plans.get(x.shape) if self.plans_kept else None
        if plan is None:
            plan = conv2d_plan(x.shape, derived, pointers, *args[5:])
            if len(self.plans) < self.plans_kept:
                self.plans[x.shape] = plan
        return run_conv2d_plan(x, plan)


class BoundConv1d(BoundConv2d):
    """``conv1d``: the same arguments, x ``[N, C, L]``, run as the conv2d of ``[N, C, 1,
    L]`` with the geometry translated once."""

    def verdict(self, args: tuple[Any, ...]) -> Any:
        check.conv1d(*args[6:10])
        geometry = as_conv2d_geometry(*args[6:10])
        as_2d = (args[0].unsqueeze(2), *args[1:6], *geometry, *args[10:])
        return BoundConv2d.verdict(self, as_2d), geometry

    def run(self, args: tuple[Any, ...], pointers: tuple[int | None, ...], derived: Any) -> Any:
        kp, geometry = derived
        x, oc = args[0], args[5]
        out = run_conv2d(x.unsqueeze(2), kp, pointers, oc, *geometry, *args[10:])
        return out.squeeze(2)


class BoundConv16(Binding):
    """``conv16(x, x_scale, quant_min, quant_max, weight, hi_offset, hi_scale, lo_offset,
    lo_scale, bias, out_channels, kernel, stride, padding, dilation, groups)`` of a 1-d ``x``
    with C channels (its length only sizes the output); a 2-d one runs the op."""

    positions = (4, 5, 6, 7, 8, 9)
    axis = 1

    def verdict(self, args: tuple[Any, ...]) -> Any:
        x, _, _, _, weight, hi_offset, hi_scale, lo_offset, lo_scale, bias = args[:10]
        oc, kernel, stride, padding, dilation, groups = args[10:]
        if x.dim() != 3:
            return None
        check.conv1d(kernel, stride, padding, dilation)
        check.positive("conv16", "x_scale", args[1])
        check.conv1d_strided(x.float(), True, weight, hi_offset, hi_scale, lo_offset, lo_scale,
                             bias, oc, kernel, stride, padding, dilation, 0, groups)  # fmt: skip
        depth = 0 if groups == int(x.shape[1]) == oc else packed_depth(weight)
        return takes_small(int(x.shape[1]), oc, kernel, groups), depth

    def run(self, args: tuple[Any, ...], pointers: tuple[int | None, ...], derived: Any) -> Any:
        x, x_scale, qmin, qmax = args[:4]
        kernel, stride, padding, dilation = args[11:15]
        if derived is None or not stages_in_bounds(x, kernel, stride, padding, dilation):
            return self.fallback(*args)
        if x.dtype is not torch.float32:
            x = x.float()
        small, depth = derived
        return run_conv16(x, x_scale, qmin, qmax, small, depth, pointers, args[10], kernel,
                          stride, padding, dilation, args[15])  # fmt: skip


class BoundMaxPool2d(Binding):
    """``max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)``: no constant tensors;
    the geometry lists are checked once (x int8 ``[N, C, H, W]``: any sizes)."""

    axis = 1

    def verdict(self, args: tuple[Any, ...]) -> Any:
        check.max_pool2d(*args[:5])
        return None

    def run(self, args: tuple[Any, ...], pointers: tuple[int | None, ...], derived: Any) -> Any:
        return run_max_pool2d(*args)


BINDINGS: dict[str, Callable[[Callable[..., Any]], Binding]] = {
    "linear": BoundLinear,
    "linear16": BoundLinear16,
    "conv2d": BoundConv2d,
    "conv1d": BoundConv1d,
    "conv16": BoundConv16,
    "max_pool2d": BoundMaxPool2d,
}
"""The ops a lowered graph binds per node (``direct.py``), by name."""


def guarded(
    binding: Binding, bound: tuple[Any, ...], stamps: tuple[tuple[int, Tensor, int, int], ...]
) -> Callable[[tuple], Any]:
    """``binding``'s call for arguments like ``bound``: its kernel if the activation has the
    bound dtype, rank and width, each stamped constant (position, tensor, version, data
    pointer) is that tensor unchanged, and the rest equals ``bound``'s; else ``miss``.

    Straight-line code over values held in the closure: a layer has three constants, four
    with a bias, and every read on the way costs (attribute loads and a loop over the stamps
    were measurably slower)."""
    x = bound[0]
    dtype, rank, axis = x.dtype, x.ndim, binding.axis
    width, rest = x.shape[axis], bound[1:]
    # the closure holds what this verdict bound: a later bind makes another closure
    run, pointers, derived, miss = binding.run, binding.pointers, binding.derived, binding.miss
    if not stamps:  # no constant tensor (pooling): the input and the geometry

        def geometry(args: tuple) -> Any:
            x = args[0]
            if (
                type(x) is PLAIN
                and x.dtype is dtype
                and x.ndim == rank
                and x.shape[axis] == width
                and args[1:] == rest
            ):
                return run(args, pointers, derived)
            return miss(args)

        return geometry
    if len(stamps) not in (3, 4):

        def loop(args: tuple) -> Any:
            x = args[0]
            if (
                type(x) is PLAIN
                and x.dtype is dtype
                and x.ndim == rank
                and x.shape[axis] == width
                and all(
                    args[i] is t and t._version == v and t.data_ptr() == p for i, t, v, p in stamps
                )
                and args[1:] == rest
            ):
                return run(args, pointers, derived)
            return miss(args)

        loop.keep = binding.keep  # type: ignore[attr-defined]  # its storages, alive
        return loop
    (i0, t0, v0, p0), (i1, t1, v1, p1), (i2, t2, v2, p2) = stamps[:3]
    i3, t3, v3, p3 = stamps[3] if len(stamps) == 4 else (0, None, 0, 0)

    def straight(args: tuple) -> Any:
        x = args[0]
        if type(x) is PLAIN and x.dtype is dtype and x.ndim == rank and x.shape[axis] == width:
            a, b, c = args[i0], args[i1], args[i2]
            if (
                a is t0 and b is t1 and c is t2
                and a._version == v0 and b._version == v1 and c._version == v2
                and a.data_ptr() == p0 and b.data_ptr() == p1 and c.data_ptr() == p2
                and (t3 is None or (
                    args[i3] is t3 and t3._version == v3 and t3.data_ptr() == p3))
                and args[1:] == rest  # the constants are the checked ones: no tensor read
            ):  # fmt: skip
                return run(args, pointers, derived)
        return miss(args)

    straight.keep = binding.keep  # type: ignore[attr-defined]  # its storages, alive
    return straight


def _tensors(args: tuple[Any, ...]) -> list[Any]:
    found: list[Any] = []
    for a in args:
        if isinstance(a, list | tuple):
            found += [t for t in a if isinstance(t, torch.Tensor)]
        elif isinstance(a, torch.Tensor):
            found.append(a)
    return found
