"""Python loops over time, folded back into one loop (``quantree.recurrent.unrolled``).

For each family: captured and quantized at 64 tokens (int8, CPU backend, the loop folded),
then timed at 64 and 512 tokens against the float model in eager mode, one thread,
interleaved, two runs; the input-dependent SQNR (fresh inputs, not the calibration ones);
and whether the loop captured at 64 runs at 17 and 512 tokens.

    python benchmarks/unrolled_loops.py [family ...]   # gru_cell lstm_cell light_gru mamba1
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from benchmarks.common import interleaved_times, load_note, one_thread

sys.modules.setdefault("torchvision", None)  # type: ignore[arg-type]  # broken C ops here
sys.modules.setdefault("torchaudio", None)  # type: ignore[arg-type]

import quantree as qt  # noqa: E402

FEATURES = 32


class CellLoop(nn.Module):
    def __init__(self, lstm: bool) -> None:
        super().__init__()
        self.lstm = lstm
        self.cell = nn.LSTMCell(FEATURES, 64) if lstm else nn.GRUCell(FEATURES, 64)
        self.out = nn.Linear(64, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 64)
        c = torch.zeros(x.shape[0], 64)
        ys = []
        for t in range(x.shape[1]):
            if self.lstm:
                h, c = self.cell(x[:, t], (h, c))
            else:
                h = self.cell(x[:, t], h)
            ys.append(h)
        return self.out(torch.stack(ys, 1))


class LightGRU(nn.Module):
    """SpeechBrain's Light-GRU step (relu candidate, no reset gate; layer norm on the input
    projection), written as its Python loop."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(FEATURES, 128, bias=False)
        self.norm = nn.LayerNorm(128)
        self.u = nn.Linear(64, 128, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wx = self.norm(self.w(x))
        h = torch.zeros(x.shape[0], 64)
        ys = []
        for t in range(x.shape[1]):
            a, z = (wx[:, t] + self.u(h)).chunk(2, dim=-1)
            z = torch.sigmoid(z)
            h = z * h + (1 - z) * torch.relu(a)
            ys.append(h)
        return torch.stack(ys, 1)


class Mamba(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import MambaConfig, MambaModel

        config = MambaConfig(
            vocab_size=100, hidden_size=FEATURES, state_size=8, num_hidden_layers=2,
            intermediate_size=64, time_step_rank=4, conv_kernel=4, use_mambapy=False,
        )  # fmt: skip
        self.m = MambaModel(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(inputs_embeds=x, use_cache=False).last_hidden_state


FAMILIES = {
    "gru_cell": lambda: CellLoop(False),
    "lstm_cell": lambda: CellLoop(True),
    "light_gru": LightGRU,
    "mamba1": Mamba,
}


def run(name: str) -> None:
    torch.manual_seed(0)
    model = FAMILIES[name]().eval()
    x64 = torch.randn(2, 64, FEATURES)
    calibration = [(torch.randn(2, 64, FEATURES),) for _ in range(4)]
    start = time.perf_counter()
    low = qt.quantize(model, (x64,), calibration, backend="cpu", progress=False, fold_loops=True)
    took = time.perf_counter() - start
    unrolled = qt.quantize(
        model, (x64,), calibration, backend="cpu", progress=False, fold_loops=False
    )
    loops = sum(
        type(m).__name__ in ("StepLoop", "NativeStepLoop", "NativeProgramLoop")
        for m in low.modules()
    )
    print(f"## {name}: {loops} folded loop(s), quantized in {took:.0f} s")
    for length in (17, 64, 512):
        x = torch.randn(2, length, FEATURES)
        with torch.no_grad():
            score = qt.sqnr(model(x), low(x))
        print(f"  {length} tokens: runs, SQNR {score:.1f} dB")
    for length in (64, 512):
        x = torch.randn(2, length, FEATURES)
        variants = {"float": lambda x=x: model(x), "lowered": lambda x=x: low(x)}
        if length == 64:  # the unrolled graph runs only at the captured length
            variants["unrolled"] = lambda x=x: unrolled(x)
        for run_ in (1, 2):
            times = interleaved_times(variants, runs=5 if length == 64 else 3, warmup=2)
            (fw, fc), (lw, lc) = times["float"], times["lowered"]
            line = (
                f"  {length} tokens run {run_}: float {fw:.1f} ms, lowered (folded) {lw:.1f} "
                f"ms: {lw / fw:.2f}x wall, {lc / fc:.2f}x CPU"
            )
            if "unrolled" in times:
                uw, uc = times["unrolled"]
                line += f"; lowered unrolled {uw / fw:.2f}x wall, {uc / fc:.2f}x CPU"
            print(f"{line} ({load_note()})")


if __name__ == "__main__":
    one_thread()
    for family in sys.argv[1:] or list(FAMILIES):
        run(family)
