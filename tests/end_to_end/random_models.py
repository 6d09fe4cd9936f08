"""Random nested models for the property tests (run as a worker process by
``test_random_models.py``, so a native crash is a failure that names its example).

``python random_models.py EXAMPLES SEED`` runs a hypothesis property over EXAMPLES random
models; each example is printed (one JSON line) before it runs.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._pytree import tree_flatten

import quantree as qt
from quantree.backends import CPU
from quantree.core.fold import FOLD_TOLERANCE

CELLS_TOLERANCE = 1e-5  # relative to max(1, max|float|): the cell decomposition sums differently
LOWERED_DB = 20.0  # every float output leaf of the CPU-lowered model against the reference
KINDS = ["LSTM", "GRU", "RNN_TANH", "RNN_RELU"]
OPS = ["split", "chunk", "unbind", "max_dim", "max_pool", "cat", "stack", "linear"]


@st.composite
def recipes(draw: Any) -> dict[str, Any]:
    kind = draw(st.sampled_from(KINDS))
    return {
        "seed": draw(st.integers(0, 2**16)),
        "kind": kind,
        "layers": draw(st.integers(1, 2)),
        "bidirectional": draw(st.booleans()),
        "batch_first": draw(st.booleans()),
        "bias": draw(st.booleans()),
        "proj": draw(st.booleans()) and kind == "LSTM",
        "initial_state": draw(st.booleans()),
        "conv": draw(st.booleans()),
        "batch_norm": draw(st.booleans()),
        "ops": draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=3)),
        "container": draw(st.sampled_from(["tuple", "list", "dict"])),
        "observer": draw(st.sampled_from([k.value for k in qt.ObserverKind])),
        "cells": draw(st.booleans()),
    }


class RandomModel(nn.Module):
    """conv1d (+ batch norm) -> recurrent layer -> a chain of splitting/joining ops."""

    def __init__(self, r: dict[str, Any]) -> None:
        super().__init__()
        torch.manual_seed(r["seed"])
        self.r = r
        features, hidden = 6, 8
        if r["conv"]:
            self.conv = nn.Conv1d(features, features, 3, padding=1, bias=r["bias"])
            self.bn = nn.BatchNorm1d(features) if r["batch_norm"] else None
            if self.bn is not None:
                with torch.no_grad():
                    self.bn.running_mean.normal_(0, 2)
                    self.bn.running_var.uniform_(0.1, 4)
                    self.bn.weight.normal_(0, 1.5)
                    self.bn.bias.normal_()
        kind = r["kind"]
        common = dict(
            num_layers=r["layers"],
            bidirectional=r["bidirectional"],
            batch_first=r["batch_first"],
            bias=r["bias"],
        )
        if kind == "LSTM":
            proj = 4 if r["proj"] else 0
            self.rnn: nn.Module = nn.LSTM(features, hidden, proj_size=proj, **common)
        elif kind == "GRU":
            self.rnn = nn.GRU(features, hidden, **common)
        else:
            self.rnn = nn.RNN(features, hidden, nonlinearity=kind[4:].lower(), **common)
        width = (4 if r["proj"] else hidden) * (2 if r["bidirectional"] else 1)
        self.head = nn.Linear(width, 5)
        self.pool = nn.MaxPool1d(2, return_indices=True)

    def forward(self, x: torch.Tensor, *state: torch.Tensor):
        r = self.r
        if r["conv"]:  # x is (batch, time, features)
            y = self.conv(x.transpose(1, 2))
            if self.bn is not None:
                y = self.bn(y)
            x = torch.relu(y).transpose(1, 2)
        if not r["batch_first"]:
            x = x.transpose(0, 1)
        hx = None if not state else (state if len(state) == 2 else state[0])
        out, final = self.rnn(x, hx)
        if not r["batch_first"]:
            out = out.transpose(0, 1)  # (batch, time, width)
        leaves: list[torch.Tensor] = []
        for op in r["ops"]:
            if op == "split":
                leaves += list(torch.split(out, [1, out.shape[1] - 1], dim=1))
            elif op == "chunk":
                leaves += list(out.chunk(2, dim=-1))
            elif op == "unbind":
                leaves += list(out.unbind(1))[:2]
            elif op == "max_dim":
                values, indices = out.max(dim=1)
                leaves += [values, indices]
            elif op == "max_pool":
                pooled, indices = self.pool(out.transpose(1, 2))
                leaves += [pooled, indices]
            elif op == "cat":
                leaves.append(torch.cat([out, out * 0.5], dim=-1))
            elif op == "stack":
                leaves.append(torch.stack([out[:, 0], out[:, -1]]))
            else:
                leaves.append(self.head(out))
        states = list(final) if isinstance(final, tuple) else [final]
        if r["container"] == "tuple":
            return tuple(leaves), tuple(states)
        if r["container"] == "list":
            return [*leaves, states]
        return {"leaves": leaves, "state": states}


def inputs(r: dict[str, Any], model: RandomModel, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    batch, time = 2, 5
    x = torch.randn(batch, time, 6, generator=g)
    if not r["initial_state"]:
        return (x,)
    d = (2 if r["bidirectional"] else 1) * r["layers"]
    h = torch.randn(d, batch, 4 if r["proj"] else 8, generator=g) * 0.5
    if r["kind"] == "LSTM":
        return (x, h, torch.randn(d, batch, 8, generator=g) * 0.5)
    return (x, h)


def _floats(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def check(r: dict[str, Any]) -> dict[str, float]:
    """The properties of one random model; returns its measurements."""
    model = RandomModel(r).eval()
    g = torch.Generator().manual_seed(r["seed"])
    data = [inputs(r, model, g) for _ in range(4)]
    quantizer = qt.Int8Quantizer(
        activation_observer=qt.ObserverKind(r["observer"]),
        recurrent=qt.RecurrentMode.CELLS if r["cells"] else qt.RecurrentMode.WHOLE,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qt.prepare(qt.capture(model, data[0]), quantizer)
        qt.calibrate(prepared, data, progress=False)
        ref = qt.convert(prepared)
        lowered = qt.lower(ref, CPU)
    worst_db = float("inf")
    with torch.no_grad():
        for args in data[:2]:
            want, got = model(*args), prepared(*args)
            assert tree_flatten(want)[1] == tree_flatten(got)[1], "structure differs"
            for w, p in zip(_floats(want), _floats(got), strict=True):
                if not w.is_floating_point():
                    assert torch.equal(w, p) or r["cells"] or r["batch_norm"]
                    continue
                diff = float((w - p).abs().max()) if w.numel() else 0.0
                scale = float(w.abs().max()) if w.numel() else 0.0
                if r["cells"]:
                    assert diff <= CELLS_TOLERANCE * max(1.0, scale), ("cells", diff, scale)
                elif r["conv"] and r["batch_norm"]:
                    assert diff <= FOLD_TOLERANCE * max(scale, 1e-30), ("fold", diff, scale)
                else:
                    assert diff == 0.0, ("prepared != float", diff)
            refs, lows = _floats(ref(*args)), _floats(lowered(*args))
            assert len(refs) == len(lows)
            for a, b in zip(refs, lows, strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype
                if a.is_floating_point() and a.numel() and float(a.abs().max()) > 0:
                    worst_db = min(worst_db, qt.sqnr(a, b))
    assert worst_db >= LOWERED_DB, ("lowered vs reference", worst_db)
    return {"lowered_db": worst_db}


def run(examples: int, seed: int) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(recipes())
    def property_holds(r: dict[str, Any]) -> None:
        print(json.dumps(r), flush=True)
        result = check(r)
        print("ok", json.dumps(result), flush=True)

    from hypothesis import seed as hseed

    hseed(seed)(property_holds)()


if __name__ == "__main__":
    run(int(sys.argv[1]), int(sys.argv[2]))
