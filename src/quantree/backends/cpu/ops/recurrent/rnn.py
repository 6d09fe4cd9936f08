"""The whole-layer recurrent op: LSTM / GRU / RNN, one native call per layer and direction."""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from quantree.backends.cpu.native import checks as check
from quantree.backends.cpu.native.args import NativeArgs
from quantree.backends.cpu.native.loader import F32, I64, PTR
from quantree.backends.cpu.native.loader import kernels as native_kernels
from quantree.backends.cpu.native.packing import packed_depth
from quantree.backends.cpu.native.registry import contracted, op

SIGNATURES: dict[str, list[type]] = {
    "qt_rnn": [PTR, I64, I64, PTR, PTR, F32, PTR, PTR, PTR, PTR, PTR, PTR],
    "qt_rnn_batch_first": [PTR, I64, I64, PTR, I64, I64, I64, F32, PTR, PTR, PTR, PTR,
                           PTR],
    "qt_rnn_packed": [PTR, I64, I64, PTR, PTR, PTR, F32, PTR, PTR, PTR, PTR, PTR,
                      PTR, PTR],
}  # fmt: skip
"""The C entry points this op calls (``native/csrc``), by their ctypes argument types."""
kernels = native_kernels(SIGNATURES)

RNN_KINDS = {"lstm": 0, "gru": 1, "rnn_tanh": 2, "rnn_relu": 3}
PER_LAYER = 8  # w_ih and w_hh: packed int8, int32 row sums, per-channel scale, float bias
PER_PROJECTION = 3  # w_hr (LSTM proj_size): packed int8, int32 row sums, per-channel scale
QPARAM_NAMES = (
    "x_s", "x_z", "inner_s", "inner_z", "y_s", "y_z", "h_s", "h_z", "c_s", "c_z", "inner_fb",
    "last_s", "last_z", "last_fb", "hn_inv", "hn_z", "cn_inv", "cn_z",
)  # fmt: skip
"""``qparams`` in order, as ``QtRnnPlan`` holds them (the final states' scales inverted)."""


@op(
    "rnn(str kind, Tensor x, Tensor[] hx, Tensor[] params, int hidden, int num_layers, "
    "bool bidirectional, bool batch_first, float[] qparams, int hidden_bits, int proj_size, "
    "bool float_input=False, bool float_output=False, int x_bits=8, int y_bits=8) "
    "-> (Tensor, Tensor, Tensor)"
)
def rnn(
    kind: str,
    x: Tensor,
    hx: list[Tensor],
    params: list[Tensor],
    hidden: int,
    num_layers: int,
    bidirectional: bool,
    batch_first: bool,
    qparams: list[float],
    hidden_bits: int,
    proj_size: int,
    float_input: bool = False,
    float_output: bool = False,
    x_bits: int = 8,
    y_bits: int = 8,
) -> tuple[Tensor, Tensor, Tensor]:
    """A whole int8 LSTM/GRU/RNN: ``(output, h_n, c_n)``, all int8 (``c_n`` empty if no cell).

    ``qparams``: (scale, zero point) of the input, the inner int8 grid (where the hidden
    states of the layers before the last lie), the output, the h state, the c state, the
    int16 step of the inner grid, the last layer's grid and its int16 step, then the grids of
    h_n and c_n. The hidden
    state fed back is requantized on its layer's grid: int8 when ``hidden_bits`` is 8,
    symmetric int16 when 16 (and always for the layers before the last). Outputs passed
    between stacked layers are quantized per call on their own range, as int16.
    ``params``: per layer and direction, ``w_ih, rowsum_ih, scale_ih, b_ih`` and the same for
    ``hh``: packed int8 weights, their int32 row sums, per-channel scales, float biases;
    with ``proj_size``, then ``w_hr, rowsum_hr, scale_hr``. ``hx`` empty: zero initial
    states, which the kernel starts from without a tensor of zeros being made and read.
    ``float_input``: ``x`` is float, quantized on its grid inside the kernel;
    ``float_output``: the output is dequantized there (the graph's quantize and dequantize
    around the op, fused: two op calls fewer per call, the same bits).
    ``x_bits`` / ``y_bits`` 16: that quantize / dequantize is symmetric int16 (zero point
    0; with ``float_input`` / ``float_output`` only): the first layer reads x as two byte
    planes, the last layer's float output is rounded onto the int16 grid. The layers' outputs
    are what quantization cost the most (benchmarks/README.md, branch ``lstmb1``).
    Through the dispatcher each call builds its argument block; a lowered graph calls one
    ``RnnRunner`` per node, which builds it once.
    """
    return RnnRunner()(
        kind, x, hx, params, hidden, num_layers, bidirectional, batch_first, qparams,
        hidden_bits, proj_size, float_input, float_output, x_bits, y_bits,
    )  # fmt: skip


class RnnPlan(ctypes.Structure):
    """``QtRnnPlan`` of ``csrc/rnn.cpp``: everything constant about one lowered op."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("kind", "layers", "dirs", "K", "H", "P", "wide")),
        *((name, ctypes.c_float) for name in QPARAM_NAMES),
        ("params", ctypes.POINTER(ctypes.c_void_p)),
        ("depth", ctypes.POINTER(ctypes.c_int64)),
        ("x16", ctypes.c_int64),
        ("y16", ctypes.c_int64),
    ]


class RnnRunner:
    """``rnn`` with its argument block built once and reused while the op's constant
    arguments stay the same objects.

    A lowered graph holds one runner per node (``direct.py``), so a call converts five
    pointers instead of ~40 arguments per layer and direction, which cost more Python than
    a small layer's native work. The plan keeps the weights' data pointers, nothing
    derived from their values,
    so weights changed in place (``load_state_dict``) are read as they are (their version
    moved: the plan is checked and built again, once); weights replaced by other tensors,
    or by ``.data =``, make a new plan.
    """

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.qparams: list[float] = []
        self.params: list[Tensor] = []
        self.run: Callable[..., None] = kernels().qt_rnn
        self.plan: RnnPlan | None = None
        self.x_inv = 0.0
        self.address = 0
        self.addresses: list[int] = []
        self.versions: list[int] = []
        self.keep: tuple = ()

    def __getstate__(self) -> dict:  # a copied graph builds its own plan from its own weights
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]

    @contracted("rnn")
    def __call__(
        self,
        kind: str,
        x: Tensor,
        hx: list[Tensor],
        params: list[Tensor],
        hidden: int,
        num_layers: int,
        bidirectional: bool,
        batch_first: bool,
        qparams: list[float],
        hidden_bits: int,
        proj_size: int,
        float_input: bool = False,
        float_output: bool = False,
        x_bits: int = 8,
        y_bits: int = 8,
        inner_steps: Sequence[float] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``inner_steps``: see ``packed``."""
        check.rnn_boundaries(x_bits, y_bits, float_input, float_output, qparams)
        key = (kind, hidden, num_layers, bidirectional, hidden_bits, proj_size, x.shape[-1],
               x_bits, y_bits)  # fmt: skip
        self.ensure(key, params, qparams)
        dirs = 2 if bidirectional else 1
        width = proj_size or hidden
        if batch_first and float_input and float_output and reads_rows(x) and inner_steps is None:
            return self.batch_first(kind, x, hx, num_layers, dirs, width, hidden)
        inp = x.transpose(0, 1) if batch_first else x
        inp = (inp.float() if float_input else inp).contiguous()
        lstm = kind == "lstm"
        check.rnn_call(inp, hx, float_input, lstm, num_layers * dirs * batch_size(inp) * width,
                       num_layers * dirs * batch_size(inp) * hidden)  # fmt: skip
        steps, batch = inp.shape[0], inp.shape[1]
        out_dtype = torch.float32 if float_output else torch.int8
        out = torch.empty(steps, batch, dirs * width, dtype=out_dtype)
        h_n = torch.empty(num_layers * dirs, batch, width, dtype=torch.int8)
        c_n = torch.empty(num_layers * dirs, batch, hidden, dtype=torch.int8) if lstm else None
        a = NativeArgs("rnn")  # every address below points into a tensor ``a`` holds
        x8, xf = (None, a.input("x", inp)) if float_input else (a.input("x", inp), None)
        y8, yf = (None, a.output("y", out)) if float_output else (a.output("y", out), None)
        h0 = a.input("h_0", hx[0], torch.int8) if hx else None
        c0 = a.input("c_0", hx[1], torch.int8) if hx and lstm else None
        hn, cn = a.output("h_n", h_n), a.optional_output("c_n", c_n)
        if inner_steps is None:
            self.run(self.address, steps, batch, x8, xf, self.x_inv, h0, c0, y8, yf, hn, cn)
        else:
            pinned = a.input("inner_steps", self.pinned(inner_steps, num_layers))
            kernels().qt_rnn_packed(self.address, steps, batch, None, x8, xf, self.x_inv, h0,
                                    c0, y8, yf, hn, cn, pinned)  # fmt: skip
        out = out.transpose(0, 1).contiguous() if batch_first else out
        return out, h_n, x.new_empty((0,)) if c_n is None else c_n

    def batch_first(
        self,
        kind: str,
        x: Tensor,
        hx: list[Tensor],
        num_layers: int,
        dirs: int,
        width: int,
        hidden: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """A batch-first float input read through its strides and a batch-first float output
        written dense (``qt_rnn_batch_first``): no transposed copy in or out."""
        lstm = kind == "lstm"
        batch, steps = x.shape[0], x.shape[1]
        check.rnn_call(x, hx, True, lstm, num_layers * dirs * batch * width,
                       num_layers * dirs * batch * hidden)  # fmt: skip
        out = torch.empty(batch, steps, dirs * width)
        h_n = torch.empty(num_layers * dirs, batch, width, dtype=torch.int8)
        c_n = torch.empty(num_layers * dirs, batch, hidden, dtype=torch.int8) if lstm else None
        a = NativeArgs("rnn")  # every address below points into a tensor ``a`` holds
        xs = a.strided_input("x", x, torch.float32, 3)
        kernels().qt_rnn_batch_first(
            self.address, steps, batch, xs, x.stride(1), x.stride(0), x.stride(2), self.x_inv,
            a.input("h_0", hx[0], torch.int8) if hx else None,
            a.input("c_0", hx[1], torch.int8) if hx and lstm else None,
            a.output("y", out), a.output("h_n", h_n), a.optional_output("c_n", c_n),
        )  # fmt: skip
        return out, h_n, x.new_empty((0,)) if c_n is None else c_n

    @contracted("rnn_packed_sequence")
    def packed(
        self,
        kind: str,
        x: Tensor,
        batch_sizes: Tensor,
        hx: list[Tensor],
        params: list[Tensor],
        hidden: int,
        num_layers: int,
        bidirectional: bool,
        qparams: list[float],
        hidden_bits: int,
        proj_size: int,
        inner_steps: Sequence[float] | None = None,
        float_input: bool = False,
        float_output: bool = False,
        x_bits: int = 8,
        y_bits: int = 8,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The op on a packed sequence: int8 rows ``x`` [N, K] in packed order, the output
        rows packed the same way, every layer and direction in one native call
        (``qt_rnn_packed``: step t runs on the ``batch_sizes[t]`` sequences still running).

        ``inner_steps`` (one per layer but the last) pins the int16 steps of the outputs
        handed between stacked layers, which otherwise follow the range those outputs took
        over the call's rows: for checks, so that a sequence run alone is computed on the
        grid its batch used.
        """
        check.rnn_boundaries(x_bits, y_bits, float_input, float_output, qparams)
        key = (kind, hidden, num_layers, bidirectional, hidden_bits, proj_size, x.shape[-1],
               x_bits, y_bits)  # fmt: skip
        self.ensure(key, params, qparams)
        if x.dim() != 2:
            raise check.fail("rnn_packed_sequence", f"x has shape {tuple(x.shape)}, the kernel "
                             "reads [N, K] packed rows")  # fmt: skip
        sizes = check.packed_batch_sizes("rnn_packed_sequence", batch_sizes, x.shape[0])
        dirs = 2 if bidirectional else 1
        width = proj_size or hidden
        lstm = kind == "lstm"
        batch = sizes[0]
        inp = (x.float() if float_input else x).contiguous()
        blocks = num_layers * dirs * batch
        check.rnn_call(inp, hx, float_input, lstm, blocks * width, blocks * hidden,
                       "rnn_packed_sequence", packed=True)  # fmt: skip
        out_dtype = torch.float32 if float_output else torch.int8
        out = torch.empty(inp.shape[0], dirs * width, dtype=out_dtype)
        h_n = torch.empty(num_layers * dirs, batch, width, dtype=torch.int8)
        c_n = torch.empty(num_layers * dirs, batch, hidden, dtype=torch.int8) if lstm else None
        steps = torch.tensor(sizes, dtype=torch.int64)
        pinned = None if inner_steps is None else self.pinned(inner_steps, num_layers)
        a = NativeArgs("rnn_packed_sequence")  # every address points into a tensor it holds
        x8, xf = (None, a.input("x", inp)) if float_input else (a.input("x", inp), None)
        y8, yf = (None, a.output("y", out)) if float_output else (a.output("y", out), None)
        kernels().qt_rnn_packed(
            self.address, len(sizes), batch, a.input("batch_sizes", steps), x8, xf, self.x_inv,
            a.input("h_0", hx[0], torch.int8) if hx else None,
            a.input("c_0", hx[1], torch.int8) if hx and lstm else None, y8, yf,
            a.output("h_n", h_n), a.optional_output("c_n", c_n), a.input("inner_steps", pinned),
        )  # fmt: skip
        return out, h_n, x.new_empty((0,)) if c_n is None else c_n

    @staticmethod
    def pinned(inner_steps: Sequence[float], num_layers: int) -> Tensor:
        """The steps as the float32 array the kernel reads, checked: it reads one per
        layer but the last and divides by each."""
        steps = torch.tensor([float(s) for s in inner_steps], dtype=torch.float32)
        if len(steps) != num_layers - 1 or not bool(((steps > 0) & steps.isfinite()).all()):
            raise check.fail(
                "rnn",
                f"inner_steps {list(inner_steps)}: one positive finite step per layer but "
                f"the last ({num_layers - 1}) expected",
            )
        return steps

    def ensure(self, key: tuple, params: list[Tensor], qparams: list[float]) -> None:
        """The plan for these constants: the one built at the first call while they stay
        the same tensors at the same addresses and versions, else a new one."""
        if (
            key != self.key
            or qparams != self.qparams
            or len(params) != len(self.params)
            or not all(map(operator.is_, params, self.params))
            or self.addresses != [p.data_ptr() for p in params]  # .data replaced
            or self.versions != [p._version for p in params]  # in place: resize_, set_
        ):
            self.prepare(key, params, qparams)

    def prepare(self, key: tuple, params: list[Tensor], qparams: list[float]) -> None:
        kind, hidden, num_layers, bidirectional, hidden_bits, proj_size, features, xb, yb = key
        per_layer = PER_LAYER + (PER_PROJECTION if proj_size else 0)
        check.rnn_plan(kind, params, hidden, num_layers, bidirectional, hidden_bits, proj_size,
                       features, qparams, per_layer)  # fmt: skip
        held = NativeArgs("rnn")  # dense copies of strided weights live with the plan
        pointers = held.inputs("params", params)
        depth = (ctypes.c_int64 * max(1, 2 * len(params) // per_layer))(
            *(
                packed_depth(params[i * per_layer + j])
                for i in range(len(params) // per_layer)
                for j in (0, 4)
            )
        )
        values = dict(zip(QPARAM_NAMES, qparams[:18], strict=True))
        # the final states are quantized with 1 / scale computed here, as ``quantize`` does
        values["hn_inv"], values["cn_inv"] = 1.0 / qparams[14], 1.0 / qparams[16]
        plan = RnnPlan(
            kind=RNN_KINDS[kind], layers=num_layers, dirs=2 if bidirectional else 1,
            K=features, H=hidden, P=proj_size, wide=int(hidden_bits == 16),
            params=ctypes.cast(pointers, ctypes.POINTER(ctypes.c_void_p)),
            depth=ctypes.cast(depth, ctypes.POINTER(ctypes.c_int64)), x16=int(xb == 16),
            y16=int(yb == 16), **values,
        )  # fmt: skip
        self.key, self.qparams, self.params, self.plan = key, list(qparams), list(params), plan
        self.run = kernels().qt_rnn
        self.x_inv = 1.0 / qparams[0]  # as ``quantize`` computes it
        self.address = ctypes.addressof(plan)
        self.addresses = [p.data_ptr() for p in params]
        self.versions = [p._version for p in params]
        # aliases of the checked storages: while they live no other tensor can be allocated
        # at a checked address, so an unchanged address is the checked memory
        self.keep = (held, pointers, depth, [p.detach() for p in params])


def reads_rows(x: Tensor) -> bool:
    """Whether ``qt_rnn_batch_first`` reads ``x`` as it is: a float32 [B, T, K], any
    strides (DPRNN's chunks are a permuted channels-first map: K the slowest)."""
    return x.dim() == 3 and x.dtype == torch.float32


def batch_size(x: Tensor) -> int:
    """B of a time-major ``[T, B, K]`` input (0 for a tensor of another rank, which the
    check refuses)."""
    return int(x.shape[1]) if x.dim() == 3 else 0


@torch.library.register_fake("quantree::rnn")
def _(
    kind, x, hx, params, hidden, num_layers, bidirectional, batch_first, qparams, hidden_bits,
    proj_size, float_input=False, float_output=False, x_bits=8, y_bits=8,
):  # fmt: skip
    dirs = 2 if bidirectional else 1
    width = proj_size or hidden
    out_dtype = torch.float32 if float_output else torch.int8
    out = x.new_empty((*x.shape[:2], dirs * width), dtype=out_dtype)
    batch = x.shape[0] if batch_first else x.shape[1]
    h_n = x.new_empty((num_layers * dirs, batch, width), dtype=torch.int8)
    c_n = x.new_empty((num_layers * dirs, batch, hidden), dtype=torch.int8)
    return out, h_n, c_n if kind == "lstm" else x.new_empty((0,))
