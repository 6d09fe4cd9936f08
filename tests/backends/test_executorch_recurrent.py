"""Whole-mode recurrent layers in ExecuTorch: one ``quantree_et::rnn`` op per layer, int8.

The op's ExecuTorch kernel (``backends/executorch/csrc``) calls the CPU backend's compute
core with the CPU backend's constants, so a ``.pte`` whose recurrent output is its graph
output gives exactly the CPU backend's numbers; against the reference (which keeps ``h``
float between steps) it is held to ``SQNR_VS_REFERENCE_DB``. The kernel reads its arguments
from a file: a program that hands it wrong ones fails with ExecuTorch's error.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

pytest.importorskip(
    "executorch.exir", reason="ExecuTorch tests need executorch (see docs/deployment-executorch.md)"
)

import quantree as qt
from quantree.backends.executorch import lower_executorch, rnn_op, run_executorch
from quantree.backends.executorch.dialect import to_xnnpack_dialect

from support import batches

SQNR_VS_REFERENCE_DB = 30.0
STEPS, BATCH = 5, 2


class Stacked(nn.Module):
    """A 2-layer bidirectional LSTM kept whole (one op), its output sequence the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(12, 16, 2, bidirectional=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


class Tagger(nn.Module):
    """A batch-first GRU then a linear head: XNNPACK takes the head, the op the GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(6, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, h = self.gru(x)
        return self.head(out), h


def _quantized(model: nn.Module, shape: tuple[int, ...], split_layers: bool = True) -> tuple:
    torch.manual_seed(0)
    model = model.eval()
    data = batches(shape, n=8)
    quantizer = qt.Int8Quantizer(split_layers=split_layers)
    ref = qt.quantize(
        model, data[0], data, quantizer=quantizer, progress=False, dynamic_batch=False,
        backend="reference",
    )  # fmt: skip
    return model, ref, data[0]


@pytest.fixture(scope="module")
def stacked() -> tuple:
    model, ref, example = _quantized(Stacked(), (STEPS, BATCH, 12), split_layers=False)
    return model, ref, lower_executorch(ref, example)


def _operators(buffer: bytes) -> list[str]:
    from executorch.exir._serialize._program import deserialize_pte_binary

    (plan,) = deserialize_pte_binary(buffer).program.execution_plan
    return [f"{op.name}.{op.overload}" for op in plan.operators]


def test_a_stacked_bidirectional_lstm_is_one_op_of_the_program_on_int8_weights(
    stacked: tuple,
) -> None:
    _, ref, lowered = stacked
    gm = to_xnnpack_dialect(ref)
    (node,) = [n for n in gm.graph.nodes if n.target == rnn_op.RNN]
    assert not [n for n in gm.graph.nodes if n.target == torch.ops.aten.lstm.input]
    kind, hidden, layers, dirs = node.args[4][:4]
    assert (kind, hidden, layers, dirs) == (0, 16, 2, 2)
    weights = [p for i, p in enumerate(node.args[3]) if i % 8 in (0, 4)]
    assert len(weights) == 2 * 2 * 2
    assert all(getattr(gm, str(w.target)).dtype == torch.int8 for w in weights)
    assert lowered.delegation.portable_ops == {"quantree_et.rnn": 1}
    assert _operators(lowered.buffer) == ["quantree_et::rnn.out"]


def test_the_program_computes_exactly_what_the_cpu_backend_does(stacked: tuple) -> None:
    _, ref, lowered = stacked
    cpu = qt.lower(ref, "cpu")
    for (x,) in batches((STEPS, BATCH, 12), n=2, seed=4):
        (got,) = run_executorch(lowered.buffer, (x,))
        assert torch.equal(got, cpu(x))
        assert qt.sqnr(ref(x), got) >= SQNR_VS_REFERENCE_DB


def test_a_batch_first_gru_with_a_head_runs_close_to_the_reference_without_warnings() -> None:
    _, ref, example = _quantized(Tagger(), (1, STEPS, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", qt.QuantreeWarning)
        lowered = lower_executorch(ref, example)
    assert lowered.delegation.portable_ops.get("quantree_et.rnn") == 1
    assert lowered.delegation.delegate_calls >= 1  # the head, in XNNPACK
    for (x,) in batches((1, STEPS, 6), n=2, seed=5):
        got = run_executorch(lowered.buffer, (x,))
        want = tree_leaves(ref(x))
        assert len(got) == len(want) == 2
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            assert qt.sqnr(w, g) >= SQNR_VS_REFERENCE_DB


class Direct(nn.Module):
    """Calls the op with the arguments of a test: what a tampered ``.pte`` could hold."""

    def __init__(self, params: list[torch.Tensor], config: list[int], q: list[float]) -> None:
        super().__init__()
        for i, p in enumerate(params):
            self.register_buffer(f"p{i}", p)
        self.count, self.config, self.q = len(params), config, q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = [getattr(self, f"p{i}") for i in range(self.count)]
        return rnn_op.RNN(x, None, None, params, self.config, self.q)[0]


def _good_params(hidden: int = 8, features: int = 4) -> list[torch.Tensor]:
    from quantree.backends.cpu.native.packing import pack

    n = 4 * hidden
    block = []
    for depth in (features, hidden):
        block += [pack(torch.ones(n, depth, dtype=torch.int8)),
                  torch.full((n,), depth, dtype=torch.int32), torch.full((n,), 0.01),
                  torch.zeros(n)]  # fmt: skip
    return block


GOOD_Q = [0.02, 0.0, 0.01, 0.0, 0.01, 0.0, 0.01, 0.0, 0.01, 0.0, 1e-4, 0.01, 0.0, 1e-4]
GOOD_Q += [0.01, 0.0, 0.01, 0.0]
GOOD_CONFIG = [0, 8, 1, 1, 8, 0, 1, 0]


def _direct(params: list[torch.Tensor], config: list[int], q: list[float]) -> bytes:
    from executorch.exir import to_edge

    exported = torch.export.export(Direct(params, config, q), (X,))
    return bytes(to_edge(exported).to_executorch().buffer)


X = torch.randn(3, 1, 4)


def test_the_kernel_runs_good_arguments() -> None:
    (out,) = run_executorch(_direct(_good_params(), GOOD_CONFIG, GOOD_Q), (X,))
    assert out.shape == (3, 1, 8) and out.dtype == torch.int8


@pytest.mark.parametrize(
    "case",
    ["float weight", "short weight", "missing bias", "hidden", "kind", "scale", "nan"],
)
def test_wrong_arguments_fail_with_an_executorch_error_not_a_crash(case: str) -> None:
    params, config, q = _good_params(), list(GOOD_CONFIG), list(GOOD_Q)
    if case == "float weight":
        params[0] = params[0].float()
    elif case == "short weight":
        params[4] = params[4][:1]
    elif case == "missing bias":
        params = params[:-1]
    elif case == "hidden":
        config[1] = 9
    elif case == "kind":
        config[0] = 7
    elif case == "scale":
        q[4] = 0.0
    else:
        q[6] = float("nan")
    program = _direct(params, config, q)
    with pytest.raises(RuntimeError):
        run_executorch(program, (X,))
