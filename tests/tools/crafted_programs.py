"""Saved programs an attacker writes: valid ``torch.export.save`` archives whose graph
calls ops outside quantree's dialect, or whose members and tables declare more than they
hold. Built through torch's own serializer (nodes added to an exported graph with their
fake values), or by editing the archive's JSON and members."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch._guards import detect_fake_mode

aten = torch.ops.aten


class AddOne(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + 1


def example() -> tuple[torch.Tensor]:
    return (torch.ones(2, 4),)


def with_file_ops(path: Path, target: Path, payload: bytes | None) -> Path:
    """A float program of ``AddOne`` that maps ``target`` (``aten.from_file``) and, with a
    ``payload``, writes it there (``aten.copy_``); else returns the file's first bytes
    added to its output."""
    torch.manual_seed(0)
    program = torch.export.export(AddOne().eval(), example())
    graph = program.graph_module.graph
    fake = detect_fake_mode([n.meta.get("val") for n in graph.nodes])
    assert fake is not None
    output = next(n for n in graph.nodes if n.op == "output")
    result = output.args[0][0]  # fc(x) + 1
    size = len(payload) if payload else 1

    def call(op, args, kwargs=None, val=None):
        with graph.inserting_before(result):
            node = graph.call_function(op, args, kwargs or {})
        with fake:
            node.meta["val"] = (
                val
                if val is not None
                else op(
                    *[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args],
                    **(kwargs or {}),
                )
            )
        return node

    with fake:
        mapped_val = torch.empty(size, dtype=torch.uint8)
    mapped = call(
        aten.from_file.default, (str(target),),
        {"shared": payload is not None, "size": size, "dtype": torch.uint8}, mapped_val,
    )  # fmt: skip
    if payload is not None:
        data = call(aten.full.default, ([size], payload[0]), {"dtype": torch.uint8})
        mapped = call(aten.copy_.default, (mapped, data))
    total = call(aten.sum.default, (mapped,))
    scaled = call(aten.mul.Tensor, (total, 0 if payload is not None else 1))
    one = call(aten.add.Tensor, (scaled, 1))
    result.args = (result.args[0], one)  # fc(x) + (0 * sum(written) + 1), or + sum(read) + 1
    program.graph_module.recompile()
    torch.export.save(program, str(path))
    return path


def rewrite(source: Path, target: Path, change: Callable[[str, bytes], bytes | None]) -> Path:
    """``source`` with each member's data replaced by ``change(name, data)`` (names without
    the archive's root folder; None drops the member), each stored as it was."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            data = change(info.filename.split("/", 1)[1], src.read(info))
            if data is not None:
                dst.writestr(info, data, compress_type=info.compress_type)
    return target


def edit_json(member: str, edit: Callable[[dict], None]) -> Callable[[str, bytes], bytes]:
    """A ``rewrite`` change that edits the JSON member ``member`` in place."""

    def change(name: str, data: bytes) -> bytes:
        if name == member:
            value = json.loads(data)
            edit(value)
            return json.dumps(value).encode()
        return data

    return change
