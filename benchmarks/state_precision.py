"""State precision of a selective scan: int8, int16 or float state, SQNR along the sequence.

    python benchmarks/state_precision.py                 # Mamba-1, 64 tokens
    python benchmarks/state_precision.py --tokens 128 --layers 2

transformers' Mamba-1 (pure-PyTorch path, random init, small config) is captured with its
scan unrolled: step t computes ``h_t = dA_t * h_{t-1} + dBu_t`` and reads ``h_t @ C_t``.
The scan's carried state (each step's ``mul`` and ``add``) gets, by a user rule added to
the default recipe, int8 (the recipe's default), int16 (symmetric, min-max) or no
quantization at all; every other op is quantized as the recipe says. The reference graph
(quantize/dequantize around float ops: the numerics, not a kernel's speed) is compared
with float per position of the sequence over held-out inputs: where state error builds
up, late positions lose SQNR.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
import torch.fx as fx
from torch import nn

import quantree as qt
from quantree.core.qdq import is_quantize
from quantree.core.values import Use

aten = torch.ops.aten


def build(tokens: int, layers: int) -> nn.Module:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from modern_zoo import Hidden
    from zoo import import_model_libraries

    import_model_libraries()
    from transformers import MambaConfig, MambaModel

    cfg = MambaConfig(
        vocab_size=1000, hidden_size=64, state_size=16, num_hidden_layers=layers, expand=2,
        conv_kernel=4, use_cache=False,
    )  # fmt: skip
    return Hidden(MambaModel(cfg)).eval()


def state_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The scan's carried state: ``mul(dA_t, h)`` and ``add(that, dBu_t)`` chained step to
    step from the initial ``zeros`` (through ``to``)."""
    state: set[fx.Node] = set()
    for node in graph.nodes:
        if node.target == aten.mul.Tensor:
            carried = [a for a in node.args if isinstance(a, fx.Node)]
            if any(a in state or a.target == aten.zeros.default for a in carried):
                state.add(node)
        elif node.target == aten.add.Tensor and node.args[0] in state:
            state.add(node)
        elif _packet(node) in (aten.to, aten._to_copy) and node.args[0] in state:
            state.add(node)  # ``ssm_state.to(dtype)``: the same values
    return state


def _packet(node: fx.Node) -> object:
    return getattr(node.target, "overloadpacket", None)


def state_rule(spec: qt.QuantSpec | None) -> qt.Rule:
    """The state on ``spec`` (None: float); what reads it reads it on that grid."""
    base = qt.Int8Quantizer()
    found: dict[fx.Graph, set[fx.Node]] = {}

    def annotate(node: fx.Node) -> qt.Annotation | None:
        state = found.setdefault(node.graph, state_nodes(node.graph))
        reads = {p for p in [(0,), (1,)] if _reads(node, p, state)}
        if node not in state and not reads:
            return None
        recipe = base.annotate_node(node) or qt.Annotation()
        inputs = dict(recipe.inputs)
        for path in reads:
            inputs.pop(path, None)
            if spec is not None:
                inputs[path] = spec
        outputs = recipe.outputs
        if node in state:
            outputs = None if _packet(node) in (aten.to, aten._to_copy) else spec
        return qt.Annotation(outputs=outputs, inputs=inputs)

    return qt.Rule((aten.mul, aten.add, aten.matmul, aten._to_copy), annotate)


def _reads(node: fx.Node, path: tuple[int], state: set[fx.Node]) -> bool:
    if len(node.args) <= path[0] or not isinstance(node.args[path[0]], fx.Node):
        return False
    return Use.of(node, path).value.node in state


def per_position_sqnr(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """SQNR in dB at each position, over held-out inputs and channels: [batch, T, C]."""
    signal = ref.pow(2).sum((0, 2))
    noise = (ref - got).pow(2).sum((0, 2)).clamp_min(1e-30)
    return 10 * torch.log10(signal / noise)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = build(args.tokens, args.layers)
    gen = torch.Generator().manual_seed(1)

    def sample() -> tuple[torch.Tensor]:
        return (torch.randint(0, 1000, (1, args.tokens), generator=gen),)

    calib = [sample() for _ in range(16)]
    held = [sample() for _ in range(8)]
    with torch.no_grad():
        ref = torch.cat([model(*x) for x in held])
    variants = {
        "int8 state": state_rule(qt.QuantSpec(qt.QDtype.INT8)),
        "int16 state": state_rule(qt.QuantSpec(qt.QDtype.INT16, symmetric=True)),
        "float state": state_rule(None),
    }
    marks = sorted(
        t for t in {1, 2, 4, 8, 16, 32, args.tokens // 2, args.tokens} if t <= args.tokens
    )
    print(f"| state | {' | '.join(f't={t}' for t in marks)} | mean | quantize nodes |")
    print("|---" * (len(marks) + 3) + "|")
    for name, rule in variants.items():
        quantizer = qt.Int8Quantizer(rules=(rule,))
        q = qt.quantize(model, calib[0], calib, quantizer=quantizer, backend="reference",
                        progress=False)  # fmt: skip
        with torch.no_grad():
            got = torch.cat([q(*x) for x in held])
        sqnr = per_position_sqnr(ref, got)
        cells = " | ".join(f"{float(sqnr[t - 1]):.1f}" for t in marks)
        points = sum(1 for n in q.graph.nodes if is_quantize(n))
        print(f"| {name} | {cells} | {float(sqnr.mean()):.1f} | {points} |", flush=True)


if __name__ == "__main__":
    main()
