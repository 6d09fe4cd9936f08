"""Random DAG models made of what real models contain, for the property tests.

A model is a list of steps over a growing list of values (the inputs first): each step is a
small ``nn.Module`` reading some earlier values and appending its outputs. ``build`` draws the
steps from a seeded ``random.Random``, trying each candidate on the example inputs in float
and drawing again when its shapes do not fit, so every model it returns runs in float. The
same seed and length give the same model; a shorter length gives a prefix of it (hypothesis
shrinks towards short graphs).

Why a hand-written generator: the layers need matching shapes (channels, groups dividing
them, kernels no wider than the map), which is easiest to get right by running each
candidate, and hypothesis strategies over that would be longer and slower than drawing from
a seeded RNG.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BATCH = 2
VOCAB = 20


@dataclasses.dataclass(frozen=True)
class Input:
    """One model input: ``kind`` is ``float``, ``tokens`` (int64 ids below VOCAB), ``lengths``
    (int64 per batch row, at most ``shape[1]``; one row always full) or ``mask`` (bool)."""

    kind: str
    shape: tuple[int, ...]  # without the batch dimension
    scale: float = 2.0  # float inputs: randn * scale + offset (images in [0, 255] too)
    offset: float = 0.0

    def make(self, g: torch.Generator, batch: int = BATCH) -> Tensor:
        shape = (batch, *self.shape)
        if self.kind == "tokens":
            return torch.randint(0, VOCAB, shape, generator=g)
        if self.kind == "lengths":
            steps = self.shape[0]
            lengths = torch.randint(1, steps + 1, (batch,), generator=g)
            lengths[int(torch.randint(0, batch, (1,), generator=g))] = steps
            return lengths
        if self.kind == "mask":
            mask = torch.rand(shape, generator=g) < 0.3
            mask[..., 0] = False  # no row all masked (attention would give NaN)
            return mask
        return torch.randn(shape, generator=g) * self.scale + self.offset


# ----------------------------------------------------------------------------- the steps


class Unary(nn.Module):
    """An elementwise or reduction function of one value: activations, softmax, layout."""

    def __init__(self, name: str, fn: Callable[[Tensor], Any]) -> None:
        super().__init__()
        self.name, self.fn = name, fn

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        out = self.fn(x)
        return tuple(out) if isinstance(out, list | tuple) else (out,)

    def extra_repr(self) -> str:
        return self.name


class Binary(nn.Module):
    """A function of two values: residual add/mul, cat, stack, matmul."""

    def __init__(self, name: str, fn: Callable[[Tensor, Tensor], Tensor]) -> None:
        super().__init__()
        self.name, self.fn = name, fn

    def forward(self, a: Tensor, b: Tensor) -> tuple[Tensor, ...]:
        return (self.fn(a, b),)

    def extra_repr(self) -> str:
        return self.name


class Layer(nn.Module):
    """A module with parameters on one value (conv, norm, pooling, linear, embedding);
    ``layout`` moves the feature dimension where the layer wants it and back."""

    def __init__(self, layer: nn.Module, channels_last: bool = False) -> None:
        super().__init__()
        self.layer, self.channels_last = layer, channels_last

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        if self.channels_last:  # (N, T, C) through a channels-first layer
            return (self.layer(x.transpose(1, 2)).transpose(1, 2),)
        return (self.layer(x),)


class Project(nn.Module):
    """``x @ W`` with a parameter ``W``: a matrix product with a constant operand."""

    def __init__(self, w: Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return (x @ self.w,)


class Attention(nn.Module):
    """nn.MultiheadAttention (self or cross), with a key padding mask from a bool input or
    from lengths, or a causal mask, and optionally the averaged weights as a second output."""

    def __init__(self, dim: int, heads: int, batch_first: bool, mask: str, weights: bool):
        super().__init__()
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=batch_first)
        self.batch_first, self.mask, self.weights = batch_first, mask, weights

    def forward(self, q: Tensor, kv: Tensor, *extra: Tensor) -> tuple[Tensor, ...]:
        key_padding = attn_mask = None
        steps = kv.shape[1]
        if self.mask == "causal":
            attn_mask = torch.ones(q.shape[1], steps, dtype=torch.bool).triu(1)
        elif self.mask == "causal_float":  # nn.Transformer.generate_square_subsequent_mask
            attn_mask = torch.full((q.shape[1], steps), float("-inf")).triu(1)
        elif self.mask == "lengths":
            key_padding = torch.arange(steps)[None, :] >= extra[0][:, None]
        elif self.mask == "bool":
            key_padding = extra[0]
        if not self.batch_first:
            q, kv = q.transpose(0, 1), kv.transpose(0, 1)
        out, w = self.mha(
            q,
            kv,
            kv,
            key_padding_mask=key_padding,
            attn_mask=attn_mask,
            need_weights=self.weights,
        )
        if not self.batch_first:
            out = out.transpose(0, 1)
        return (out, w) if self.weights else (out,)


class Sdpa(nn.Module):
    """q/k/v projections, heads, F.scaled_dot_product_attention (causal, a bool mask from an
    input, or none), heads merged and projected: a transformer block's attention by hand."""

    def __init__(self, dim: int, heads: int, mask: str) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.heads, self.mask = heads, mask

    def forward(self, x: Tensor, *extra: Tensor) -> tuple[Tensor, ...]:
        n, t, d = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = None if self.mask != "bool" else ~extra[0][:, None, None, :]
        if self.mask == "float":  # additive: -inf where padded
            mask = torch.zeros(extra[0].shape).masked_fill(extra[0], float("-inf"))[:, None, None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.mask == "causal")
        return (self.out(y.transpose(1, 2).reshape(n, t, d)),)


class Encoder(nn.Module):
    """nn.TransformerEncoderLayer, with a key padding mask from a bool input or not."""

    def __init__(self, layer: nn.TransformerEncoderLayer, masked: bool) -> None:
        super().__init__()
        self.layer, self.masked = layer, masked

    def forward(self, x: Tensor, *extra: Tensor) -> tuple[Tensor, ...]:
        first = self.layer.self_attn.batch_first
        mask = extra[0] if self.masked else None
        y = self.layer(x if first else x.transpose(0, 1), src_key_padding_mask=mask)
        return (y if first else y.transpose(0, 1),)


class Recurrent(nn.Module):
    """nn.LSTM/GRU/RNN on (N, T, F): layout, layers, direction, projection; the initial
    state given (computed from the input) or not; a packed sequence from lengths
    (enforce_sorted=False). Outputs the sequence and the last layer's final hidden state."""

    def __init__(self, rnn: nn.RNNBase, given_state: bool, packed: bool, state_input: bool):
        super().__init__()
        self.rnn, self.packed, self.state_input = rnn, packed, state_input
        hidden = rnn.proj_size or rnn.hidden_size
        self.init = nn.Linear(rnn.input_size, hidden) if given_state else None
        self.directions = rnn.num_layers * (2 if rnn.bidirectional else 1)

    def forward(self, x: Tensor, *extra: Tensor) -> tuple[Tensor, ...]:
        rnn, steps = self.rnn, x.shape[1]
        state: Any = None
        if self.state_input:  # the model's input (N, H) as every layer's initial h (and c)
            h = extra[-1].unsqueeze(0).repeat(self.directions, 1, 1)
            state = (h, extra[-1][None].expand_as(h) * 0.5) if isinstance(rnn, nn.LSTM) else h
        elif self.init is not None:
            h = torch.tanh(self.init(x.mean(1))).unsqueeze(0).repeat(self.directions, 1, 1)
            if isinstance(rnn, nn.LSTM):
                c = torch.zeros(self.directions, x.shape[0], rnn.hidden_size)
                state = (h, c + 0.5)
            else:
                state = h
        seq = x if rnn.batch_first else x.transpose(0, 1)
        if self.packed:
            seq = nn.utils.rnn.pack_padded_sequence(
                seq, extra[0], batch_first=rnn.batch_first, enforce_sorted=False
            )
        out, final = rnn(seq, state)
        if self.packed:
            out, _ = nn.utils.rnn.pad_packed_sequence(
                out, batch_first=rnn.batch_first, total_length=steps
            )
        if not rnn.batch_first:
            out = out.transpose(0, 1)
        h = final[0] if isinstance(final, tuple) else final
        return (out, h[-1])


class CellLoop(nn.Module):
    """An LSTMCell/GRUCell/RNNCell stepped over T in Python (unrolled by export), stacked."""

    def __init__(self, cell: nn.RNNCellBase) -> None:
        super().__init__()
        self.cell = cell

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        h = torch.zeros(x.shape[0], self.cell.hidden_size)
        state: Any = (h, h) if isinstance(self.cell, nn.LSTMCell) else h
        outs = []
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return (torch.stack(outs, 1),)


# ------------------------------------------------------------------------- the generator


def _randomize_stats(bn: nn.Module, rng: random.Random) -> nn.Module:
    """Batch/group/layer norms with non-trivial statistics and affine parameters."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    with torch.no_grad():
        for name in ("running_mean", "bias"):
            t = getattr(bn, name, None)
            if isinstance(t, Tensor):
                t.copy_(torch.randn(t.shape, generator=g))
        for name in ("running_var", "weight"):
            t = getattr(bn, name, None)
            if isinstance(t, Tensor):
                t.copy_(torch.rand(t.shape, generator=g) * 2 + 0.2)
    return bn


def _groups(rng: random.Random, channels: int) -> tuple[int, int]:
    """(groups, out_channels): dense, depthwise (times a multiplier) or narrow groups."""
    kind = rng.choice(["dense", "dense", "depthwise", "narrow"])
    if kind == "depthwise":
        return channels, channels * rng.choice([1, 1, 2])
    if kind == "narrow":
        divisors = [g for g in range(2, channels) if channels % g == 0]
        if divisors:
            g = rng.choice(divisors)
            return g, g * rng.choice([1, 2, 3])
    return 1, rng.choice([4, 6, 8, 12, 16, 17, 24, 33])  # across the kernels' 16-wide panels


def _conv(rng: random.Random, dims: int, channels: int) -> nn.Module:
    groups, out = _groups(rng, channels)
    kernel = rng.choice([1, 2, 3, 3, 5])
    stride = rng.choice([1, 1, 2])
    dilation = rng.choice([1, 1, 2])
    padding: Any = rng.choice([0, 1, kernel // 2])
    mode = "zeros"
    if stride == 1 and rng.random() < 0.2:
        padding = "same"
    elif padding and rng.random() < 0.3:
        mode = rng.choice(["reflect", "replicate", "circular"])
    cls = nn.Conv1d if dims == 1 else nn.Conv2d
    return cls(
        channels,
        out,
        kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=rng.random() < 0.7,
        padding_mode=mode,
    )


def _conv_transpose(rng: random.Random, dims: int, channels: int) -> nn.Module:
    groups, out = _groups(rng, channels)
    kernel, stride, dilation = rng.choice([1, 2, 3]), rng.choice([1, 2]), rng.choice([1, 1, 2])
    padding = rng.choice([0, 1]) if kernel > 1 else 0
    output_padding = rng.choice([0, 1]) if max(stride, dilation) > 1 else 0
    cls = nn.ConvTranspose1d if dims == 1 else nn.ConvTranspose2d
    return cls(
        channels,
        out,
        kernel,
        stride=stride,
        padding=padding,
        output_padding=output_padding,
        groups=groups,
        bias=rng.random() < 0.7,
        dilation=dilation,
    )


def _pool(rng: random.Random, dims: int) -> nn.Module:
    kind = rng.choice(["max", "avg", "adaptive_avg", "adaptive_max"])
    kernel = rng.choice([2, 3])
    stride = rng.choice([None, 1, 2])
    padding = rng.choice([0, kernel // 2])
    ceil = rng.random() < 0.3
    if dims == 1:
        if kind == "max":
            return nn.MaxPool1d(kernel, stride, padding, ceil_mode=ceil)
        if kind == "avg":
            return nn.AvgPool1d(kernel, stride, padding, ceil_mode=ceil)
        size = rng.choice([1, 2, 3])
        return nn.AdaptiveAvgPool1d(size) if kind == "adaptive_avg" else nn.AdaptiveMaxPool1d(size)
    if kind == "max":
        return nn.MaxPool2d(kernel, stride, padding, ceil_mode=ceil)
    if kind == "avg":
        include = rng.random() < 0.5
        return nn.AvgPool2d(kernel, stride, padding, ceil_mode=ceil, count_include_pad=include)
    size: Any = rng.choice([1, 2, (2, 3)])
    return nn.AdaptiveAvgPool2d(size) if kind == "adaptive_avg" else nn.AdaptiveMaxPool2d(size)


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "hardswish": F.hardswish,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "relu6": F.relu6,
    "hardsigmoid": F.hardsigmoid,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.1),
    "elu": F.elu,
    "clamp": lambda x: x.clamp(-1.0, 2.0),
    "scale_shift": lambda x: x * 0.5 + 1.0,
    "div_sub": lambda x: 1.0 - x / 3.0,
    "abs_neg": lambda x: -x.abs(),
    "exp": lambda x: x.clamp(max=4.0).exp(),
    "dead": lambda x: torch.relu(-x.abs()),  # all zeros: a dead channel's range
}


def _rnn(rng: random.Random, features: int) -> nn.RNNBase:
    kind = rng.choice(["LSTM", "GRU", "RNN_TANH", "RNN_RELU"])
    common = dict(
        num_layers=rng.choice([1, 1, 2]),
        bidirectional=rng.random() < 0.5,
        batch_first=rng.random() < 0.5,
        bias=rng.random() < 0.8,
    )
    hidden = rng.choice([4, 8])
    if kind == "LSTM":
        return nn.LSTM(features, hidden, proj_size=rng.choice([0, 0, 3]), **common)
    if kind == "GRU":
        return nn.GRU(features, hidden, **common)
    return nn.RNN(features, hidden, nonlinearity=kind[4:].lower(), **common)


def _in_place(t: Tensor) -> Tensor:
    y = t * 2
    y.relu_()
    y += t
    return y


Candidate = tuple[nn.Module, tuple[int, ...]]
STEPS_BY_RANK = {
    4: [
        "upsample",
        "conv",
        "conv",
        "conv_t",
        "pool",
        "norm",
        "act",
        "act",
        "binary",
        "reduce",
        "layout",
        "to_seq",
        "split",
        "mean",
        "max_dim",
    ],
    3: [
        "conv",
        "conv_t",
        "pool",
        "norm",
        "linear",
        "act",
        "binary",
        "attention",
        "encoder",
        "sdpa",
        "rnn",
        "cell",
        "matmul",
        "layout",
        "split",
        "masked_fill",
        "max_dim",
        "mean",
        "reduce",
        "max_dim",
    ],
    2: ["linear", "norm", "act", "binary", "to_seq"],
}
"""What a value of each rank may go through (a name twice: drawn twice as often)."""


def _candidates(rng: random.Random, values: list[Tensor], inputs: list[Input]) -> Candidate:
    """One random step applicable to some of ``values`` (may still fail on shapes)."""
    floats = [i for i, v in enumerate(values) if v.is_floating_point() and v.dim() >= 2]
    tokens = [i for i, v in enumerate(values) if v.dtype == torch.int64 and v.dim() == 2]
    lengths = [i for i, s in enumerate(inputs) if s.kind == "lengths"]
    masks = [i for i, s in enumerate(inputs) if s.kind == "mask"]
    state_inputs = [i for i, s in enumerate(inputs) if s.kind == "float" and len(s.shape) == 1]
    if tokens and rng.random() < 0.3:
        pad = rng.choice([None, 0])
        return Layer(nn.Embedding(VOCAB, rng.choice([4, 8]), padding_idx=pad)), (
            rng.choice(tokens),
        )
    i = rng.choice(floats[-3:] if rng.random() < 0.7 else floats)  # mostly recent values
    x = values[i]
    shape = tuple(x.shape)
    rank = x.dim()
    kind = rng.choice(STEPS_BY_RANK.get(rank, ["act"]))
    c = shape[1]
    if kind == "conv":
        return Layer(_conv(rng, rank - 2, c)), (i,)
    if kind == "conv_t":
        return Layer(_conv_transpose(rng, rank - 2, c)), (i,)
    if kind == "upsample":
        mode = rng.choice(["nearest", "bilinear", "pixel_shuffle"])
        if mode == "pixel_shuffle":
            return Layer(nn.PixelShuffle(2) if c % 4 == 0 else nn.Upsample(scale_factor=2)), (i,)
        return Layer(nn.Upsample(scale_factor=2, mode=mode)), (i,)
    if kind == "pool":
        return Layer(_pool(rng, rank - 2)), (i,)
    if kind == "norm":
        choice = rng.choice(["batch", "layer", "group"] if rank > 2 else ["batch", "layer"])
        if choice == "batch":
            bn = (nn.BatchNorm1d if rank < 4 else nn.BatchNorm2d)(c)
            return Layer(_randomize_stats(bn, rng)), (i,)
        if choice == "layer":
            return Layer(_randomize_stats(nn.LayerNorm(shape[-1]), rng)), (i,)
        groups = rng.choice([g for g in (1, 2, 4, c) if c % g == 0])
        return Layer(_randomize_stats(nn.GroupNorm(groups, c), rng)), (i,)
    if kind == "act":
        name = rng.choice(list(ACTIVATIONS))
        return Unary(name, ACTIVATIONS[name]), (i,)
    if kind == "linear":
        width = rng.choice([4, 6, 8, 16, 17, 40])
        return Layer(nn.Linear(shape[-1], width, bias=rng.random() < 0.8)), (i,)
    if kind == "binary":
        same = [j for j in floats if j != i and values[j].shape == x.shape]
        op = rng.choice(["add", "mul", "cat", "stack"]) if same else "self"
        j = rng.choice(same) if same else i
        dim = rng.choice([1, -1])
        fns: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
            "add": torch.add,
            "mul": torch.mul,
            "cat": lambda a, b: torch.cat([a, b], dim),
            "stack": lambda a, b: torch.stack([a, b], 1),
            "self": lambda a, b: a + b * 0.5,
        }
        return Binary(f"{op} dim {dim}" if op == "cat" else op, fns[op]), (i, j)
    if kind == "reduce":
        return Unary("flatten", lambda t: t.flatten(1)), (i,)
    if kind == "mean":
        dims = rng.choice([[1], [-1], [2, 3]] if rank == 4 else [[1], [-1]])
        keep = rng.random() < 0.5
        return Unary(f"mean {dims} keepdim={keep}", lambda t: t.mean(dims, keepdim=keep)), (i,)
    if kind == "to_seq":
        if rank == 4:
            return Unary("flatten(2).transpose", lambda t: t.flatten(2).transpose(1, 2)), (i,)
        k = rng.choice([d for d in (2, 3, 4) if shape[1] % d == 0] or [1])
        return Unary(f"view(n, -1, {k})", lambda t: t.view(t.shape[0], -1, k)), (i,)
    if kind == "layout":
        if rank == 4:
            perm = rng.choice([(0, 1, 3, 2), (0, 2, 1, 3), (0, 3, 1, 2)])
            return Unary(f"permute{perm}", lambda t: t.permute(perm).contiguous()), (i,)
        return Unary("transpose(1, 2)", lambda t: t.transpose(1, 2)), (i,)
    if kind == "split":
        choice = rng.choice(["split", "chunk", "unbind"])
        dim = rng.choice([1, -1])
        if choice == "split":
            first = rng.randrange(1, max(2, shape[dim]))
            return Unary(f"split {first} dim {dim}", lambda t: t.split(first, dim)), (i,)
        if choice == "chunk":
            return Unary(f"chunk 2 dim {dim}", lambda t: t.chunk(2, dim)), (i,)
        return Unary("unbind(1)[:2]", lambda t: t.unbind(1)[:2]), (i,)
    if kind == "max_dim":
        choice = rng.choice(["max", "topk", "cumsum", "where", "sum", "inplace"])
        if choice == "topk":
            k = min(2, shape[-1])
            return Unary(f"topk({k})", lambda t: tuple(t.topk(k, -1))), (i,)
        if choice == "cumsum":
            return Unary("cumsum(1)", lambda t: t.cumsum(1)), (i,)
        if choice == "where":
            return Unary("where(x > 0, x, 0.1 x)", lambda t: torch.where(t > 0, t, 0.1 * t)), (i,)
        if choice == "sum":
            return Unary("sum(-1)", lambda t: t.sum(-1)), (i,)
        if choice == "inplace":  # ResNet's relu(inplace=True) and out += identity on a temporary
            return Unary("y = x * 2; y.relu_(); y += x", _in_place), (i,)
        return Unary("max(dim=1)", lambda t: tuple(t.max(dim=1))), (i,)
    if kind == "masked_fill":
        if masks and inputs[masks[0]].shape == shape[1:2] and rng.random() < 0.6:
            fill = rng.choice([0.0, -1e4])
            return Binary(
                f"masked_fill(mask, {fill})",
                lambda t, m: t.masked_fill(m[:, :, None], fill),
            ), (i, masks[0])
        return Unary("masked_fill(x < 0, 0)", lambda t: t.masked_fill(t < 0, 0.0)), (i,)
    if kind == "matmul":
        choice = rng.choice(["gram", "bmm", "weight"])
        if choice == "gram":
            return Unary("x @ x^T", lambda t: t @ t.transpose(1, 2)), (i,)
        if choice == "bmm":
            return Unary(
                "bmm(softmax(x x^T), x)", lambda t: torch.bmm((t @ t.mT).softmax(-1), t)
            ), (i,)
        return Project(torch.randn(shape[-1], rng.choice([4, 8]))), (i,)
    steps_match = [j for j in lengths if inputs[j].shape[0] == shape[1]]
    bool_match = [j for j in masks if inputs[j].shape[0] == shape[1]]
    if kind == "attention":
        heads = rng.choice([h for h in (1, 2, 4) if shape[-1] % h == 0])
        mask = rng.choice(
            ["none", "causal", "causal_float"]
            + ["lengths"] * bool(steps_match)
            + ["bool"] * bool(bool_match)
        )
        others = [j for j in floats if values[j].dim() == 3 and values[j].shape[-1] == shape[-1]]
        kv = rng.choice(others) if mask in ("none", "causal", "causal_float") else i
        if mask.startswith("causal") and values[kv].shape[1] != shape[1]:
            kv = i
        extra = {"lengths": tuple(steps_match[:1]), "bool": tuple(bool_match[:1])}.get(mask, ())
        mod = Attention(shape[-1], heads, rng.random() < 0.5, mask, rng.random() < 0.3)
        return mod, (i, kv, *extra)
    if kind == "sdpa":
        heads = rng.choice([h for h in (1, 2, 4) if shape[-1] % h == 0])
        mask = rng.choice(["none", "causal"] + ["bool", "float"] * bool(bool_match))
        return Sdpa(shape[-1], heads, mask), (
            i,
            *(bool_match[:1] if mask in ("bool", "float") else ()),
        )
    if kind == "encoder":
        heads = rng.choice([h for h in (1, 2, 4) if shape[-1] % h == 0])
        layer = nn.TransformerEncoderLayer(
            shape[-1],
            heads,
            dim_feedforward=16,
            dropout=0.0,
            activation=rng.choice(["relu", "gelu"]),
            batch_first=rng.random() < 0.5,
            norm_first=rng.random() < 0.5,
        )
        return Encoder(layer, bool(bool_match) and rng.random() < 0.5), (i, *bool_match[:1])
    if kind == "rnn":
        packed = bool(steps_match) and rng.random() < 0.4
        rnn = _rnn(rng, shape[-1])
        width = rnn.proj_size or rnn.hidden_size
        states = [j for j in state_inputs if inputs[j].shape == (width,)]
        if states and isinstance(rnn, nn.LSTM) and rnn.proj_size:
            states = []  # h is proj_size wide, c hidden_size: one input cannot be both
        use_state = bool(states) and rng.random() < 0.6
        mod = Recurrent(rnn, rng.random() < 0.4, packed, use_state)
        return mod, (i, *(steps_match[:1] if packed else ()), *(states[:1] if use_state else ()))
    cell = rng.choice([nn.LSTMCell, nn.GRUCell, nn.RNNCell])(shape[-1], rng.choice([4, 8]))
    return CellLoop(cell), (i,)


@dataclasses.dataclass
class Plan:
    inputs: list[Input]
    steps: list[Candidate]
    outputs: list[int]
    container: str


def _inputs(rng: random.Random) -> list[Input]:
    steps = rng.choice([4, 5, 6, 13])
    first = rng.choice(["image", "sequence", "sequence", "tokens"])
    scale, offset = rng.choice([(2.0, 0.0), (2.0, 0.0), (0.01, 0.0), (60.0, 128.0), (1.0, -3.0)])
    if first == "image":
        channels = rng.choice([3, 4, 8, 17])
        shape: tuple[int, ...] = (channels, rng.choice([6, 7, 15]), rng.choice([6, 8, 21]))
        found = [Input("float", shape, scale, offset)]
    elif first == "sequence":
        found = [Input("float", (steps, rng.choice([4, 6, 8, 12])), scale, offset)]
    else:
        found = [Input("tokens", (steps,))]
    if first != "image" and rng.random() < 0.3:
        found.append(Input("lengths", (steps,)))
    if first != "image" and rng.random() < 0.3:
        found.append(Input("mask", (steps,)))
    if rng.random() < 0.2:
        found.append(dataclasses.replace(found[0]))  # a second input like the first
    if first != "image" and rng.random() < 0.3:
        found.append(Input("float", (rng.choice([4, 8]),)))  # a recurrent layer's state
    return found


def _run(steps: list[Candidate], args: tuple[Tensor, ...]) -> list[Tensor]:
    values = list(args)
    for module, reads in steps:
        values += list(module(*(values[j] for j in reads)))
    return values


def plan(seed: int, length: int) -> Plan:
    """``length`` random steps (fewer if no candidate fits after many draws)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    inputs = _inputs(rng)
    g = torch.Generator().manual_seed(seed)
    example = tuple(s.make(g) for s in inputs)
    steps: list[Candidate] = []
    values = _run(steps, example)
    for _ in range(length):
        for _attempt in range(30):
            if not any(v.is_floating_point() and v.dim() >= 2 for v in values):
                step = (Layer(nn.Embedding(VOCAB, rng.choice([4, 8]))), (0,))
            elif steps and rng.random() < 0.1:  # an earlier step's module again: shared weights
                module, reads = rng.choice(steps)
                step = (module, tuple(rng.choice([j, *range(len(values))]) for j in reads))
            else:
                step = _candidates(rng, values, inputs)
            step[0].eval()
            try:
                with torch.no_grad():
                    outs = list(step[0](*(values[j] for j in step[1])))
            except (RuntimeError, ValueError, IndexError, AssertionError, TypeError):  # misfit
                continue
            if all(o.numel() and o.numel() <= 16384 for o in outs):
                steps.append(step)
                values += outs
                break
    made = list(range(len(inputs), len(values)))
    extra = rng.sample(made, min(len(made), rng.choice([0, 1, 2])))
    if rng.random() < 0.1:
        extra.append(rng.randrange(len(values)))  # an input, or a value returned twice
    outputs = sorted([made[-1], *extra])
    container = rng.choice(["single", "tuple", "list", "dict", "nested"])
    return Plan(inputs, steps, outputs, container)


class RandomGraph(nn.Module):
    """Replays a ``Plan``: the values list grows step by step; the chosen ones are returned
    in a tuple, a list, a dict, or alone."""

    def __init__(self, p: Plan) -> None:
        super().__init__()
        self.steps = nn.ModuleList(m for m, _ in p.steps)
        self.reads = [reads for _, reads in p.steps]
        self.outputs, self.container = p.outputs, p.container

    def forward(self, *args: Tensor) -> Any:
        values = list(args)
        for module, reads in zip(self.steps, self.reads, strict=True):
            values += list(module(*(values[j] for j in reads)))
        chosen = [values[j] for j in self.outputs]
        if self.container == "single":
            return chosen[-1]
        if self.container == "tuple":
            return tuple(chosen)
        if self.container == "list":
            return chosen
        if self.container == "nested":
            return {"last": chosen[-1], "rest": (chosen[:-1], {"n": len(chosen)})}
        return {f"out{j}": v for j, v in zip(self.outputs, chosen, strict=True)}


def describe(p: Plan) -> str:
    """A readable listing of a plan (what a failing example prints)."""
    lines = [f"inputs: {[(s.kind, s.shape) for s in p.inputs]}"]
    lines += [f"  {reads} -> {module!r}".replace("\n", " ") for module, reads in p.steps]
    lines.append(f"outputs {p.outputs} as {p.container}")
    return "\n".join(lines)
