"""Model zoo: quantree on models nobody here wrote, against float and torchao + Inductor.

    python benchmarks/zoo.py                      # every model
    python benchmarks/zoo.py --models bert,gpt2 --runs 30 --anchor none
    python benchmarks/zoo.py --models bert --extra int8_tables,no_refine  # rows beside the default

Random weights, nothing downloaded. Per model: batch norm statistics warmed on data, 16
calibration batches, 8 held-out inputs. Columns: input-dependent SQNR of the outputs against
float (the per-position mean over the held-out inputs is removed from the signal first: with
random weights most of an output does not depend on the input), latency ratio to float on one
thread (interleaved rounds, medians of wall-clock and of thread CPU time), the aten ops the
lowered graph still computes in float, and the size of the saved ``.pt2`` against the float
weights at one byte each (``saved_size.py``: its tensors and graph description apart).
Recurrent models run in whole and cells mode; non-recurrent ones also through torchao's
X86InductorQuantizer + prepare_pt2e/convert_pt2e + torch.compile (the anchor).
Install the model libraries without pulling another torch: see benchmarks/README.md."""

from __future__ import annotations

import argparse
import collections
import sys
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from common import interleaved_times, load_note, one_thread
from saved_size import saved_size
from torch import nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._pytree import tree_leaves

import quantree as qt
from quantree.backends import CPU
from quantree.backends.cpu.passes.float_report import program_float_ops


def import_model_libraries() -> None:
    """torchvision/torchaudio wheels are CUDA builds whose C++ extensions do not load with
    the CPU torch; their model code is pure Python. torchvision registers fake kernels for
    nms/qnms unconditionally (so define the two schemas first); torchaudio loads its
    extension from ``torchaudio._extension`` (so put a stub saying "not available" there)."""
    if not hasattr(import_model_libraries, "keep"):
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import_model_libraries.keep = lib  # type: ignore[attr-defined]
    if "torchaudio" not in sys.modules:
        ext = types.ModuleType("torchaudio._extension")
        ext._IS_TORCHAUDIO_EXT_AVAILABLE = ext._IS_ALIGN_AVAILABLE = False  # type: ignore
        ext.fail_if_no_align = lambda fn: fn  # type: ignore[attr-defined]
        sys.modules["torchaudio._extension"] = ext


@dataclass
class Case:
    model: nn.Module
    sample: Callable[[torch.Generator], tuple]  # one argument tuple
    recurrent: bool = False


class First(nn.Module):
    """A model whose output is a dataclass or tuple, reduced to its first tensor."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        out = self.inner(*args)
        return out[0] if isinstance(out, tuple | list) else out.last_hidden_state


class Seq2Seq(nn.Module):
    """The textbook LSTM encoder-decoder, decoder teacher-forced one step at a time."""

    def __init__(self, vocab: int = 1000, emb: int = 128, hidden: int = 256) -> None:
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(vocab, emb), nn.Embedding(vocab, emb)
        self.encoder = nn.LSTM(emb, hidden, batch_first=True)
        self.decoder = nn.LSTM(emb, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        _, state = self.encoder(self.src_emb(src))
        outs = []
        for t in range(tgt.shape[1]):
            y, state = self.decoder(self.tgt_emb(tgt[:, t : t + 1]), state)
            outs.append(self.out(y))
        return torch.cat(outs, 1)


def randn(*shape: int) -> Callable[[torch.Generator], tuple]:
    return lambda g: (torch.randn(*shape, generator=g),)


def tokens(vocab: int, *shape: int) -> Callable[[torch.Generator], tuple]:
    return lambda g: (torch.randint(0, vocab, shape, generator=g),)


def tacotron2(packed: bool) -> Case:
    from torchaudio.models import Tacotron2

    model = Tacotron2(n_mels=80, decoder_early_stopping=False)
    if not packed:  # one full-length sequence: packing is the identity, removed

        def forward(self, x, input_lengths):
            for conv in self.convolutions:
                x = torch.relu(conv(x))
            return self.lstm(x.transpose(1, 2))[0]

        model.encoder.forward = types.MethodType(forward, model.encoder)
    n_tok, n_frames = 24, 16

    def sample(g):
        return (
            torch.randint(1, 148, (1, n_tok), generator=g),
            torch.tensor([n_tok]),
            torch.randn(1, 80, n_frames, generator=g),
            torch.tensor([n_frames]),
        )

    return Case(First(model), sample, recurrent=True)


def rnnt(predictor_only: bool) -> Case:
    from torchaudio.models import emformer_rnnt_model

    model = emformer_rnnt_model(
        input_dim=80, encoding_dim=256, num_symbols=128, segment_length=16,
        right_context_length=4, time_reduction_input_dim=128, time_reduction_stride=4,
        transformer_num_heads=4, transformer_ffn_dim=512, transformer_num_layers=2,
        transformer_dropout=0.0, transformer_activation="gelu",
        transformer_left_context_length=30, transformer_max_memory_size=0,
        transformer_weight_init_scale_strategy="depthwise", transformer_tanh_on_mem=True,
        symbol_embedding_dim=256, num_lstm_layers=2, lstm_layer_norm=True,
        lstm_layer_norm_epsilon=1e-5, lstm_dropout=0.0,
    )  # fmt: skip
    if predictor_only:
        return Case(
            First(model.predictor),
            lambda g: (torch.randint(0, 128, (1, 16), generator=g), torch.tensor([16])),
            recurrent=True,
        )

    def sample(g):
        return (
            torch.randn(1, 64 + 4 * 4, 80, generator=g),
            torch.tensor([64 + 4 * 4]),
            torch.randint(0, 128, (1, 8), generator=g),
            torch.tensor([8]),
        )

    return Case(First(model), sample, recurrent=True)


class CRNN(nn.Module):
    """The text-recognition CRNN (Shi et al.): a VGG-style conv front with batch norm and max
    pooling that folds the image height away, a 2-layer bidirectional GRU over the width, a
    per-column classifier and log-softmax (CTC-ready), written in plain torch as deployed."""

    def __init__(self, classes: int = 37, hidden: int = 128) -> None:
        super().__init__()

        def block(cin: int, cout: int, pool: tuple[int, int] | None) -> list[nn.Module]:
            layers: list[nn.Module] = [
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
            ]
            return layers + ([nn.MaxPool2d(pool, pool)] if pool else [])

        self.features = nn.Sequential(
            *block(1, 32, (2, 2)), *block(32, 64, (2, 2)), *block(64, 128, None),
            *block(128, 128, (2, 1)), *block(128, 256, (4, 1)),
        )  # fmt: skip
        self.rnn = nn.GRU(256, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        columns = self.features(image).squeeze(2).transpose(1, 2)  # [batch, width, channels]
        return self.head(self.rnn(columns)[0]).log_softmax(-1)


def conformer() -> Case:
    """torchaudio's Conformer (the ASR encoder: feed-forward halves, attention with a padding
    mask built from the lengths, depthwise conv module with batch norm and GLU, layer norms)."""
    from torchaudio.models import Conformer

    model = Conformer(
        input_dim=80, num_heads=4, ffn_dim=256, num_layers=2, depthwise_conv_kernel_size=15
    )
    n_frames = 100
    return Case(
        First(model),
        lambda g: (torch.randn(1, n_frames, 80, generator=g), torch.tensor([n_frames])),
    )


def build(name: str) -> Case:
    import_model_libraries()
    if name in ("resnet18", "mobilenet_v2", "squeezenet"):
        import torchvision

        ctor = {"squeezenet": torchvision.models.squeezenet1_1}.get(name)
        return Case((ctor or getattr(torchvision.models, name))(), randn(1, 3, 224, 224))
    if name in ("efficientnet_b0", "mobilevitv2_050", "convnext_atto", "vit_tiny"):
        import timm

        arch = {"vit_tiny": "vit_tiny_patch16_224"}.get(name, name)
        size = 256 if name == "mobilevitv2_050" else 224  # timm's default input sizes
        return Case(timm.create_model(arch, pretrained=False), randn(1, 3, size, size))
    if name == "crnn":
        return Case(CRNN(), randn(1, 1, 32, 128), recurrent=True)
    if name == "conformer":
        return conformer()
    if name == "bert":
        from transformers import BertConfig, BertModel

        cfg = BertConfig(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=512, attn_implementation="eager",
        )  # fmt: skip
        return Case(First(BertModel(cfg)), tokens(cfg.vocab_size, 1, 128))
    if name == "distilbert":  # accuracy_algorithms.py's hidden DistilBERT (issue 27)
        from transformers import DistilBertConfig, DistilBertModel

        cfg = DistilBertConfig(vocab_size=1000, dim=128, n_layers=2, n_heads=4, hidden_dim=512)
        return Case(First(DistilBertModel(cfg)), tokens(cfg.vocab_size, 2, 32))
    if name == "gpt2":
        from transformers import GPT2Config, GPT2Model

        cfg = GPT2Config(n_embd=128, n_layer=2, n_head=2, attn_implementation="eager")
        return Case(First(GPT2Model(cfg)), tokens(cfg.vocab_size, 1, 128))
    if name == "transformer_encoder":
        layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
        return Case(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), randn(1, 64, 128))
    if name == "deepspeech":
        from torchaudio.models import DeepSpeech

        return Case(DeepSpeech(n_feature=40, n_hidden=512), randn(1, 1, 100, 40), recurrent=True)
    if name == "wavernn":
        from torchaudio.models import WaveRNN

        model = WaveRNN([5, 5, 8], n_classes=256, hop_length=200, n_rnn=256, n_fc=256)
        n_time = 10
        return Case(
            model,
            lambda g: (
                torch.randn(1, 1, (n_time - 4) * 200, generator=g),
                torch.randn(1, 1, 128, n_time, generator=g),
            ),
            recurrent=True,
        )
    if name == "wav2letter":
        from torchaudio.models import Wav2Letter

        return Case(Wav2Letter(40, "mfcc", 40), randn(1, 40, 200))
    if name == "tacotron2":
        return tacotron2(packed=True)
    if name == "tacotron2_unpacked":
        return tacotron2(packed=False)
    if name == "rnnt":
        return rnnt(predictor_only=False)
    if name == "rnnt_predictor":
        return rnnt(predictor_only=True)
    if name == "seq2seq":
        return Case(
            Seq2Seq(),
            lambda g: tuple(torch.randint(0, 1000, (1, n), generator=g) for n in (32, 16)),
            recurrent=True,
        )
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


MODELS = (
    *("resnet18", "mobilenet_v2", "squeezenet", "efficientnet_b0", "bert", "gpt2"),
    *("transformer_encoder", "deepspeech", "wavernn", "wav2letter", "tacotron2"),
    *("tacotron2_unpacked", "rnnt", "rnnt_predictor", "seq2seq"),
    *("mobilevitv2_050", "convnext_atto", "vit_tiny", "conformer", "crnn", "distilbert"),
)

# aten ops that only move or view data: not counted as "left in float"
SHAPE_OPS = {
    *("view", "reshape", "permute", "transpose", "t", "expand", "expand_as", "unsqueeze"),
    *("squeeze", "flatten", "unflatten", "contiguous", "clone", "slice", "select", "alias"),
    *("_unsafe_view", "detach", "detach_", "dropout", "dropout_", "copy_", "lift_fresh_copy"),
    *("split", "split_with_sizes", "chunk", "unbind", "to", "_to_copy", "zeros", "ones", "full"),
    *("arange", "new_zeros", "new_ones", "scalar_tensor"),
}


def warm_batch_norm(model: nn.Module, case: Case, gen: torch.Generator) -> None:
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average
    model.train()
    with torch.no_grad():
        for _ in range(8):
            model(*case.sample(gen))
    model.eval()


def flat(out: object) -> torch.Tensor:
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return torch.cat([t.detach().reshape(-1).float() for t in leaves])


def outputs(model: Callable, held: list[tuple]) -> list[torch.Tensor]:
    """The model's outputs on the held-out inputs, the random generator seeded alike before
    each call: Tacotron2's prenet applies dropout even in eval mode, and the captured graph
    draws the same masks as the float model only from the same seed."""
    got = []
    with torch.no_grad():
        for i, args in enumerate(held):
            torch.manual_seed(1000 + i)
            got.append(flat(model(*args)))
    return got


def input_dependent_sqnr(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    r, q = torch.stack(ref), torch.stack(got)
    signal = (r - r.mean(0, keepdim=True)).pow(2).sum()
    noise = (r - q).pow(2).sum().clamp_min(1e-30)
    return float(10 * torch.log10(signal / noise))


def float_ops(gm: nn.Module) -> collections.Counter:
    """aten ops of a lowered graph (and its submodules) whose output is a float tensor,
    those a native region program computes in float counted as ``op (in program)``."""
    found: collections.Counter = collections.Counter()
    for mod in gm.modules():
        graph = getattr(mod, "graph", None)
        for node in graph.nodes if isinstance(graph, torch.fx.Graph) else ():
            for op in program_float_ops(node):  # float still, inside one native call
                found[op.target.split(".")[1] + " (in program)"] += 1
            target = node.target
            if node.op == "call_function" and target == torch.ops.quantree.group_norm.default:
                found["group_norm (native float)"] += 1
            if node.op != "call_function" or getattr(target, "namespace", "") != "aten":
                continue
            name = target.__name__.split(".")[0]
            val = node.meta.get("val")
            if name not in SHAPE_OPS and isinstance(val, torch.Tensor) and val.is_floating_point():
                found[name] += 1
    return found


def one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".strip().splitlines()[0][:160]


EXTRA_VARIANTS: dict[str, tuple[dict, qt.Refine | str | None]] = {
    "int8_tables": ({"embedding_dtype": qt.QDtype.INT8}, "auto"),  # the default before h-embed27
    "refine": ({}, qt.Refine()),  # qt.refine with default Refine() after convert, on any graph
    "no_refine": ({}, None),  # never refined (the default before h-zoo27 on transformers)
    "int16_conv1d": ({"conv1d_weight_dtype": qt.QDtype.INT16}, "auto"),  # the default (h-bias32)
    "int8_conv1d": ({"conv1d_weight_dtype": qt.QDtype.INT8}, "auto"),  # the default before h-bias32
    "minmax": ({"activation_observer": qt.ObserverKind.MINMAX}, "auto"),  # before h-acc27's search
    "weight_search": ({"weight_observer": qt.ObserverKind.SEARCH}, "auto"),  # per-channel search
}
"""Rows ``--extra`` adds beside the default quantree row: Int8Quantizer options, and
``qt.quantize``'s ``refine`` (``"auto"``: its default, refined where the graph is
transformer-like)."""


def quantree_variant(
    case: Case,
    calib: list[tuple],
    mode: qt.RecurrentMode,
    options: dict | None = None,
    refine: qt.Refine | str | None = "auto",
):
    start = time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", qt.QuantreeWarning)
        lowered = qt.quantize(
            case.model, calib[0], calib,
            quantizer=qt.Int8Quantizer(recurrent=mode, **(options or {})),
            backend=CPU, progress=False, refine=refine,
        )  # fmt: skip
    seconds = time.process_time() - start
    notes = [str(w.message) for w in caught if issubclass(w.category, qt.QuantreeWarning)]
    try:
        size = saved_size(case.model, lowered, calib[0]).render()
    except Exception as err:  # a lowered model that does not save is a result, not a crash
        size = f"save fails: {one_line(err)}"
    return lowered, float_ops(lowered), notes, size, seconds


def unshare_activation_partitions(gm: torch.fx.GraphModule) -> None:
    """torchao 0.18's X86InductorQuantizer refuses one activation module called twice
    (resnet's shared relu: "Input partition has more than one output node"); give each call
    its own source name so every call is its own partition."""
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op == "call_function" and stack:
            key, (fqn, cls) = list(stack.items())[-1]
            if "activation" in str(cls):
                stack[key] = (f"{fqn}@{node.name}", cls)


def drop_dead_code(gm: torch.fx.GraphModule) -> None:
    """torchao 0.18's X86InductorQuantizer fails with an IndexError in
    ``_get_output_nodes_of_partitions`` (``partition.output_nodes[0]``) on a linear -> activation
    pair whose activation nothing reads: BERT's pooler ``tanh`` once ``First`` keeps only
    ``last_hidden_state``. A partition without users has no output node, so drop dead nodes."""
    gm.graph.eliminate_dead_code()
    gm.recompile()


def conv1d_as_linear(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` with Hugging Face's ``Conv1D`` (GPT-2's projections, ``addmm`` on an
    ``[in, out]`` weight) replaced by the equal ``nn.Linear``; None when it has none.

    X86InductorQuantizer annotates ``nn.Linear`` only, so on GPT-2 as shipped it quantizes
    nothing but two ``mul``s per block: its row is then nearly the float model's accuracy.
    This copy gives the anchor the same layers to quantize as quantree."""
    import copy

    if not any(type(m).__name__ == "Conv1D" for m in model.modules()):
        return None
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "Conv1D":
                nx, nf = child.weight.shape
                linear = nn.Linear(nx, nf)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(parent, name, linear)
    return model.eval()


class Conv1dAsConv2d(nn.Module):
    """``nn.Conv1d`` computed as the ``nn.Conv2d`` of height 1 on the same weights."""

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        assert isinstance(conv.padding, tuple)  # a string padding has no conv2d twin here
        self.conv = nn.Conv2d(
            conv.in_channels, conv.out_channels, (1, conv.kernel_size[0]),
            stride=(1, conv.stride[0]), padding=(0, conv.padding[0]),
            dilation=(1, conv.dilation[0]), groups=conv.groups, bias=conv.bias is not None,
        )  # fmt: skip
        with torch.no_grad():
            self.conv.weight.copy_(conv.weight.unsqueeze(2))
            if conv.bias is not None:
                self.conv.bias.copy_(conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.unsqueeze(2)).squeeze(2)


def conv1d_as_conv2d(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` with each ``nn.Conv1d`` run as a ``Conv2d`` of height 1; None when
    it has none or the graph is not transformer-like.

    X86InductorQuantizer annotates ``conv2d`` and ``linear`` only, so on Conformer it leaves
    the convolution module (pointwise, depthwise, pointwise) float, which quantree quantizes.
    This copy gives the anchor the same layers to quantize. CNN-only models (Wav2Letter) are
    left as they are: their rows compare speed, not accuracy."""
    import copy

    if not any(isinstance(m, nn.Conv1d) for m in model.modules()):
        return None
    if not any(isinstance(m, nn.LayerNorm | nn.MultiheadAttention) for m in model.modules()):
        return None
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Conv1d):
                setattr(parent, name, Conv1dAsConv2d(child))
    return model.eval()


def torchao_variant(case: Case, calib: list[tuple]):
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = xiq.X86InductorQuantizer().set_global(
        xiq.get_default_x86_inductor_quantization_config()
    )
    try:
        gm = torch.export.export(case.model, calib[0]).module()
    except GuardOnDataDependentSymNode:  # Conformer's int(lengths.max()): as quantree does
        gm = torch.export.draft_export(case.model, calib[0]).module()
    unshare_activation_partitions(gm)
    drop_dead_code(gm)
    prepared = prepare_pt2e(gm, quantizer)
    with torch.no_grad():
        for args in calib:
            prepared(*args)
    return torch.compile(convert_pt2e(prepared)), None, [], None, None


def run_model(name: str, args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    try:
        case = build(name)
    except Exception as err:  # a model the installed library cannot construct
        return [{"model": name, "variant": "-", "error": one_line(err)}]
    case.model.eval()
    warm_batch_norm(case.model, case, gen)
    calib = [case.sample(gen) for _ in range(16)]
    held = [case.sample(gen) for _ in range(8)]
    ref = outputs(case.model, held)
    whole = "quantree whole" if case.recurrent else "quantree"
    variants = {whole: lambda: quantree_variant(case, calib, qt.RecurrentMode.WHOLE)}
    for extra in filter(None, getattr(args, "extra", "").split(",")):
        opts, refine = EXTRA_VARIANTS[extra]
        variants[f"{whole} ({extra})"] = lambda o=opts, r=refine: quantree_variant(
            case, calib, qt.RecurrentMode.WHOLE, o, r
        )
    if case.recurrent:
        variants["quantree cells"] = lambda: quantree_variant(case, calib, qt.RecurrentMode.CELLS)
    if args.anchor == "all" or (args.anchor == "auto" and not case.recurrent):
        variants["torchao+inductor"] = lambda: torchao_variant(case, calib)
        as_linear = conv1d_as_linear(case.model)
        if as_linear is not None:
            relinked = Case(as_linear, case.sample, case.recurrent)
            variants["torchao+inductor, Conv1D as Linear"] = lambda: torchao_variant(
                relinked, calib
            )
        as_conv2d = conv1d_as_conv2d(case.model)
        if as_conv2d is not None:
            twin = Case(as_conv2d, case.sample, case.recurrent)
            variants["torchao+inductor, conv1d as conv2d"] = lambda: torchao_variant(twin, calib)
    rows, timed = [], {"float": lambda: case.model(*held[0])}
    for variant, make in variants.items():
        row: dict = {"model": name, "variant": variant}
        rows.append(row)
        try:
            qmodel, left, notes, row["size"], row["quantize_s"] = make()
            with torch.no_grad():
                row["sqnr"] = input_dependent_sqnr(ref, outputs(qmodel, held))
        except Exception as err:
            row["error"] = one_line(err)
            continue
        row["left"], row["notes"] = left, notes
        timed[variant] = lambda q=qmodel: q(*held[0])
    if len(timed) > 1 and args.runs > 0:
        ms = interleaved_times(timed, args.runs, warmup=3)
        for row in rows:
            if row["variant"] in ms:
                (row["float_ms"], row["float_cpu"]), (row["ms"], row["cpu"]) = (
                    ms["float"],
                    ms[row["variant"]],
                )
    return rows


def render(rows: list[dict]) -> str:
    lines = [
        "| model | variant | ratio to float (ms) | CPU-time ratio | input-dep. SQNR "
        "| ops left in float (lowered) | saved size (x int8 weight bytes) | quantize (CPU s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['variant']} | fails: {r['error']} | | | | | |")
            continue
        timed = "ms" in r
        ratio = "not timed"
        if timed:
            ratio = f"{r['ms'] / r['float_ms']:.2f}x ({r['ms']:.1f} / {r['float_ms']:.1f})"
        left = r.get("left") or {}
        ops = ", ".join(f"{k} {v}" for k, v in left.most_common()) if left else "none"
        ops = "n/a" if r.get("left") is None else f"{sum(left.values())}: {ops}"
        cpu = f"{r['cpu'] / r['float_cpu']:.2f}x" if timed else "-"
        size = r.get("size") or "n/a"
        secs = "-" if r.get("quantize_s") is None else f"{r['quantize_s']:.1f}"
        lines.append(
            f"| {r['model']} | {r['variant']} | {ratio} | {cpu} | {r['sqnr']:.1f} dB | {ops} "
            f"| {size} | {secs} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument(
        "--runs", type=int, default=20, help="timed interleaved rounds (0: not timed)"
    )
    parser.add_argument("--anchor", choices=("auto", "all", "none"), default="auto")
    parser.add_argument(
        "--extra", default="", help=f"extra quantree rows: {', '.join(EXTRA_VARIANTS)}"
    )
    parser.add_argument("--warnings", action="store_true", help="print QuantreeWarnings")
    args = parser.parse_args()
    one_thread()
    warnings.filterwarnings("ignore", category=UserWarning)
    run_all(args)


def run_all(args: argparse.Namespace, note_chars: int | None = None) -> None:
    """Every model of ``args.models``, each row said as it is measured, then the table."""
    rows = []
    for name in args.models.split(","):
        print(f"# {name}", file=sys.stderr, flush=True)
        model_rows = run_model(name.strip(), args)
        rows += model_rows
        for r in model_rows:
            for note in r.get("notes", []) if args.warnings else []:
                print(f"  {r['variant']}: {note[:note_chars]}", file=sys.stderr)
        print("\n".join(render(model_rows).splitlines()[2:]), file=sys.stderr, flush=True)
    print(f"\n{load_note()}, torch {torch.__version__}, one thread\n")
    print(render(rows))


if __name__ == "__main__":
    main()
