"""LSTM latency: float nn.LSTM against int8 flows, one thread, interleaved, medians.

    python benchmarks/lstm_latency.py [--runs 25]

Columns: float ``nn.LSTM``; PyTorch dynamic int8 (``quantize_dynamic``); PyTorch eager
static int8 (the custom-module flow through ``torch.ao.nn.quantizable.LSTM``); quantree
whole mode lowered to ``quantree.backends.CPU`` (int8 hidden-state feedback, the default)
and to ``cpu_backend(hidden_bits=16)`` (int16 feedback); on stacked rows, the stacked call
kept whole (``Int8Quantizer(split_layers=False)``: inner layers carried at int16, the
default before each layer was observed on its own); quantree cells mode lowered to
CPU, int8 everywhere and the integer-LSTM recipe (``i16``: int16 cell state and gates);
ONNX Runtime dynamic int8 when ``onnxruntime`` is installed.
Ratios are to float ``nn.LSTM`` measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import io
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from common import interleaved_times, load_note, one_thread, table  # benchmarks/ is on the path
from torch import nn

import quantree as qt
from quantree.backends import CPU, cpu_backend

SHAPES = [  # (input, hidden, layers, seq, batch)
    (256, 256, 2, 128, 1),
    (256, 256, 2, 128, 32),
    (512, 512, 1, 64, 1),
]
COLUMNS = [
    "float",
    "torch dynamic",
    "torch eager static",
    "quantree whole",
    "quantree whole h16",
    "quantree whole stacked",
    "quantree cells",
    "quantree cells i16",
    "onnxruntime dynamic",
]


class Wrapped(nn.Module):
    """The output of an LSTM (what every variant computes)."""

    def __init__(self, lstm: nn.Module) -> None:
        super().__init__()
        self.lstm = lstm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


class EagerStatic(nn.Module):
    def __init__(self, lstm: nn.LSTM) -> None:
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.lstm = lstm
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.lstm(self.quant(x))[0])


def eager_static(lstm: nn.LSTM, calib: list[tuple[torch.Tensor]]) -> nn.Module:
    """PyTorch's custom-module flow for a statically quantized LSTM (as in its tests)."""
    import copy

    aq = torch.ao.quantization
    model = EagerStatic(copy.deepcopy(lstm)).eval()
    model.qconfig = aq.get_default_qconfig("x86")
    prepared = aq.prepare(
        model,
        prepare_custom_config_dict={
            "float_to_observed_custom_module_class": {nn.LSTM: torch.ao.nn.quantizable.LSTM}
        },
    )
    with torch.no_grad():
        for (x,) in calib:
            prepared(x)
    return aq.convert(
        prepared,
        convert_custom_config_dict={
            "observed_to_quantized_custom_module_class": {
                torch.ao.nn.quantizable.LSTM: torch.ao.nn.quantized.LSTM
            }
        },
    )


def onnxruntime_dynamic(model: nn.Module, x: torch.Tensor) -> Callable[[], object] | None:
    try:
        import onnxruntime as ort
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError:
        return None
    buf = io.BytesIO()
    folder = Path(tempfile.mkdtemp(prefix="quantree_ort_"))
    src, dst = folder / "lstm.onnx", folder / "lstm_int8.onnx"
    try:
        torch.onnx.export(model, (x,), buf, input_names=["x"], dynamo=False)
        src.write_bytes(buf.getvalue())
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)
    except Exception as error:  # the column is optional: say why it is missing
        print(f"onnxruntime column skipped: {type(error).__name__}: {error}", file=sys.stderr)
        return None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    session = ort.InferenceSession(str(dst), opts, providers=["CPUExecutionProvider"])
    feed = {"x": x.numpy()}
    return lambda: session.run(None, feed)


def variants(shape: tuple[int, int, int, int, int]) -> dict[str, Callable[[], object]]:
    i, h, layers, seq, batch = shape
    torch.manual_seed(0)
    lstm = nn.LSTM(i, h, layers).eval()
    x = torch.randn(seq, batch, i)
    calib = [(torch.randn(seq, batch, i),) for _ in range(4)]
    model = Wrapped(lstm).eval()
    ref = qt.convert(calibrated(model, x, calib, qt.Int8Quantizer()))
    dynamic = torch.ao.quantization.quantize_dynamic(model, {nn.LSTM}, dtype=torch.qint8)
    static = eager_static(lstm, calib)
    whole, whole16 = qt.lower(ref, CPU), qt.lower(ref, cpu_backend(hidden_bits=16))
    out: dict[str, Callable[[], object]] = {
        "float": lambda: model(x),
        "torch dynamic": lambda: dynamic(x),
        "torch eager static": lambda: static(x),
        "quantree whole": lambda: whole(x),
        "quantree whole h16": lambda: whole16(x),
    }
    if layers > 1:  # the stacked call kept whole: inner layers at int16 (the default splits it)
        stacked = qt.convert(calibrated(model, x, calib, qt.Int8Quantizer(split_layers=False)))
        out["quantree whole stacked"] = functools.partial(qt.lower(stacked, CPU), x)
    cells = qt.Int8Quantizer(recurrent=qt.RecurrentMode.CELLS)
    integer = qt.Int8Quantizer(
        recurrent=qt.RecurrentMode.CELLS,
        cell_state_dtype=qt.QDtype.INT16,
        gate_dtype=qt.QDtype.INT16,
    )
    for name, quantizer in (("quantree cells", cells), ("quantree cells i16", integer)):
        lowered = qt.lower(qt.convert(calibrated(model, x, calib, quantizer)), CPU)
        out[name] = functools.partial(lowered, x)
    ort = onnxruntime_dynamic(model, x)
    if ort is not None:
        out["onnxruntime dynamic"] = ort
    return out


def calibrated(model, x, calib, quantizer):
    prepared = qt.prepare(qt.capture(model, (x,)), quantizer)
    qt.calibrate(prepared, calib, progress=False)
    return prepared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=25, help="timed rounds (median of these)")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="also print the thread-CPU-time table of the same rounds (steadier under load)",
    )
    args = parser.parse_args()
    one_thread()
    rows, cpu_rows = [], []
    for shape in SHAPES:
        i, h, layers, seq, batch = shape
        label = f"{i}x{h}, {layers} layer(s), seq {seq}, batch {batch}"
        times = interleaved_times(variants(shape), args.runs)
        rows.append((label, {name: wall for name, (wall, _) in times.items()}))
        cpu_rows.append((label, {name: cpu for name, (_, cpu) in times.items()}))
        print(f"measured {label}", file=sys.stderr)
    columns = [c for c in COLUMNS if any(c in ms for _, ms in rows)]
    print(table("LSTM (1 thread, median ms, ratio to float)", columns, rows))
    if args.cpu_time:
        print()
        print(table("LSTM (1 thread, median thread-CPU ms, ratio to float)", columns, cpu_rows))
    print(f"\n{load_note()}; torch {torch.__version__}; {args.runs} interleaved rounds")


if __name__ == "__main__":
    main()
