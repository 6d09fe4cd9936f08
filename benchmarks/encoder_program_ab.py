"""A small BERT encoder with its attention inside the layer's program, or as calls between.

    python benchmarks/encoder_program_ab.py --runs 40

``passes/attention.program_form`` lets a region program run float attention as an
instruction, so a BERT layer whose layer norms and gelus a program takes is one call. On
CPUs without AVX-512 programs take layer norms and gelus only up to
``regions.FLOAT_MAX_ELEMENTS`` values, so the zoo's BERT (128 x 512 gelus) keeps them as ATen
calls there; this model is small enough (hidden 32, 16 tokens) to show the cut on any path.
One reference graph, lowered both ways, timed interleaved with float in one process.
"""

from __future__ import annotations

import argparse
import collections
import warnings

import torch
import zoo
from common import interleaved_times, load_note, one_thread

import quantree as qt
import quantree.backends.cpu.passes.regions as regions
from quantree.backends import CPU


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    one_thread()
    warnings.simplefilter("ignore")
    zoo.import_model_libraries()
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        hidden_size=args.hidden, num_hidden_layers=2, num_attention_heads=2, vocab_size=100,
        intermediate_size=2 * args.hidden, attn_implementation="eager",
    )  # fmt: skip
    model = zoo.First(BertModel(cfg)).eval()
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 100, (1, args.tokens), generator=gen),) for _ in range(8)]
    ref = qt.quantize(model, data[0], data[:6], backend="reference", progress=False)
    inside = qt.lower(ref, CPU)
    form = regions.program_form
    regions.program_form = lambda *a, **k: None  # type: ignore[assignment]
    try:
        between = qt.lower(ref, CPU)
    finally:
        regions.program_form = form  # type: ignore[assignment]
    want = model(*data[7])
    for name, low in (("attention calls between programs", between), ("inside", inside)):
        ops = collections.Counter(
            str(n.target).replace(".default", "").split(".")[-1]
            for n in low.graph.nodes
            if n.op == "call_function"
        )
        got = low(*data[7])
        db = 10 * torch.log10(want.pow(2).mean() / (want - got).pow(2).mean())
        print(f"{name}: {sum(ops.values())} calls {dict(ops.most_common(5))}, {db:.1f} dB")
    calls = {
        "float": lambda: model(*data[7]),
        "between": lambda: between(*data[7]),
        "inside": lambda: inside(*data[7]),
    }
    times = interleaved_times(calls, args.runs, warmup=3)
    fw, fc = times["float"]
    parts = [
        f"{k} {w / fw:.3f}x wall, {c / fc:.3f}x CPU" for k, (w, c) in times.items() if k != "float"
    ]
    print(f"float {fw:.3f} ms wall, {fc:.3f} ms CPU; " + "; ".join(parts))
    print(load_note(), f"torch {torch.__version__}, one thread")


if __name__ == "__main__":
    main()
