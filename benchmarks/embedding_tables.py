"""int8, int16 and float embedding tables: accuracy, saved size and latency, lowered.

For the zoo's BERT and GPT-2, the accuracy script's DistilBERT and ``outside_distilbert``
(outside_models.py's): the default recipe (tables chosen per table), int8 and int16
per-row tables (``Int8Quantizer(embedding_dtype=...)``) and float tables, each quantized
and lowered on the CPU backend; input-dependent SQNR on held-out inputs (zoo's data), the
saved ``.pt2`` (``saved_size``), and thread-CPU/wall milliseconds of one call, float and
the variants interleaved in the same rounds (one thread, medians).

    PYTHONPATH=src python benchmarks/embedding_tables.py [--runs 20] [--models bert,gpt2,...]
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
from accuracy_algorithms import distilbert
from common import interleaved_times, one_thread
from saved_size import saved_size
from zoo import Case, build, input_dependent_sqnr, outputs

import quantree as qt
from quantree.backends import CPU

FLOAT_TABLE = (qt.Rule((torch.ops.aten.embedding,), lambda n: qt.Annotation()),)
"""docs/quantizers.md's rule keeping the tables float (what torchao's X86InductorQuantizer
does: it reads the table float and quantizes only the embedding's output for a linear)."""

VARIANTS = {
    "default (chosen per table)": lambda: qt.Int8Quantizer(),
    "int8 table": lambda: qt.Int8Quantizer(embedding_dtype=qt.QDtype.INT8),
    "int16 table": lambda: qt.Int8Quantizer(embedding_dtype=qt.QDtype.INT16),
    "float table": lambda: qt.Int8Quantizer(rules=FLOAT_TABLE),
}


def case_of(name: str) -> Case:
    if name == "distilbert":
        model, sample = distilbert()
        return Case(model, sample)
    if name == "outside_distilbert":  # outside_models.py's: vocabulary 30522, table-dominated
        import outside_models

        return outside_models.build("distilbert")
    return build(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,gpt2,distilbert")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    one_thread()
    warnings.filterwarnings("ignore")
    print(f"load: {os.getloadavg()}")
    print("| model | table | SQNR | saved size (x int8 weight bytes) | CPU-time ratio to float "
          "| wall ratio |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        torch.manual_seed(0)
        case = case_of(name)
        case.model.eval()
        gen = torch.Generator().manual_seed(1)
        calib = [case.sample(gen) for _ in range(16)]
        held = [case.sample(gen) for _ in range(8)]
        want = outputs(case.model, held)
        x = held[0]
        timed = {"float": lambda f=case.model, x=x: f(*x)}
        rows = {}
        for label, make in VARIANTS.items():
            lowered = qt.quantize(
                case.model, calib[0], calib, quantizer=make(),
                backend=CPU, progress=False,
            )  # fmt: skip
            with torch.no_grad():
                sqnr = input_dependent_sqnr(want, outputs(lowered, held))
            rows[label] = (sqnr, saved_size(case.model, lowered, calib[0]).render())
            timed[label] = lambda q=lowered, x=x: q(*x)
        ms = interleaved_times(timed, args.runs, warmup=3)
        wall_f, cpu_f = ms["float"]
        for label, (sqnr, size) in rows.items():
            wall, cpu = ms[label]
            print(f"| {name} | {label} | {sqnr:.1f} dB | {size} | {cpu / cpu_f:.2f}x "
                  f"({cpu:.2f} / {cpu_f:.2f} ms) | {wall / wall_f:.2f}x |", flush=True)  # fmt: skip
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
