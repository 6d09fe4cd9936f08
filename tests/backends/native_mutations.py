"""Worker of ``test_native_checks.py``: real lowered models' quantree calls, mutated.

Lowers a few small models (a CNN with grouped, depthwise and 1-d convolutions, pooling,
lookups, softmax and a residual add; a stacked LSTM and a projected one; a GRU in cells
mode; an LSTM cell; a layer-normed LSTM that becomes a region program; an embedding, int8
and int16, and a product of two activations), records every ``torch.ops.quantree`` call one
forward makes (with its arguments), then lets hypothesis mutate one or two of a call's
constants or integers (an element of a code or slot table, a size, a list entry; a tensor
truncated, retyped, made non-contiguous or emptied; a list shortened) and calls the op with
them, or, for an op a lowered graph binds (``bound_calls.py``), calls a binding made on the
recorded call with them, a mutated constant put into the bound tensor itself by ``.data =``
(a change the binding must see after its check). Each example is printed (flushed) before it
runs, then ``ok <outcome>``: a signal kills this process, and the test names the last
example printed.

``python native_mutations.py N SEED``: N examples.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.native.bound_calls import BINDINGS
from quantree.backends.cpu.native.direct import DirectCall
from quantree.core.errors import QuantreeError

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_program import NormedLSTM

EVERY_OP = qt.Int8Quantizer(activations=qt.ActivationPoints.EVERY_OP)


class SmallCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.grouped = nn.Conv2d(8, 16, 3, stride=2, groups=2)
        self.conv1d = nn.Conv1d(16, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 9, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        y = torch.max_pool2d(y, 2)
        y = y + torch.sigmoid(self.depthwise(y))
        y = self.grouped(y).flatten(2)
        y = torch.tanh(self.conv1d(y)).flatten(1)
        return torch.softmax(self.fc(y), -1)


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.fc(self.embedding(ids))
        return torch.matmul(e, e.transpose(-1, -2))


class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(8, 16)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        for t in range(x.shape[0]):
            h, c = self.cell(x[t], (h, c))
        return h


def models() -> list[tuple[str, nn.Module, tuple[torch.Tensor, ...], qt.Int8Quantizer]]:
    torch.manual_seed(0)
    cells = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS)
    return [
        ("cnn", SmallCnn(), (torch.randn(2, 3, 16, 16),), EVERY_OP),
        ("lstm", nn.LSTM(8, 16, 2, bidirectional=True), (torch.randn(5, 2, 8),), EVERY_OP),
        ("lstm_proj", nn.LSTM(8, 16, proj_size=8), (torch.randn(5, 2, 8),), EVERY_OP),
        ("gru_cells", nn.GRU(8, 16), (torch.randn(5, 2, 8),), cells),
        (
            "lstm_cell",
            Cell(),
            (torch.randn(3, 2, 8), torch.randn(2, 16), torch.randn(2, 16)),
            EVERY_OP,
        ),
        ("program", NormedLSTM(), (torch.randn(6, 2, 12),), qt.Int8Quantizer()),
        ("tokens", Tokens(), (torch.randint(0, 20, (2, 5)),), EVERY_OP),
        (  # an int16 table: its own native gather (a transformer's default table)
            "tokens16",
            Tokens(),
            (torch.randint(0, 20, (2, 5)),),
            qt.Int8Quantizer(
                activations=qt.ActivationPoints.EVERY_OP, embedding_dtype=qt.QDtype.INT16
            ),
        ),
    ]


class Recorder(TorchDispatchMode):
    """Every quantree op call (its arguments), run as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func.namespace == "quantree":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def through_dispatcher(gm: torch.fx.GraphModule) -> None:
    """Direct calls back to the ops, so that the recorder sees them."""
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if isinstance(node.target, DirectCall):
                    node.target = node.target.op
            module.recompile()


def recorded_calls() -> list[tuple[str, Any, tuple, dict]]:
    calls = []
    for name, model, args, quantizer in models():
        model.eval()
        data = [tuple(a.clone() for a in args) for _ in range(3)]
        if not name.startswith("tokens"):
            data = [tuple(a + 0.1 * i for a in args) for i in range(3)]
        ref = qt.quantize(
            model, args, data, quantizer=quantizer, progress=False, backend="reference"
        )
        low = qt.lower(ref, CPU)
        through_dispatcher(low)
        recorder = Recorder()
        with torch.no_grad(), recorder:
            low(*args)
        seen = set()
        for func, a, k in recorder.calls:
            if func not in seen:  # one call of each op per model
                seen.add(func)
                calls.append((name, func, a, k))
    return calls


INTS = [0, 1, -1, 2, 3, 4, 7, 8, 16, 63, 64, 255, 256, 1 << 20, 1 << 31, 1 << 40, -(1 << 40)]
FLOATS = [0.0, -1.0, 1e-30, 1e30, math.inf, math.nan]
DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64, torch.float32, torch.float64]


def int_value(data: st.DataObject, old: int) -> int:
    near = [old + 1, old - 1, old * 2, old // 2, old + 16, old - 16, -old]
    return data.draw(st.sampled_from(INTS + near) | st.integers(-(1 << 62), 1 << 62))


def mutate_tensor(data: st.DataObject, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    how = data.draw(st.sampled_from(["element", "element", "element", "truncate", "dtype",
                                     "flatten", "strided", "empty"]))  # fmt: skip
    t = t.clone(memory_format=torch.contiguous_format)
    if how == "element" and t.numel():
        i = data.draw(st.integers(0, t.numel() - 1))
        flat = t.view(-1)
        if t.dtype.is_floating_point:
            flat[i] = data.draw(st.sampled_from(FLOATS) | st.floats(-1e6, 1e6))
        else:
            info = torch.iinfo(t.dtype)
            value = int_value(data, int(flat[i]))
            flat[i] = min(max(value, info.min), info.max)
        return f"element {i}", t
    if how == "truncate" and t.dim() and t.shape[0]:
        n = data.draw(st.integers(0, t.shape[0] - 1))
        return f"first {n} rows", t[:n].clone()
    if how == "dtype":
        dtype = data.draw(st.sampled_from(DTYPES))
        return f"as {dtype}", t.to(dtype)
    if how == "flatten":
        return "flattened", t.reshape(-1)
    if how == "strided" and t.numel() > 1:
        return "every other element", t.reshape(-1)[::2]
    return "empty", t.new_empty((0,))


def mutate(data: st.DataObject, value: Any) -> tuple[str, Any]:
    if isinstance(value, bool):
        return "flipped", not value
    if isinstance(value, int):
        new = int_value(data, value)
        return f"{value} -> {new}", new
    if isinstance(value, float):
        new = data.draw(st.sampled_from(FLOATS))
        return f"{value} -> {new}", new
    if isinstance(value, str):
        new = data.draw(st.sampled_from(["lstm", "gru", "rnn_tanh", "add", "mul", "bogus"]))
        return f"{value!r} -> {new!r}", new
    if isinstance(value, torch.Tensor):
        return mutate_tensor(data, value)
    if isinstance(value, list | tuple) and value:
        how = data.draw(st.sampled_from(["item", "item", "item", "drop", "repeat"]))
        i = data.draw(st.integers(0, len(value) - 1))
        items = list(value)
        if how == "drop":
            del items[i]
            return f"item {i} dropped", items
        if how == "repeat":
            items.append(items[i])
            return f"item {i} repeated", items
        what, items[i] = mutate(data, items[i])
        return f"item {i}: {what}", items
    return "kept", value


def main(examples: int, hypothesis_seed: int) -> None:
    calls = recorded_calls()
    print("ops:", sorted({f"{name}:{func.__name__}" for name, func, _, _ in calls}), flush=True)

    @seed(hypothesis_seed)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.data())
    def example(data: st.DataObject) -> None:
        model, func, args, kwargs = calls[data.draw(st.integers(0, len(calls) - 1))]
        name = func._schema.name.split("::")[1]
        bound = name in BINDINGS and not kwargs and data.draw(st.booleans())
        binding = BINDINGS[name](func) if bound else None
        recorded = tuple(args)
        args = list(args)
        changes, swaps = [], []
        for _ in range(data.draw(st.integers(1, 2))):
            if not args:
                break
            i = data.draw(st.integers(0, len(args) - 1))
            what, args[i] = mutate(data, args[i])
            old = recorded[i]
            if binding is not None and i in binding.positions and isinstance(old, torch.Tensor):
                swaps.append((old, old.data, args[i]))  # the bound tensor itself changes
                args[i], what = old, f"{what}, by .data ="
            changes.append(f"arg {i} ({func._schema.arguments[i].name}): {what}")
        route = "bound" if bound else "op"
        print(json.dumps({"model": model, "op": func.__name__, "route": route,
                          "changes": changes}), flush=True)  # fmt: skip
        try:
            with torch.no_grad():
                if binding is not None:
                    binding(recorded)  # checked and bound on the recorded call
                    for t, _, changed in swaps:
                        t.data = changed
                    binding(tuple(args))
                else:
                    func(*args, **kwargs)
            outcome = "ran"
        except QuantreeError as error:  # a clean error is a pass; a signal is not
            outcome = type(error).__name__
        except Exception as error:  # a raw error: the test names it
            outcome = f"raw {type(error).__name__}: {str(error)[:200]!r}"
        finally:
            for t, original, _ in reversed(swaps):
                t.data = original
        print(f"ok {outcome}", flush=True)

    example()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
