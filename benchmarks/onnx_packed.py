"""The outside model ``gru_packed`` (benchmarks/outside_models.py) exported to ONNX and run in
ONNX Runtime: SQNR against float of the QDQ and ONNX Runtime targets beside quantree's
reference graph and CPU backend, and CPU time per call, one thread, interleaved in one
process. Before this branch, both exports were refused (packed sequence)."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

import torch
from outside_models import Packed

import quantree as qt
from quantree.backends import CPU
from quantree.backends.onnx import onnx_session


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)

    def sample():
        lengths = torch.randint(1, 31, (args.batch,), generator=g).sort(descending=True).values
        lengths[0] = 30
        return torch.randn(args.batch, 30, 32, generator=g), lengths

    model = Packed().eval()
    calib = [sample() for _ in range(8)]
    held = [sample() for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = qt.quantize(model, calib[0], calib, backend="reference", progress=False)
        cpu = qt.lower(ref, CPU)
        folder = tempfile.mkdtemp()
        paths = {
            t.value: qt.export_onnx(
                ref, calib[0], os.path.join(folder, f"{t.value}.onnx"), target=t
            )
            for t in qt.OnnxTarget
        }
    sessions = {k: onnx_session(p, threads=1) for k, p in paths.items()}

    def runner(session):
        names = [i.name for i in session.get_inputs()]
        return lambda x, lengths: torch.from_numpy(
            session.run(None, {names[0]: x.numpy(), names[1]: lengths.numpy()})[0]
        )

    runs = {"float eager": model, "reference": ref, "quantree CPU": cpu}
    runs |= {f"ORT {k}": runner(s) for k, s in sessions.items()}
    with torch.no_grad():
        want = torch.cat([model(*b).flatten() for b in held])
        for name, fn in runs.items():
            got = torch.cat([fn(*b).flatten() for b in held])
            print(f"{name}: {float(qt.sqnr(want, got)):.1f} dB")
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():  # interleaved
                start = time.process_time()
                for b in held:
                    fn(*b)
                times[name].append((time.process_time() - start) / len(held))
    base = statistics.median(times["float eager"])
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name}: {med * 1e3:.2f} ms CPU ({med / base:.2f}x float eager)")
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
