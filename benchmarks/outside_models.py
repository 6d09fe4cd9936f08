"""Outside models: the README's quickstart, step by step, on models the zoo does not hold.

    python benchmarks/outside_models.py                   # every model, one process each
    python benchmarks/outside_models.py --models densenet121,t5 --runs 5

Random weights, nothing downloaded. Each model runs in its own process (a native crash or a
leak fails that row, not the sweep) through what an outside user would call: ``qt.capture``,
``qt.prepare`` with the default ``Int8Quantizer``, ``qt.calibrate``, ``qt.convert``,
``qt.lower(ref, CPU)``, ``backends.save``/``load`` (the loaded outputs must equal the lowered
ones), ``qt.export_onnx`` of the reference graph and ``inspection.summary`` (``quantree
inspect``). Columns: the first step that failed, input-dependent SQNR of the lowered outputs
against float (as ``zoo.py``), ratio of median thread-CPU time to float (interleaved, few
runs: a smoke test for "slower than float", not a benchmark), and the aten ops the lowered
graph still computes in float. ``--anchor`` adds torchao + Inductor (``zoo.py``'s anchor, its
torchao 0.18 workarounds included) on the CNN rows (``--anchor all``: every non-recurrent
row), timed in the same interleaved rounds, with its SQNR."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import interleaved_times, load_note, one_thread  # noqa: E402
from outside_round2 import BUILDERS2, FAMILIES2, SLOW2  # noqa: E402
from zoo import (  # noqa: E402
    Case,
    First,
    float_ops,
    import_model_libraries,
    input_dependent_sqnr,
    outputs,
    randn,
    tokens,
    torchao_variant,
    warm_batch_norm,
)


class Hidden(nn.Module):
    """A Hugging Face model called with keyword inputs, reduced to its first output tensor."""

    def __init__(self, inner: nn.Module, *names: str) -> None:
        super().__init__()
        self.inner, self.names = inner, names

    def forward(self, *args):
        out = self.inner(**dict(zip(self.names, args, strict=True)), use_cache=False)
        return out[0]


class HiddenNoCache(Hidden):
    def forward(self, *args):
        return self.inner(**dict(zip(self.names, args, strict=True)))[0]


class Packed(nn.Module):
    """A bidirectional GRU over a padded batch of different lengths, packed and unpacked."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(32, 48, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(96, 10)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
        out, _ = self.gru(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.head(out)


class Recurrent(nn.Module):
    """A plain recurrent layer and a linear head, the layer's final state returned too."""

    def __init__(self, layer: nn.Module, width: int) -> None:
        super().__init__()
        self.layer, self.head = layer, nn.Linear(width, 16)

    def forward(self, x: torch.Tensor):
        out, state = self.layer(x)
        return self.head(out), state


def hf(name: str) -> Case:
    import transformers as tf

    small = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
    small["intermediate_size"] = 256
    seq = (1, 64)
    if name == "distilbert":
        cfg = tf.DistilBertConfig(dim=128, n_layers=2, n_heads=4, hidden_dim=256)
        return Case(HiddenNoCache(tf.DistilBertModel(cfg), "input_ids"), tokens(30522, *seq))
    if name == "roberta":
        cfg = tf.RobertaConfig(**small)
        return Case(Hidden(tf.RobertaModel(cfg), "input_ids"), tokens(cfg.vocab_size, *seq))
    if name == "albert":
        cfg = tf.AlbertConfig(embedding_size=64, **small)
        return Case(HiddenNoCache(tf.AlbertModel(cfg), "input_ids"), tokens(cfg.vocab_size, *seq))
    if name in ("llama", "mistral"):
        config = tf.LlamaConfig if name == "llama" else tf.MistralConfig
        cfg = config(vocab_size=1000, num_key_value_heads=2, **small)
        model = (tf.LlamaModel if name == "llama" else tf.MistralModel)(cfg)
        return Case(Hidden(model, "input_ids"), tokens(1000, *seq))
    if name in ("t5", "bart"):
        if name == "t5":
            cfg = tf.T5Config(
                vocab_size=1000, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4
            )
            model = tf.T5Model(cfg)
        else:
            cfg = tf.BartConfig(
                vocab_size=1000, d_model=128, encoder_layers=2, decoder_layers=2,
                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
                decoder_ffn_dim=256,
            )  # fmt: skip
            model = tf.BartModel(cfg)

        def pair(g):
            return (
                torch.randint(0, 1000, (1, 48), generator=g),
                torch.randint(0, 1000, (1, 16), generator=g),
            )

        return Case(Hidden(model, "input_ids", "decoder_input_ids"), pair)
    if name == "whisper":
        cfg = tf.WhisperConfig(
            vocab_size=1000, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
            decoder_ffn_dim=256, max_source_positions=100, max_target_positions=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        )  # fmt: skip

        def audio(g):
            return (
                torch.randn(1, 80, 200, generator=g),
                torch.randint(0, 1000, (1, 16), generator=g),
            )

        return Case(Hidden(tf.WhisperModel(cfg), "input_features", "decoder_input_ids"), audio)
    if name == "hf_wav2vec2":
        cfg = tf.Wav2Vec2Config(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
            conv_dim=(64, 64, 64), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        )  # fmt: skip
        return Case(HiddenNoCache(tf.Wav2Vec2Model(cfg), "input_values"), randn(1, 8000))
    raise KeyError(name)


def torchvision_model(name: str) -> Case:
    import torchvision.models as tvm

    if name == "googlenet":
        return Case(tvm.googlenet(aux_logits=False, init_weights=True), randn(1, 3, 224, 224))
    if name == "inception_v3":
        model = tvm.inception_v3(aux_logits=False, init_weights=True)
        return Case(model, randn(1, 3, 299, 299))
    if name == "vit_small":  # vit_b_16's architecture, 4 layers of width 192
        from torchvision.models.vision_transformer import VisionTransformer

        model = VisionTransformer(224, 16, num_layers=4, num_heads=3, hidden_dim=192, mlp_dim=768)
        return Case(model, randn(1, 3, 224, 224))
    if name == "swin_small":  # swin_t's blocks, fewer and narrower
        from torchvision.models.swin_transformer import SwinTransformer

        model = SwinTransformer([4, 4], 48, [2, 2, 2, 2], [3, 6, 12, 24], [7, 7])
        return Case(model, randn(1, 3, 224, 224))
    ctor = getattr(tvm, name)
    return Case(ctor(), randn(1, 3, 224, 224))


def torchaudio_model(name: str) -> Case:
    import torchaudio.models as tam

    if name == "ta_wav2vec2":
        model = tam.wav2vec2_model(
            extractor_mode="group_norm", extractor_conv_layer_config=[(64, 10, 5), (64, 3, 2)],
            extractor_conv_bias=False, encoder_embed_dim=128, encoder_projection_dropout=0.0,
            encoder_pos_conv_kernel=16, encoder_pos_conv_groups=4, encoder_num_layers=2,
            encoder_num_heads=4, encoder_attention_dropout=0.0, encoder_ff_interm_features=256,
            encoder_ff_interm_dropout=0.0, encoder_dropout=0.0, encoder_layer_norm_first=False,
            encoder_layer_drop=0.0, aux_num_out=None,
        )  # fmt: skip
        return Case(First(model), randn(1, 8000))
    if name == "convtasnet":
        model = tam.ConvTasNet(
            num_sources=2, enc_kernel_size=16, enc_num_feats=128, msk_kernel_size=3,
            msk_num_feats=64, msk_num_hidden_feats=128, msk_num_layers=4, msk_num_stacks=2,
        )  # fmt: skip
        return Case(model, randn(1, 1, 8000))
    if name == "emformer":
        model = tam.Emformer(
            input_dim=128, num_heads=4, ffn_dim=256, num_layers=2, segment_length=16,
            right_context_length=4,
        )  # fmt: skip
        return Case(
            First(model),
            lambda g: (torch.randn(1, 64 + 4, 128, generator=g), torch.tensor([64 + 4])),
        )
    if name == "hdemucs":
        model = tam.HDemucs(sources=["a", "b"], channels=16, depth=4, nfft=1024)
        return Case(model, randn(1, 2, 16384))
    raise KeyError(name)


def timm_model(name: str) -> Case:
    import timm

    model = timm.create_model(name, pretrained=False)
    size = model.default_cfg.get("input_size", (3, 224, 224))
    batch = 2 if name.startswith("levit") else 1  # its head's BatchNorm1d warms on 2 rows
    return Case(model, randn(batch, *size))


def plain(name: str) -> Case:
    if name == "lstm_proj":
        layer = nn.LSTM(40, 128, num_layers=2, proj_size=32, batch_first=True)
        return Case(Recurrent(layer, 32), randn(4, 50, 40), recurrent=True)
    if name == "gru_packed":

        def sample(g):
            return torch.randn(4, 30, 32, generator=g), torch.tensor([30, 24, 17, 9])

        return Case(Packed(), sample, recurrent=True)
    if name in ("rnn_tanh", "rnn_relu"):
        layer = nn.RNN(40, 96, num_layers=2, nonlinearity=name[4:], bidirectional=True)
        return Case(Recurrent(layer, 192), randn(50, 4, 40), recurrent=True)
    raise KeyError(name)


FAMILIES = {
    "torchvision": (
        "shufflenet_v2_x1_0", "regnet_y_400mf", "densenet121", "mnasnet0_5", "googlenet",
        "inception_v3", "efficientnet_v2_s", "resnext50_32x4d", "mobilenet_v3_small",
        "vit_small", "swin_small",
    ),
    "timm": ("ghostnet_100", "levit_128s", "mixer_s16_224", "poolformer_s12"),
    "hf": (
        "distilbert", "roberta", "albert", "t5", "bart", "whisper", "hf_wav2vec2", "llama",
        "mistral",
    ),
    "torchaudio": ("ta_wav2vec2", "convtasnet", "emformer", "hdemucs"),
    "plain": ("lstm_proj", "gru_packed", "rnn_tanh", "rnn_relu"),
}  # fmt: skip
BUILDERS = {"torchvision": torchvision_model, "timm": timm_model, "hf": hf}
BUILDERS |= {"torchaudio": torchaudio_model, "plain": plain}
FAMILIES |= FAMILIES2  # round 2 (benchmarks/outside_round2.py)
BUILDERS |= BUILDERS2
MODELS = tuple(name for names in FAMILIES.values() for name in names)
CNNS = (
    *FAMILIES["torchvision"][:9],
    *("ghostnet_100", "levit_128s", "poolformer_s12"),
)
"""The rows issue 10's "within 1.3x of torchao + Inductor" applies to (convolutional image
models; LeViT and PoolFormer are convolutional hybrids)."""


def build(name: str) -> Case:
    import_model_libraries()
    slow = {family: names for family, names in SLOW2.items()}
    for family, names in [*FAMILIES.items(), *slow.items()]:
        if name in names:
            case = BUILDERS[family](name)
            for module in case.model.modules():  # classifier heads some libraries zero:
                if isinstance(module, nn.Linear) and not module.weight.any():  # no signal
                    nn.init.normal_(module.weight, std=0.02)
            return case
    others = ", ".join(n for names in SLOW2.values() for n in names)
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}, {others}")


def where(err: BaseException) -> str:
    """The innermost frame of quantree's own code the error passed through, if any."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/quantree/" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename.split('/quantree/')[-1]}:{f.lineno}"


def describe(err: BaseException) -> str:
    import quantree as qt

    kind = "QuantreeError" if isinstance(err, qt.QuantreeError) else type(err).__name__
    text = " ".join(str(err).split())[:300]
    at = where(err)
    return f"{kind}: {text}" + (f" [{at}]" if at and kind != "QuantreeError" else "")


def anchor_variant(case: Case, calib: list[tuple], held: list[tuple], ref_out: list) -> tuple:
    """torchao + Inductor on the same calibration batches, compiled and warmed (the first
    calls compile for minutes: outside the timed rounds), and its input-dependent SQNR."""
    compiled = torchao_variant(case, calib)[0]
    with torch.inference_mode():  # the timed rounds' grad mode: compile for it here
        compiled(*held[0])
    return compiled, input_dependent_sqnr(ref_out, outputs(compiled, held))


def run_one(
    name: str, mode_name: str, runs: int, calib_n: int, held_n: int, anchor: bool = False
) -> dict:
    import quantree as qt
    from quantree.backends import CPU, load, save
    from quantree.tools.inspection import summary

    one_thread()
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    mode = qt.RecurrentMode.CELLS if mode_name == "cells" else qt.RecurrentMode.WHOLE
    row: dict = {"model": name, "mode": mode_name}
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    step, times, mark = "build", {}, [time.perf_counter()]

    def at(name: str) -> str:
        now = time.perf_counter()
        times[step] = round(now - mark[0], 1)
        mark[0] = now
        return name

    try:
        case = build(name)
        case.model.eval()
        warm_batch_norm(case.model, case, gen)
        calib = [case.sample(gen) for _ in range(calib_n)]
        held = [case.sample(gen) for _ in range(held_n)]
        ref_out = outputs(case.model, held)
        started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", qt.QuantreeWarning)
            step = at("capture")
            gm = qt.capture(case.model, calib[0])
            step = at("prepare")
            prepared = qt.prepare(gm, qt.Int8Quantizer(recurrent=mode))
            step = at("calibrate")
            qt.calibrate(prepared, calib)
            step = at("convert")
            ref = qt.convert(prepared)
            step = at("lower")
            lowered = qt.lower(ref, CPU)
            step = at("run")
            got = outputs(lowered, held)
        row["quantize_s"] = time.perf_counter() - started
        row["notes"] = [
            " ".join(str(w.message).split())[:400]
            for w in caught
            if issubclass(w.category, qt.QuantreeWarning)
        ]
        row["sqnr"] = input_dependent_sqnr(ref_out, got)
        row["sqnr_ref"] = input_dependent_sqnr(ref_out, outputs(ref, held))
        row["left"] = dict(float_ops(lowered).most_common())
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "model.pt2"
            step = at("save")
            save(lowered, path, calib[0])
            step = at("load")
            loaded = load(path)
            again = outputs(loaded, held)
            row["loaded_equal"] = all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
            step = at("inspect")
            module = torch.export.load(path).module()
            row["inspect_lines"] = len(summary(module, str(path)).splitlines())
            step = at("onnx")
            if mode_name == "cells" and not os.environ.get("OUTSIDE_ONNX_CELLS"):
                # cells mode exports unrolled: 100-200 cell bodies took the exporter > 6 min
                row["onnx"] = "skipped (cells mode exports unrolled)"
            else:
                try:
                    qt.export_onnx(ref, calib[0], Path(folder) / "model.onnx")
                    row["onnx"] = "ok"
                except Exception as err:
                    row["onnx"] = describe(err)
        args = held[0]
        timed = {"float": lambda: case.model(*args), "lowered": lambda: lowered(*args)}
        if anchor:
            step = at("anchor")
            try:
                compiled, row["anchor_sqnr"] = anchor_variant(case, calib, held, ref_out)
                timed["anchor"] = lambda: compiled(*args)
            except Exception as err:  # the anchor failing is a result of its own
                row["anchor_error"] = describe(err)
        step = at("time")
        if runs > 0:
            ms = interleaved_times(timed, runs, warmup=2)
            row["ms"], row["cpu"] = ms["lowered"]
            row["float_ms"], row["float_cpu"] = ms["float"]
            if "anchor" in ms:
                row["anchor_ms"], row["anchor_cpu"] = ms["anchor"]
        step = at("done")
    except Exception as err:
        row["error"] = describe(err)
        row["traceback"] = traceback.format_exc()[-4000:]
    row["step"], row["seconds"] = step, times
    row["load"] = load_note()
    return row


def anchor_cells(r: dict) -> str:
    """The torchao columns: its CPU-time ratio to float (wall), SQNR, and quantree's CPU time
    against its (the issue's bar: at most 1.3x)."""
    if "anchor_error" in r:
        return f"fails: {r['anchor_error'][:160]} | | "
    if "anchor_sqnr" not in r:
        return " | | "
    if "anchor_cpu" not in r:
        return f"not timed | {r['anchor_sqnr']:.1f} dB | "
    ratio = f"{r['anchor_cpu'] / r['float_cpu']:.2f}x ({r['anchor_ms'] / r['float_ms']:.2f}x)"
    return f"{ratio} | {r['anchor_sqnr']:.1f} dB | {r['cpu'] / r['anchor_cpu']:.2f}x"


def render(rows: list[dict], anchor: bool = False) -> str:
    head = "| model | mode | reaches | input-dep. SQNR (ref) | CPU-time ratio (wall) | save/load "
    head += "| ONNX | ops left in float |"
    if anchor:
        head += " torchao+inductor CPU-time ratio (wall) | torchao SQNR | quantree / torchao |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        extra = f" {anchor_cells(r)} |" if anchor else ""
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | fails at {r['step']}: {r['error']} "
                         f"| | | | | |{extra}")  # fmt: skip
            continue
        ratio = "not timed"
        if "cpu" in r:
            ratio = f"{r['cpu'] / r['float_cpu']:.2f}x ({r['ms'] / r['float_ms']:.2f}x)"
        left = r.get("left") or {}
        ops = f"{sum(left.values())}: " + ", ".join(f"{k} {v}" for k, v in left.items())
        saved = "equal" if r.get("loaded_equal") else "differs"
        onnx = r.get("onnx", "")
        onnx = onnx if onnx == "ok" or onnx.startswith("skipped") else "fails"
        lines.append(
            f"| {r['model']} | {r['mode']} | all | {r['sqnr']:.1f} dB ({r['sqnr_ref']:.1f}) "
            f"| {ratio} | {saved} | {onnx} | {ops if left else 'none'} |{extra}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--runs", type=int, default=5, help="interleaved timed rounds")
    parser.add_argument("--calibration", type=int, default=8, help="calibration batches")
    parser.add_argument("--held", type=int, default=4, help="held-out inputs for SQNR")
    parser.add_argument("--json", type=Path, help="also write every row (with tracebacks) here")
    parser.add_argument("--verbose", action="store_true", help="print warnings and tracebacks")
    parser.add_argument(
        "--anchor", nargs="?", const="cnn", choices=("cnn", "all"),
        help="also torchao + Inductor, timed in the same rounds: on the CNN rows (default), "
        "or on every non-recurrent row",
    )  # fmt: skip
    parser.add_argument("--one", help=argparse.SUPPRESS)  # name:mode, run in this process
    args = parser.parse_args()
    if args.one:
        name, mode = args.one.split(":")
        anchor = args.anchor == "all" and mode == "whole" and name not in FAMILIES["plain"]
        anchor = anchor or (args.anchor == "cnn" and name in CNNS)
        row = run_one(name, mode, args.runs, args.calibration, args.held, anchor)
        print(json.dumps(row))
        return
    rows = []
    for name in [n.strip() for n in args.models.split(",") if n.strip()]:
        recurrent = name in FAMILIES["plain"]
        for mode in ("whole", "cells") if recurrent else ("whole",):
            print(f"# {name} {mode} ({load_note()})", file=sys.stderr, flush=True)
            cmd = [sys.executable, __file__, "--one", f"{name}:{mode}", "--runs", str(args.runs)]
            cmd += ["--calibration", str(args.calibration), "--held", str(args.held)]
            cmd += ["--anchor", args.anchor] if args.anchor else []
            done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            try:
                row = json.loads(done.stdout.strip().splitlines()[-1])
            except (json.JSONDecodeError, IndexError):
                tail = (done.stderr or "").strip().splitlines()[-1:] or [""]
                row = {"model": name, "mode": mode, "step": "process", "traceback": done.stderr,
                       "error": f"exit status {done.returncode}: {tail[0][:200]}"}  # fmt: skip
            rows.append(row)
            if args.verbose:
                for note in row.get("notes", []):
                    print(f"  warning: {note}", file=sys.stderr)
                if "traceback" in row:
                    print(row["traceback"], file=sys.stderr)
                print(f"  seconds: {row.get('seconds')}", file=sys.stderr)
                if row.get("onnx", "ok") != "ok":
                    print(f"  onnx: {row['onnx']}", file=sys.stderr)
            print(render([row], bool(args.anchor)).splitlines()[-1], file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\n{load_note()}, torch {torch.__version__}, one thread\n")
    print(render(rows, bool(args.anchor)))


if __name__ == "__main__":
    main()
