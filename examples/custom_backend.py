"""A backend of your own, written only with quantree's public API.

A backend is a value: ``qt.Backend(name, rules, quantize=..., dequantize=...)``. This one
stands for an accelerator that runs ``linear -> relu`` as one int8 op and wants its weights
in its own tensor type. It shows the three extension points:

(a) a lowering rule that finds the fused q/dq pattern ``dq -> linear -> relu -> q`` and
    replaces it with the backend's own op (``accel_linear_relu``);
(b) weights quantized into the backend's tensor subclass (``AccelWeight``) through its
    ``quantize`` function, which ``ctx.quantize`` calls;
(c) decisions read from the graph: only layers under a chosen module scope are lowered,
    and only when their annotation quantizes the weight symmetric per output channel.

Backends compose with ``+`` (the right operand's rules are tried first):
``CPU + accel_backend("encoder")`` lowers the encoder with this backend, the rest natively.

    python examples/custom_backend.py
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

import quantree as qt

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed


class AccelWeight(torch.Tensor):
    """int8 weight values with their per-output-channel scales: the accelerator's format."""

    scale: torch.Tensor

    @staticmethod
    def __new__(cls, values: torch.Tensor, scale: torch.Tensor) -> AccelWeight:
        weight = torch.Tensor._make_subclass(cls, values)
        weight.scale = scale
        return weight

    def values(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


def accel_quantize(x: torch.Tensor, p: qt.QParams) -> torch.Tensor:
    """The backend's quantize function: per-channel int8 weights become AccelWeight."""
    if p.axis == 0 and p.dtype == qt.QDtype.INT8:
        scale = p.scale.float().reshape(-1, *([1] * (x.dim() - 1)))
        values = torch.round(x / scale).clamp(p.quant_min, p.quant_max).to(torch.int8)
        return AccelWeight(values, p.scale.float())
    if p.axis is None:
        bounds = (p.quant_min, p.quant_max, p.dtype.torch_dtype)
        return qd.quantize_per_tensor(x, float(p.scale), int(p.zero_point), *bounds)
    bounds = (p.quant_min, p.quant_max, p.dtype.torch_dtype)
    return qd.quantize_per_channel(x, p.scale, p.zero_point, p.axis, *bounds)


def accel_dequantize(q: torch.Tensor, p: qt.QParams) -> torch.Tensor:
    if isinstance(q, AccelWeight):
        scale = q.scale.reshape(-1, *([1] * (q.dim() - 1)))
        return q.values().float() * scale
    if p.axis is None:
        bounds = (p.quant_min, p.quant_max, p.dtype.torch_dtype)
        return qd.dequantize_per_tensor(q, float(p.scale), int(p.zero_point), *bounds)
    bounds = (p.quant_min, p.quant_max, p.dtype.torch_dtype)
    return qd.dequantize_per_channel(q, p.scale, p.zero_point, p.axis, *bounds)


def accel_linear_relu(
    x: torch.Tensor,
    weight: AccelWeight,
    bias: torch.Tensor | None,
    x_scale: float,
    x_zero_point: int,
    out_scale: float,
    out_zero_point: int,
) -> torch.Tensor:
    """The accelerator's op: int8 in, int32 accumulate, requantize, relu, int8 out."""
    acc = (x.to(torch.int32) - x_zero_point) @ weight.values().to(torch.int32).t()
    y = acc.float() * (x_scale * weight.scale)
    if bias is not None:
        y = y + bias
    q = torch.round(torch.relu(y) / out_scale) + out_zero_point
    return q.clamp(-128, 127).to(torch.int8)


def _weight_is_symmetric_per_channel(ctx: qt.LoweringContext, linear: fx.Node) -> bool:
    info = ctx.annotation(linear)
    spec = None if info is None else info.annotation.inputs.get((1,))
    return isinstance(spec, qt.QuantSpec) and spec.symmetric and spec.axis == 0


def linear_relu_rule(scope: str):
    """Lower ``dq -> linear -> relu -> q`` for linears whose module is under ``scope``."""

    def rule(ctx: qt.LoweringContext, linear: fx.Node) -> bool:
        # Anchor on the pattern's first op: at each node, rules of a composed backend are
        # tried in order, so anchoring where other backends anchor lets ``+`` decide.
        if linear.target != aten.linear.default or len(linear.users) != 1:
            return False
        relu = next(iter(linear.users))
        if relu.target not in (aten.relu.default, aten.relu_.default):
            return False
        in_scope = ctx.scope(linear) == scope or ctx.scope(linear).startswith(scope + ".")
        if not in_scope or not _weight_is_symmetric_per_channel(ctx, linear):
            return False
        x, w = ctx.dequantized(linear.args[0]), ctx.dequantized(linear.args[1])
        b = ctx.dequantized(linear.args[2]) if len(linear.args) > 2 else None
        out = ctx.quantized_output(relu)
        if x is None or w is None or not w.is_constant or out is None:
            return False
        weight = ctx.quantize(ctx.constant(w), w.params)  # an AccelWeight
        graph = ctx.gm.graph
        weight_node = ctx.add_constant("_accel_weight_", weight, before=linear)
        bias_node = None if b is None else ctx.add_constant("_accel_bias_", ctx.constant(b), linear)
        with graph.inserting_before(linear):
            fused = graph.call_function(
                accel_linear_relu,
                (
                    x.source,
                    weight_node,
                    bias_node,
                    float(x.params.scale),
                    int(x.params.zero_point),
                    float(out.params.scale),
                    int(out.params.zero_point),
                ),
            )
        out.node.replace_all_uses_with(fused)
        for dead in (out.node, relu, linear):
            graph.erase_node(dead)
        return True

    return rule


def accel_backend(scope: str) -> qt.Backend:
    return qt.Backend(
        f"accel[{scope}]",
        rules=(linear_relu_rule(scope),),
        quantize=accel_quantize,
        dequantize=accel_dequantize,
    )


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def accel_ops(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is accel_linear_relu]


def main() -> None:
    torch.manual_seed(0)
    model = EncoderDecoder().eval()
    data = [(torch.randn(16, 32),) for _ in range(8)]
    ref = qt.quantize(model, data[0], data, progress=False, backend="reference")
    lowered = qt.lower(ref, accel_backend("encoder"))
    with torch.no_grad():
        want, got = ref(*data[0]), lowered(*data[0])
    print(f"accel ops: {len(accel_ops(lowered))}, SQNR vs reference {qt.sqnr(want, got):.1f} dB")
    weights = [getattr(lowered, str(n.args[1].target)) for n in accel_ops(lowered)]
    print("weight types:", sorted({type(w).__name__ for w in weights}))


if __name__ == "__main__":
    main()
