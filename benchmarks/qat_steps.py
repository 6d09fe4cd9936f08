"""How far the lowered char-LM is from the QAT model it came from, in steps of the output grid.

    nice python benchmarks/qat_steps.py                      # LSTM and GRU, w8a8 and w4a8
    python benchmarks/qat_steps.py --seconds 5 --batches 2   # a smoke run

For each model and weight width: a short QAT run (``--seconds`` of wall time, Adam 1e-4 /
1e-5, from ``--calibration-batches`` batches), then convert and lower to the CPU backend
(``hidden_bits`` 8, the default, and 16). On ``--batches`` validation batches of 32 x 128
characters it prints, in steps of the logits' grid: the reference graph against the QAT
model (0 when the fake quantization is the reference arithmetic), the lowered model against
the QAT model (the share of logits 0, 1 and 2+ steps off, and the largest), and where the
lowered model's steps come from: its last recurrent layer's int8 output against the
reference graph's (in steps of that grid), and its linear head run on the reference graph's
int8 hidden states (so the head's own rounding, alone).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.fx as fx
import torch.nn.functional as F

import quantree as qt
from quantree.backends import cpu_backend
from quantree.core.qdq import is_quantize
from quantree.workloads import batches, load_charlm, load_corpus

BATCH, SEQ = 32, 128


def recorded(gm: fx.GraphModule, x: torch.Tensor, names: set[str]) -> dict[str, object]:
    """The values of the nodes named ``names`` in a run of ``gm`` on ``x``."""
    seen: dict[str, object] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            out = super().run_node(n)
            if n.name in names:
                seen[n.name] = out
            return out

    with torch.no_grad():
        Recorder(gm).run(x)
    return seen


def steps_of(diff: torch.Tensor) -> list[float]:
    """Shares of elements 0, 1 and 2+ steps off, and the largest, for a difference in steps."""
    d = diff.abs().round()
    return [float((d == 0).float().mean()), float((d == 1).float().mean()),
            float((d >= 2).float().mean()), float(diff.abs().max())]  # fmt: skip


def one(kind: str, weights: int, args, train_stream, validation) -> None:
    torch.manual_seed(0)
    model = load_charlm(kind)  # type: ignore[arg-type]
    calibration = [
        (w[:, :-1].clone(),)
        for (w,) in batches(train_stream, BATCH, SEQ + 1, args.calibration_batches, seed=0)
    ]
    quantizer = qt.Int8Quantizer() if weights == 8 else qt.W4A8Quantizer()
    qat = qt.prepare_qat(qt.capture(model, calibration[0]), quantizer, calibration)
    named = [(n, p) for n, p in qat.named_parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(
        [
            {"params": [p for n, p in named if not n.endswith(".scale")], "lr": 1e-4},
            {"params": [p for n, p in named if n.endswith(".scale")], "lr": 1e-5},
        ]
    )
    train = batches(train_stream, BATCH, SEQ + 1, 1000, seed=2)
    start, cpu0, steps = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - start < args.seconds:
        (w,) = train[steps % len(train)]
        logits = qat(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    qat.eval()
    ref = qt.convert(qat)
    lowered = {h: qt.lower(ref, cpu_backend(hidden_bits=h)) for h in (8, 16)}
    out = next(n for n in ref.graph.nodes if n.op == "output").args[0][0]
    step = float(out.args[1])
    # the last recurrent layer's output quantize in the reference, and the head reading it
    head_q = out.args[0].args[0].args[0]  # dq(q(linear(dq(q(h)), ...)))
    h_q = head_q.args[0]
    assert is_quantize(h_q), h_q.format_node()
    h_scale, h_zp = float(h_q.args[1]), int(h_q.args[2])
    rows: dict[str, list[list[float]]] = {"ref-qat": []}
    for (w,) in batches(validation, BATCH, SEQ, args.batches, seed=5):
        with torch.no_grad():
            expected = qat(w)
            got = recorded(ref, w, {h_q.name, out.name})
            rows["ref-qat"].append(steps_of((got[out.name] - expected) / step))
            h_ref = got[h_q.name]  # int8
            for bits, low in lowered.items():
                rows.setdefault(f"lowered h{bits} - qat", []).append(
                    steps_of((low(w) - expected) / step)
                )
                rnn = [n for n in low.graph.nodes if "rnn" in str(n.target)][-1]
                h_node = next(iter(rnn.users))
                h_low = recorded(low, w, {h_node.name})[h_node.name]
                assert isinstance(h_low, torch.Tensor) and h_low.dtype == torch.int8
                rows.setdefault(f"lowered h{bits}: last layer h - ref", []).append(
                    steps_of(h_low.float() - h_ref.float())
                )
                # the head alone: the lowered graph from its last rnn on, fed the ref's h
                head = lowered_head(low, h_node)
                rows.setdefault(f"lowered h{bits}: head on ref h - ref", []).append(
                    steps_of((head(h_ref)[0] - got[out.name]) / step)
                )
    print(f"== {kind} w{weights}a8: {steps} QAT steps, {wall:.0f} s wall / {cpu:.0f} s CPU; "
          f"logit step {step:.4g}, h step {h_scale:.4g} (zp {h_zp})")  # fmt: skip
    for label, values in rows.items():
        t = torch.tensor(values)
        share = t[:, :3].mean(0) * 100
        print(f"    {label:>34}: 0 steps {share[0]:.3f}%, 1 step {share[1]:.3f}%, "
              f"2+ steps {share[2]:.4f}%, max {float(t[:, 3].max()):.2f}")  # fmt: skip


def lowered_head(low: fx.GraphModule, h_node: fx.Node) -> fx.GraphModule:
    """The part of ``low`` after ``h_node``, as a module of that node's value."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {h_node: graph.placeholder("h")}
    after = False
    for node in low.graph.nodes:
        if node is h_node:
            after = True
            continue
        if node.op == "get_attr" or after:
            env[node] = graph.node_copy(node, env.__getitem__)
    return fx.GraphModule(low, graph)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="QAT budget (wall) a model")
    parser.add_argument("--batches", type=int, default=8, help="validation batches measured")
    parser.add_argument("--calibration-batches", type=int, default=10)
    parser.add_argument("--only", choices=("lstm", "gru"), default=None)
    parser.add_argument("--weights", type=int, choices=(8, 4), default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load: {os.getloadavg()}", flush=True)
    validation = load_corpus("validation")
    train_stream = load_corpus("train", max_chars=2_000_000)
    for kind in ("lstm", "gru"):
        for weights in (8, 4):
            if args.only in (None, kind) and args.weights in (None, weights):
                one(kind, weights, args, train_stream, validation)
    print(f"load: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
