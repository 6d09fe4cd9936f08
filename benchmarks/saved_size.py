"""How much a lowered model weighs on disk, by part of the saved archive.

Issue 10's acceptance measures a saved ``.pt2`` (``quantree.backends.save``) against its
float weights at one byte each: the smallest an int8 model can be. The archive is split into
its tensor payloads, the graph description (``models/*.json`` and the payload configs) and
the rest, so a miss says which part to shrink.
"""

from __future__ import annotations

import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from quantree.backends import save


@dataclass
class SavedSize:
    total: int  # the file, bytes
    tensors: int  # data/weights/weight_* and data/constants/tensor_* members
    graph: int  # models/*.json and the payload configs
    int8: int  # the float model's parameters at one byte each

    @property
    def ratio(self) -> float:
        return self.total / self.int8

    def render(self) -> str:
        mb = 1e6
        return (
            f"{self.total / mb:.2f} MB ({self.ratio:.2f}x; tensors {self.tensors / mb:.2f}, "
            f"graph {self.graph / mb:.2f})"
        )


def int8_bytes(model: torch.nn.Module) -> int:
    """The float model's parameters at one byte each (each shared parameter once)."""
    return sum(p.numel() for p in model.parameters())


def archive_parts(path: Path) -> tuple[int, int]:
    """(tensor payload bytes, graph description bytes) of a ``torch.export.save`` archive."""
    tensors = graph = 0
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            name = info.filename.split("/", 1)[-1]
            if name.startswith(("data/weights/weight_", "data/constants/tensor_")):
                tensors += info.compress_size
            elif name.startswith("models/") or name.endswith("_config.json"):
                graph += info.compress_size
    return tensors, graph


def saved_size(model: torch.nn.Module, lowered: torch.nn.Module, args: tuple) -> SavedSize:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "lowered.pt2"
        save(lowered, path, args)
        tensors, graph = archive_parts(path)
        return SavedSize(path.stat().st_size, tensors, graph, int8_bytes(model))
