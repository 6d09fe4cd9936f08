"""A saved program may call only quantree's dialect (``quantree.tools.vocabulary``).

The crafted programs are real ``torch.export.save`` archives whose graph maps a file with
``aten.from_file`` and writes into it with ``aten.copy_`` (or returns its bytes): plain
``torch.export.load(...).module()`` writes the file at the first call. Every quantree entry
point refuses them at load, in one line naming the node and the op, and writes nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from crafted_programs import example, with_file_ops

from quantree.tools.cli import EXIT_BAD_INPUT, main
from quantree.tools.files import BadFile
from quantree.tools.vocabulary import graph_errors, op_error

aten = torch.ops.aten


def test_plain_torch_really_writes_the_file(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"safe")
    torch.export.load(str(with_file_ops(tmp_path / "w.pt2", victim, b"EEEE"))).module()(*example())
    assert victim.read_bytes() == b"EEEE"


def test_a_program_writing_a_file_is_refused_everywhere(tmp_path: Path, capsys) -> None:
    from quantree.backends import load

    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"safe")
    path = with_file_ops(tmp_path / "w.pt2", victim, b"EEEE")
    with pytest.raises(BadFile, match=r"node from_file\w* calls torch.ops.aten.from_file") as e:
        load(path)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)
    data = tmp_path / "data.pt"
    torch.save([example() for _ in range(2)], data)
    out = tmp_path / "out.pt2"
    quantize = ["quantize", str(path), "--calibration", str(data), "-o", str(out), "--quiet"]
    for argv in (["inspect", str(path)], quantize):
        assert main(argv) == EXIT_BAD_INPUT
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "aten.from_file" in err, err
    assert victim.read_bytes() == b"safe" and not out.exists()


def test_a_program_reading_a_file_is_refused(tmp_path: Path) -> None:
    from quantree.backends import load

    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"s")
    with pytest.raises(BadFile, match=r"aten\.from_file"):
        load(with_file_ops(tmp_path / "r.pt2", secret, None))


def test_ops_outside_the_dialect_say_why() -> None:
    assert op_error(aten.add.Tensor) is None
    assert op_error(torch.ops.quantree.linear.default) is None
    assert op_error(aten.lstm.input) is None  # random only with train=True (per node)
    assert "storage" in str(op_error(aten.from_file.default))
    assert "random" in str(op_error(aten.rand.default))
    assert "mutation" in str(op_error(aten.copy_.default)) or op_error(aten.copy_.default) is None
    assert "namespace" in str(op_error(torch.ops.c10d_functional.all_reduce.default))
    assert "dialect" in str(op_error(print))


def test_in_place_ops_only_write_what_the_graph_made() -> None:
    """``relu_`` on a fresh sum is an ordinary step; into an input or a buffer it writes
    outside the graph (the caller's tensor, the model's state)."""

    class InPlace(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = (x + 1).relu_()
            return y + self.b

    gm = torch.export.export(InPlace(), (torch.ones(3),)).graph_module
    assert list(graph_errors(gm)) == []
    graph = gm.graph
    x = next(n for n in graph.nodes if n.op == "placeholder" and n.name == "x")
    relu = next(n for n in graph.nodes if n.target == aten.relu_.default)
    relu.args = (x,)
    (error,) = graph_errors(gm)
    assert "writes in place into x" in error


def test_recurrent_layers_must_be_deterministic() -> None:
    lstm = torch.nn.LSTM(3, 4, dropout=0.0)
    gm = torch.export.export(lstm.eval(), (torch.ones(2, 1, 3),)).graph_module
    assert list(graph_errors(gm)) == []
    node = next(n for n in gm.graph.nodes if n.target == aten.lstm.input)
    args = list(node.args)
    args[6] = True  # train
    node.args = tuple(args)
    (error,) = graph_errors(gm)
    assert "train=True: random" in error
