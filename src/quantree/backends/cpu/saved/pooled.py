"""Small constants of a saved program stored in a few shared storages.

``torch.export.save`` writes one archive member per tensor storage, and a member costs about
200 bytes besides its data (its local header and central directory entry, its name twice, the
padding that puts its data on 64 bytes). A lowered model holds many small tensors: per layer a
weight scale and a bias vector, layer norm parameters, derived-constant inputs, program
tables. On the 260 K-parameter Conformer that was 81 members, 21 KB, 8% of its int8 weights.
torch writes one storage once for all the tensors that view it, and loads each as a view
again (``_package_weights.get_complete_tensor``), so here the small tensors of each payload
kind (weights or constants) and dtype are copied into one storage, each at a 64-byte aligned
offset (so a kernel reading it sees the alignment it had), and the saved program reads those
views. The lowered model's own tensors are not touched: ``program`` is the copy ``save``
exported.
"""

from __future__ import annotations

import torch
from torch import Tensor

POOLED_MAX_BYTES = 64 * 1024
"""Tensors up to this size share storages; larger ones keep a member each (their member
overhead is under 0.3% of their size)."""
ALIGNMENT = 64


def _pool(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Views into one new storage, one per tensor of ``tensors`` (all of one dtype)."""
    first = next(iter(tensors.values()))
    step = max(ALIGNMENT // first.element_size(), 1)
    offsets: dict[str, int] = {}
    total = 0
    for name, t in tensors.items():
        offsets[name] = total
        total += -(-max(t.numel(), 1) // step) * step
    flat = torch.zeros(total, dtype=first.dtype)
    views: dict[str, Tensor] = {}
    for name, t in tensors.items():
        start = offsets[name]
        view = flat[start : start + t.numel()].view(t.shape)
        view.copy_(t.detach())
        if isinstance(t, torch.nn.Parameter):
            view = torch.nn.Parameter(view, requires_grad=t.requires_grad)
        views[name] = view
    return views


def pool_small_tensors(program: torch.export.ExportedProgram) -> int:
    """Point ``program``'s small weights and constants at shared storages, per payload kind
    and dtype. Returns how many tensors now share a storage."""
    pooled = 0
    for table in (program.state_dict, program.constants):
        tensors = {k: t for k, t in table.items() if isinstance(t, Tensor)}
        readers: dict[int, int] = {}
        for t in tensors.values():
            storage = t.untyped_storage().data_ptr()
            readers[storage] = readers.get(storage, 0) + 1
        groups: dict[torch.dtype, dict[str, Tensor]] = {}
        for name, t in tensors.items():
            small = t.nbytes <= POOLED_MAX_BYTES and t.layout == torch.strided
            whole = t.untyped_storage().nbytes() == t.nbytes and t.is_contiguous()
            alone = readers[t.untyped_storage().data_ptr()] == 1  # aliases are left alone
            if small and whole and alone and t.device.type == "cpu":
                groups.setdefault(t.dtype, {})[name] = t
        for group in groups.values():
            if len(group) < 2:
                continue
            with torch.no_grad():
                table.update(_pool(group))
            pooled += len(group)
    return pooled
