"""The pointer arguments of one native call, and the dense copies they point into.

A C kernel reads a tensor through one address, in dense order: a strided tensor (a weight
stored with doubled strides in a file, an ``expand``-ed state, a transposed view) must be
copied first. Taking the address of a copy inside the call expression,
``ptr(t.contiguous())``, hands the kernel memory that the copy's last reference releases
before the kernel runs (a use after free: the allocator gives the block to the kernel's own
workspace, and the output is silently wrong). ``NativeArgs`` is the one way an op turns
tensors into addresses: each address it returns belongs to a tensor it holds, so the copies
live as long as the ``NativeArgs`` object, which the op keeps in a local variable through
the call (or, for a plan reused across calls, in the plan's ``keep``).

Every argument is also checked where its address is taken: on the CPU, of the dtype the
kernel reads, of the rank it indexes with. A violation is a ``NativeArgumentError`` naming
the op and the argument, never a bare ``ValueError``. Outputs are never copied (a copy
would take the kernel's writes): an output must already be dense.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from quantree.backends.cpu.native.checks import fail

CHANNELS_LAST = torch.channels_last


def is_dense(t: Tensor) -> bool:
    """Contiguous, or channels-last for a 4-d tensor: one block read in its own order."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=CHANNELS_LAST))


class NativeArgs:
    """The addresses one call (or one reusable plan) passes, with what they point into."""

    __slots__ = ("held", "op")

    def __init__(self, op: str) -> None:
        self.op = op
        self.held: list[object] = []
        """Every tensor (or ctypes array) an address handed out points into."""

    def input(
        self,
        name: str,
        t: Tensor | None,
        dtype: torch.dtype | None = None,
        rank: int | None = None,
    ) -> int | None:
        """The address of ``t``'s values in dense order (None for an absent optional
        tensor): ``t`` itself when dense, else a contiguous copy held here."""
        if t is None:
            return None
        self.check(name, t, dtype, rank)
        if not is_dense(t):
            t = t.contiguous()
        self.held.append(t)
        return t.data_ptr()

    def strided_input(self, name: str, t: Tensor, dtype: torch.dtype, rank: int) -> int:
        """The address of ``t``'s first element, for a kernel that is given ``t``'s strides
        and reads it through them (never past its elements, all of which lie in ``t``'s
        storage); ``t`` held, not copied."""
        self.check(name, t, dtype, rank)
        self.held.append(t)
        return t.data_ptr()

    def output(self, name: str, t: Tensor) -> int:
        """The address of an output the op allocated: written in place, so never copied."""
        self.check(name, t, None, None)
        if not is_dense(t):
            raise fail(self.op, f"output {name} of strides {t.stride()} is not dense")
        self.held.append(t)
        return t.data_ptr()

    def optional_output(self, name: str, t: Tensor | None) -> int | None:
        return None if t is None else self.output(name, t)

    def layer(
        self, weight: Tensor, offset: Tensor, scale: Tensor, bias: Tensor | None
    ) -> tuple[int | None, ...]:
        """The addresses of a layer's constants, as ``run_linear`` and friends take them."""
        return (
            self.input("weight", weight),
            self.input("offset", offset, torch.int32),
            self.input("scale", scale, torch.float32),
            self.input("bias", bias, torch.float32),
        )

    def inputs(
        self, name: str, tensors: Sequence[Tensor], dtype: torch.dtype | None = None
    ) -> ctypes.Array:
        """A ``void*`` array of the tensors' dense addresses (at least one slot), held."""
        addresses = [self.input(f"{name}[{i}]", t, dtype) for i, t in enumerate(tensors)]
        array = (ctypes.c_void_p * max(len(addresses), 1))(*addresses)
        self.held.append(array)
        return array

    def outputs(self, name: str, tensors: Sequence[Tensor]) -> ctypes.Array:
        addresses = [self.output(f"{name}[{i}]", t) for i, t in enumerate(tensors)]
        array = (ctypes.c_void_p * max(len(addresses), 1))(*addresses)
        self.held.append(array)
        return array

    def check(self, name: str, t: Tensor, dtype: torch.dtype | None, rank: int | None) -> None:
        if not isinstance(t, Tensor):
            raise fail(self.op, f"{name} is a {type(t).__name__}, not a tensor")
        if not t.is_cpu:
            raise fail(self.op, f"{name} is on {t.device}, the kernel reads CPU memory")
        if dtype is not None and t.dtype != dtype:
            raise fail(self.op, f"{name} is {t.dtype}, the kernel reads {dtype}")
        if rank is not None and t.dim() != rank:
            raise fail(self.op, f"{name} has shape {tuple(t.shape)}, the kernel reads {rank}-d")
