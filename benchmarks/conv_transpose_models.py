"""Transposed convolutions, float against int8: a HiFi-GAN-like upsampler and a U-Net decoder.

    python benchmarks/conv_transpose_models.py --runs 20

Random weights. Three variants per model, timed interleaved in one process (median thread-CPU
time, one thread; ratios to float): float, the default recipe with the transposed
convolutions kept float (what quantree did before they were quantized: a rule annotating
them with nothing), and the default recipe. SQNR is input-dependent, of the lowered outputs
against float on held-out inputs (as ``zoo.py``).
"""

from __future__ import annotations

import argparse

import torch
from common import interleaved_times, load_note, one_thread
from torch import nn
from zoo import input_dependent_sqnr

import quantree as qt
from quantree.backends import CPU

aten = torch.ops.aten


class HifiGanLike(nn.Module):
    """HiFi-GAN's generator shape: conv_pre, then per stage leaky relu, a transposed conv
    upsampling by its stride and a residual conv1d, then conv_post and tanh (x256)."""

    def __init__(self, mels: int = 80, channels: int = 256) -> None:
        super().__init__()
        self.pre = nn.Conv1d(mels, channels, 7, padding=3)
        stages = [(16, 8), (16, 8), (4, 2), (4, 2)]
        self.ups, self.res = nn.ModuleList(), nn.ModuleList()
        for i, (k, s) in enumerate(stages):
            c_in, c_out = channels >> i, channels >> (i + 1)
            self.ups.append(nn.ConvTranspose1d(c_in, c_out, k, s, padding=(k - s) // 2))
            self.res.append(nn.Conv1d(c_out, c_out, 3, padding=1))
        self.post = nn.Conv1d(channels >> len(stages), 1, 7, padding=3)

    def forward(self, x):
        x = self.pre(x)
        for up, res in zip(self.ups, self.res, strict=True):
            x = up(nn.functional.leaky_relu(x, 0.1))
            x = x + res(nn.functional.leaky_relu(x, 0.1))
        return torch.tanh(self.post(nn.functional.leaky_relu(x, 0.1)))


class UNetDecoder(nn.Module):
    """A U-Net's decoder: per level a 2x2 stride-2 transposed conv, concatenation with the
    encoder's skip, a 3x3 conv and relu; a 1x1 head."""

    def __init__(self, channels: int = 256, levels: int = 3, classes: int = 2) -> None:
        super().__init__()
        self.ups, self.convs = nn.ModuleList(), nn.ModuleList()
        for i in range(levels):
            c_in, c_out = channels >> i, channels >> (i + 1)
            self.ups.append(nn.ConvTranspose2d(c_in, c_out, 2, stride=2))
            self.convs.append(nn.Conv2d(2 * c_out, c_out, 3, padding=1))
        self.head = nn.Conv2d(channels >> levels, classes, 1)

    def forward(self, x, *skips):
        for up, conv, skip in zip(self.ups, self.convs, skips, strict=True):
            x = torch.relu(conv(torch.cat([up(x), skip], 1)))
        return self.head(x)


def unit_variance(model: nn.Module, args: tuple[torch.Tensor, ...]) -> nn.Module:
    """Biases zeroed and each layer's weight scaled, in order, so its output has unit
    standard deviation on ``args`` (LSUV-like): with PyTorch's default initialisation the
    HiFi-GAN-like stack shrinks its input-dependent signal 400-fold to a bias-dominated
    output, whose SQNR then measures the biases' rounding, not the layers'."""
    layers = [
        m
        for m in model.modules()
        if isinstance(m, nn.Conv1d | nn.Conv2d | nn.ConvTranspose1d | nn.ConvTranspose2d)
    ]
    with torch.no_grad():
        for layer in layers:
            if layer.bias is not None:
                layer.bias.zero_()
        for layer in layers:
            seen: list[torch.Tensor] = []
            hook = layer.register_forward_hook(lambda m, i, o, seen=seen: seen.append(o))
            model(*args)
            hook.remove()
            layer.weight.div_(float(seen[0].std()))
    return model


def cases() -> dict[str, tuple[nn.Module, object]]:
    def mel(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (torch.randn(1, 80, 32, generator=g),)

    def unet(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        shapes = [(1, 256, 8, 8), (1, 128, 16, 16), (1, 64, 32, 32), (1, 32, 64, 64)]
        return tuple(torch.relu(torch.randn(*s, generator=g)) for s in shapes)

    return {"hifigan_like": (HifiGanLike(), mel), "unet_decoder": (UNetDecoder(), unet)}


FLOAT_TRANSPOSED = qt.Rule(
    (aten.conv_transpose1d, aten.conv_transpose2d), lambda node: qt.Annotation()
)
"""The transposed convolutions left float (quantree before issue 10)."""


LAYERS = {
    "hifigan up0 256->128 k16 s8, L 32": (nn.ConvTranspose1d(256, 128, 16, 8, 4), (1, 256, 32)),
    "hifigan up2 64->32 k4 s2, L 2048": (nn.ConvTranspose1d(64, 32, 4, 2, 1), (1, 64, 2048)),
    "convtasnet decoder 128->1 k16 s8, L 1001": (
        nn.ConvTranspose1d(128, 1, 16, 8, bias=False),
        (1, 128, 1001),
    ),
    "unet up0 256->128 k2 s2, 8x8": (nn.ConvTranspose2d(256, 128, 2, 2), (1, 256, 8, 8)),
    "unet up2 64->32 k2 s2, 32x32": (nn.ConvTranspose2d(64, 32, 2, 2), (1, 64, 32, 32)),
    "3x3 s2 p1 op1 64->32, 32x32": (nn.ConvTranspose2d(64, 32, 3, 2, 1, 1), (1, 64, 32, 32)),
}
"""Single layers: the float op against the lowered int8 layer alone (int8 in, int8 out)."""


def layer_times(runs: int) -> None:
    for name, (layer, shape) in LAYERS.items():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(*shape, generator=g),) for _ in range(2)]
        ref = qt.quantize(layer.eval(), data[0], data, progress=False, backend="reference")
        low = qt.lower(ref, CPU)
        (node,) = [n for n in low.graph.nodes if str(n.target).startswith("quantree.conv_t")]
        env = {n.name: getattr(low, n.target) for n in low.graph.nodes if n.op == "get_attr"}
        q = torch.ops.quantree.quantize.default
        quantize = next(n for n in low.graph.nodes if n.target == q)
        x = q(data[1][0], *quantize.args[1:])
        call_args = [env[a.name] if isinstance(a, torch.fx.Node) and a.name in env else a
                     for a in node.args]  # fmt: skip
        call_args[0] = x
        x_float = data[1][0]
        times = interleaved_times(
            {
                "float": lambda layer=layer, x_float=x_float: layer(x_float),
                "int8": lambda node=node, call_args=call_args: node.target(*call_args),
            },
            runs,
        )
        base = times["float"][1]
        print(f"| {name} | {base * 1e3:.0f} us | {times['int8'][1] * 1e3:.0f} us "
              f"({times['int8'][1] / base:.2f}x) |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--calibration", type=int, default=4)
    parser.add_argument("--held", type=int, default=4)
    parser.add_argument("--layers", action="store_true", help="time single layers instead")
    args = parser.parse_args()
    one_thread()
    print(load_note())
    if args.layers:
        layer_times(args.runs)
        print(load_note())
        return
    torch.manual_seed(0)  # the models' initial weights
    for name, (model, sample) in cases().items():
        torch.manual_seed(0)
        model.eval()
        g = torch.Generator().manual_seed(1)
        calibration = [sample(g) for _ in range(args.calibration)]
        unit_variance(model, calibration[0])
        held = [sample(g) for _ in range(args.held)]
        lowered = {}
        for label, rules in (("transposed float", (FLOAT_TRANSPOSED,)), ("int8", ())):
            quantizer = qt.Int8Quantizer(rules=rules)
            ref = qt.quantize(
                model,
                calibration[0],
                calibration,
                quantizer=quantizer,
                progress=False,
                backend="reference",
            )
            lowered[label] = qt.lower(ref, CPU)
        with torch.no_grad():
            want = [model(*h) for h in held]
            sqnr = {
                label: input_dependent_sqnr(want, [low(*h) for h in held])
                for label, low in lowered.items()
            }
        x = held[0]
        variants = {"float": lambda model=model, x=x: model(*x)}
        variants.update({label: (lambda low=low, x=x: low(*x)) for label, low in lowered.items()})
        before = load_note()
        times = interleaved_times(variants, args.runs)
        base = times["float"][1]
        cells = [
            f"{label} {cpu / base:.2f}x ({wall / times['float'][0]:.2f}x wall)"
            + (f", {sqnr[label]:.1f} dB" if label in sqnr else f", {cpu:.1f} ms")
            for label, (wall, cpu) in times.items()
        ]
        print(f"{name}: " + "; ".join(cells) + f"  [{before} -> {load_note()}]")


if __name__ == "__main__":
    main()
