"""Alternatives to ``DynamicQuantizeLSTM`` inside ONNX Runtime's own ops, measured (issue 25).

    python benchmarks/onnx_lstm_alternatives.py INPUT,HIDDEN,LAYERS,T,BATCH[,BIDIRECTIONAL] \
        [RUNS] [VARIANTS]

e.g. ``256,256,2,128,1 20`` or ``256,256,1,128,1,1 20 cur,nooutq,fp32`` (ORT dynamic is always
timed: every ratio is to it). One thread, rounds interleaved, medians of process CPU time,
two passes; SQNR against the float model. Variants built from quantree's ORT-target export
(same int8 weights):
  cur     : quantree ORT target as exported (DynamicQuantizeLSTM)
  dyn     : ORT's quantize_dynamic of the float export
  fp32    : ORT float
  nooutq  : cur without the static output QuantizeLinear/DequantizeLinear (float out)
  scan    : hoisted input projection (one DynamicQuantizeMatMul over all steps) + Scan whose
            step multiplies h by int8 R^T (DynamicQuantizeMatMul) and applies the gates
  scanst  : the same, the step's h quantized on a static grid (QuantizeLinear, scale from
            calibration) + MatMulIntegerToFloat (no per-step min/max)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic
from torch import nn

import quantree as qt

warnings.simplefilter("ignore")
MS = "com.microsoft"


class Output(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)[0]


def inits(g):
    return {i.name: numpy_helper.to_array(i) for i in g.initializer}


def add_init(g, name, arr):
    g.initializer.append(numpy_helper.from_array(arr, name))
    return name


def drop_output_qdq(model):
    g = model.graph
    out = g.output[0].name
    nodes = list(g.node)
    dq = next(n for n in nodes if out in n.output)
    if dq.op_type != "DequantizeLinear":
        return model
    q = next(n for n in nodes if dq.input[0] in n.output)
    src = q.input[0]
    keep = [n for n in nodes if n is not q and n is not dq]
    for n in keep:
        for k, o in enumerate(n.output):
            if o == src:
                n.output[k] = out
    del g.node[:]
    g.node.extend(keep)
    return model


def lstm_scan(model, static_h: dict | None = None):
    """Replace each unidirectional DynamicQuantizeLSTM with DQMatMul + Scan."""
    g = model.graph
    vals = inits(g)
    new = []
    for n in g.node:
        if n.op_type != "DynamicQuantizeLSTM":
            new.append(n)
            continue
        p = n.name
        x, w, r, b = n.input[0], n.input[1], n.input[2], n.input[3]
        ws, rs = n.input[8], n.input[10]
        H = vals[r].shape[1]
        W = vals[w][0]  # [I, 4H]
        R = vals[r][0]  # [H, 4H]
        B = vals[b][0] if b else np.zeros(8 * H, np.float32)
        bias = (B[: 4 * H] + B[4 * H :]).astype(np.float32)
        wt = add_init(g, f"{p}_Wt", np.ascontiguousarray(W))
        rt = add_init(g, f"{p}_Rt", np.ascontiguousarray(R))
        wsc = add_init(g, f"{p}_ws", vals[ws][:1].astype(np.float32))
        wzp = add_init(g, f"{p}_wz", np.zeros(1, np.int8))
        rsc = add_init(g, f"{p}_rs", vals[rs][:1].astype(np.float32))
        rzp = add_init(g, f"{p}_rz", np.zeros(1, np.int8))
        bb = add_init(g, f"{p}_b", bias)
        xp = f"{p}_xp"
        new.append(
            helper.make_node("DynamicQuantizeMatMul", [x, wt, wsc, wzp, bb], [xp], domain=MS)
        )
        # initial states: zeros [B, H] from the input's batch
        shp = f"{p}_shape"
        new.append(helper.make_node("Shape", [x], [shp], start=1, end=2))
        hsz = add_init(g, f"{p}_H", np.array([H], np.int64))
        full = f"{p}_bh"
        new.append(helper.make_node("Concat", [shp, hsz], [full], axis=0))
        zero = f"{p}_zero"
        new.append(
            helper.make_node(
                "ConstantOfShape",
                [full],
                [zero],
                value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0]),
            )
        )
        body = _body(p, H, rt, rsc, rzp, static_h, g)
        hT, cT, y = f"{p}_hT", f"{p}_cT", f"{p}_y"
        new.append(
            helper.make_node("Scan", [zero, zero, xp], [hT, cT, y], body=body, num_scan_inputs=1)
        )
        ax = add_init(g, f"{p}_ax1", np.array([1], np.int64))
        new.append(helper.make_node("Unsqueeze", [y, ax], [n.output[0]]))
    del g.node[:]
    g.node.extend(new)
    return model


def _body(p, H, rt, rsc, rzp, static_h, g):
    h, c, xt = f"{p}_h", f"{p}_c", f"{p}_xt"
    nodes = []
    if static_h is None:
        nodes.append(
            helper.make_node("DynamicQuantizeMatMul", [h, rt, rsc, rzp], [f"{p}_rp"], domain=MS)
        )
    else:
        scale = static_h["scale"]
        hs = add_init(g, f"{p}_hs", np.array(scale, np.float32))
        hz = add_init(g, f"{p}_hz", np.array(128, np.uint8))
        nodes.append(helper.make_node("QuantizeLinear", [h, hs, hz], [f"{p}_hq"]))
        nodes.append(
            helper.make_node(
                "MatMulIntegerToFloat", [f"{p}_hq", rt, hs, rsc, hz, rzp], [f"{p}_rp"], domain=MS
            )
        )
    sizes = helper.make_tensor(f"{p}_s", TensorProto.INT64, [2], [3 * H, H])
    thirds = helper.make_tensor(f"{p}_s3", TensorProto.INT64, [3], [H, H, H])
    nodes += [
        helper.make_node("Add", [xt, f"{p}_rp"], [f"{p}_pre"]),
        helper.make_node("Constant", [], [f"{p}_sz"], value=sizes),
        helper.make_node("Constant", [], [f"{p}_sz3"], value=thirds),
        helper.make_node("Split", [f"{p}_pre", f"{p}_sz"], [f"{p}_iof", f"{p}_gp"], axis=1),
        helper.make_node("Sigmoid", [f"{p}_iof"], [f"{p}_iofs"]),
        helper.make_node("Tanh", [f"{p}_gp"], [f"{p}_g"]),
        helper.make_node(
            "Split", [f"{p}_iofs", f"{p}_sz3"], [f"{p}_i", f"{p}_o", f"{p}_f"], axis=1
        ),
        helper.make_node("Mul", [f"{p}_f", c], [f"{p}_fc"]),
        helper.make_node("Mul", [f"{p}_i", f"{p}_g"], [f"{p}_ig"]),
        helper.make_node("Add", [f"{p}_fc", f"{p}_ig"], [f"{p}_cn"]),
        helper.make_node("Tanh", [f"{p}_cn"], [f"{p}_tc"]),
        helper.make_node("Mul", [f"{p}_o", f"{p}_tc"], [f"{p}_hn"]),
        helper.make_node("Identity", [f"{p}_hn"], [f"{p}_yt"]),
    ]
    vi = lambda n, w: helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, w])  # noqa: E731
    return helper.make_graph(
        nodes,
        f"{p}_step",
        [vi(h, H), vi(c, H), vi(xt, 4 * H)],
        [vi(f"{p}_hn", H), vi(f"{p}_cn", H), vi(f"{p}_yt", H)],
    )


def session(model_or_path):
    o = ort.SessionOptions()
    o.intra_op_num_threads = o.inter_op_num_threads = 1
    src = (
        model_or_path.SerializeToString()
        if isinstance(model_or_path, onnx.ModelProto)
        else str(model_or_path)
    )
    return ort.InferenceSession(src, o, providers=["CPUExecutionProvider"])


def times(calls, runs):
    names = list(calls)
    for fn in calls.values():
        for _ in range(3):
            fn()
    cpu = {n: [] for n in names}
    for k in range(runs):
        s = k % len(names)
        for n in names[s:] + names[:s]:
            t = time.process_time()
            calls[n]()
            cpu[n].append((time.process_time() - t) * 1e3)
    return {n: statistics.median(v) for n, v in cpu.items()}


def main():
    torch.set_num_threads(1)
    ort.set_default_logger_severity(3)
    n_in, H, L, T, Bt, *bi = (int(v) for v in sys.argv[1].split(","))
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    torch.manual_seed(0)
    model = Output(nn.LSTM(n_in, H, L, bidirectional=bool(bi and bi[0]))).eval()
    x = torch.randn(T, Bt, n_in)
    calib = [(torch.randn(T, Bt, n_in),) for _ in range(4)]
    ref = qt.quantize(model, (x,), calib, progress=False)
    tmp = Path(tempfile.mkdtemp())
    torch.onnx.export(model, (x,), str(tmp / "f.onnx"), input_names=["x"], dynamo=False)
    quantize_dynamic(str(tmp / "f.onnx"), str(tmp / "d.onnx"), weight_type=QuantType.QInt8)
    qt.export_onnx(ref, (x,), tmp / "q.onnx", target=qt.OnnxTarget.ONNXRUNTIME)
    models = {
        "fp32": tmp / "f.onnx",
        "dyn": tmp / "d.onnx",
        "cur": tmp / "q.onnx",
        "nooutq": drop_output_qdq(onnx.load(tmp / "q.onnx")),
    }
    # static h grid: max |h| is at most 1 (o * tanh(c)); uint8 around 128
    if not (bi and bi[0]) and (not only or "scan" in only):
        models["scan"] = lstm_scan(onnx.load(tmp / "q.onnx"))
        models["scanst"] = lstm_scan(onnx.load(tmp / "q.onnx"), static_h={"scale": 1.0 / 127})
    if only:
        models = {k: v for k, v in models.items() if k in only or k in ("dyn",)}
    with torch.no_grad():
        want = model(x)
        print(f"ref SQNR {qt.sqnr(want, ref(x)):.2f}")
    calls = {}
    for k, m in models.items():
        try:
            s = session(m)
        except Exception as e:
            print(k, "fails", str(e)[:300])
            continue
        feed = {s.get_inputs()[0].name: x.numpy()}
        calls[k] = lambda s=s, f=feed: s.run(None, f)
        got = torch.from_numpy(calls[k]()[0]).reshape(want.shape)
        print(f"{k}: SQNR {qt.sqnr(want, got):.2f}")
    for p in range(2):
        t = times(calls, runs)
        print(
            f"pass {p + 1}: "
            + ", ".join(f"{k} {v:.3f} ms ({v / t['dyn']:.3f}x dyn)" for k, v in t.items())
        )


if __name__ == "__main__":
    main()
