"""Modern recurrences in the zoo: selective scans, linear recurrences, Python cell loops.

    python benchmarks/modern_zoo.py                       # every family
    python benchmarks/modern_zoo.py --models mamba,dprnn --runs 10

The families of issue 29, from the public libraries where they ship as pure PyTorch
(transformers' Mamba, Mamba-2, RecurrentGemma, xLSTM and Encodec, SpeechBrain's Light-GRU,
torchaudio's HDemucs), written here where none does (the dual-path RNN, the waveform U-Net):
small configs, random weights, nothing downloaded. Columns and method are ``zoo.py``'s (its
``run_model``): input-dependent SQNR against float, latency ratio to float on one thread
(interleaved rounds, wall and thread-CPU medians), the aten ops the lowered graph still
computes in float, and the torchao X86InductorQuantizer + Inductor anchor on every family.
Families holding ``nn.LSTM``/``nn.GRU`` also run in cells mode.

SpeechBrain imports only with ``hyperpyyaml`` beside it:
``pip install --no-deps speechbrain hyperpyyaml``.
"""

from __future__ import annotations

import argparse
import warnings
from collections import Counter
from collections.abc import Callable

import torch
import zoo
from common import one_thread
from torch import nn
from zoo import Case, First, import_model_libraries, randn, tokens

from quantree.backends.cpu.passes.float_report import float_ops as report_float_ops

SEQ = 64
"""Tokens (or frames) per example: the issue's scan latency bound is stated at 64."""


class Hidden(nn.Module):
    """A Hugging Face backbone's last hidden state, the cache off."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, use_cache=False).last_hidden_state


def mamba() -> Case:
    from transformers import MambaConfig, MambaModel

    cfg = MambaConfig(
        vocab_size=1000, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2,
        conv_kernel=4, use_cache=False,
    )  # fmt: skip
    return Case(Hidden(MambaModel(cfg)), tokens(1000, 1, SEQ))


def mamba2() -> Case:
    from transformers import Mamba2Config, Mamba2Model

    cfg = Mamba2Config(
        vocab_size=1000, hidden_size=64, num_heads=8, head_dim=16, n_groups=1, state_size=16,
        num_hidden_layers=2, expand=2, conv_kernel=4, chunk_size=16, use_cache=False,
    )  # fmt: skip
    return Case(Hidden(Mamba2Model(cfg)), tokens(1000, 1, SEQ))


def recurrent_gemma() -> Case:
    from transformers import RecurrentGemmaConfig, RecurrentGemmaModel

    cfg = RecurrentGemmaConfig(
        vocab_size=1000, hidden_size=64, lru_width=64, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=3,
        block_types=("recurrent", "recurrent", "attention"), attention_window_size=SEQ,
        conv1d_width=4, use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    return Case(Hidden(RecurrentGemmaModel(cfg)), tokens(1000, 1, SEQ))


def xlstm() -> Case:
    from transformers import xLSTMConfig, xLSTMModel

    cfg = xLSTMConfig(
        vocab_size=1000, hidden_size=64, num_heads=2, num_hidden_layers=2, num_blocks=2,
        chunk_size=16, mode="inference", chunkwise_kernel="chunkwise--native_autograd",
        sequence_kernel="native_sequence__native", step_kernel="native", use_cache=False,
        return_last_states=False,
    )  # fmt: skip
    return Case(Hidden(xLSTMModel(cfg)), tokens(1000, 1, SEQ))


def ligru() -> Case:
    from speechbrain.nnet.RNN import LiGRU

    feats = 40
    model = LiGRU(64, input_shape=(1, SEQ, feats), num_layers=2, bidirectional=True)
    return Case(First(model), randn(1, SEQ, feats))


class GlobalLayerNorm(nn.Module):
    """Asteroid's gLN: one mean and variance over channels and time, per-channel affine."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channels, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, channels, ...]
        dims = tuple(range(1, x.dim()))
        mean = x.mean(dims, keepdim=True)
        var = (x - mean).pow(2).mean(dims, keepdim=True)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return self.gamma.view(shape) * (x - mean) / (var + 1e-8).sqrt() + self.beta.view(shape)


class DualPathBlock(nn.Module):
    """One DPRNN block (Luo et al. 2020, asteroid's ``DPRNNBlock``): a BiLSTM along each
    chunk, then one across the chunks, each with a linear back to the channels, gLN and a
    residual."""

    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.intra = nn.LSTM(channels, hidden, batch_first=True, bidirectional=True)
        self.intra_linear = nn.Linear(2 * hidden, channels)
        self.intra_norm = GlobalLayerNorm(channels)
        self.inter = nn.LSTM(channels, hidden, batch_first=True, bidirectional=True)
        self.inter_linear = nn.Linear(2 * hidden, channels)
        self.inter_norm = GlobalLayerNorm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, channels, chunk, n_chunks]
        b, n, k, s = x.shape
        intra = x.permute(0, 3, 2, 1).reshape(b * s, k, n)
        intra = self.intra_linear(self.intra(intra)[0]).reshape(b, s, k, n).permute(0, 3, 2, 1)
        x = x + self.intra_norm(intra)
        inter = x.permute(0, 2, 3, 1).reshape(b * k, s, n)
        inter = self.inter_linear(self.inter(inter)[0]).reshape(b, k, s, n).permute(0, 3, 1, 2)
        return x + self.inter_norm(inter)


class DPRNN(nn.Module):
    """A dual-path RNN separator on a learned filterbank (asteroid's ``DPRNNTasNet`` shape):
    conv encoder, gLN, bottleneck, 50%-overlapping chunks (``unfold``), dual-path blocks,
    overlap-add (``fold``), sigmoid masks per source, transposed-conv decoder."""

    def __init__(self, sources: int = 2, filters: int = 64, channels: int = 32,
                 hidden: int = 32, chunk: int = 16, blocks: int = 2) -> None:  # fmt: skip
        super().__init__()
        self.sources, self.chunk = sources, chunk
        self.encoder = nn.Conv1d(1, filters, 16, stride=8, bias=False)
        self.norm = GlobalLayerNorm(filters)
        self.bottleneck = nn.Conv1d(filters, channels, 1)
        self.blocks = nn.Sequential(*(DualPathBlock(channels, hidden) for _ in range(blocks)))
        self.masks = nn.Conv2d(channels, sources * filters, 1)
        self.decoder = nn.ConvTranspose1d(filters, 1, 16, stride=8, bias=False)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:  # [batch, 1, samples]
        w = torch.relu(self.encoder(wave))  # [batch, filters, frames]
        b, f, frames = w.shape
        x = self.bottleneck(self.norm(w))
        step = self.chunk // 2
        chunks = nn.functional.unfold(
            x.unsqueeze(-1), (self.chunk, 1), padding=(self.chunk, 0), stride=(step, 1)
        )  # [batch, channels * chunk, n_chunks]
        x = chunks.reshape(b, -1, self.chunk, chunks.shape[-1])
        x = self.masks(torch.relu(self.blocks(x)))  # [batch, sources * filters, chunk, n]
        x = x.reshape(b * self.sources, f * self.chunk, -1)
        x = nn.functional.fold(
            x, (frames, 1), (self.chunk, 1), padding=(self.chunk, 0), stride=(step, 1)
        ).reshape(b, self.sources, f, frames)
        masked = (torch.sigmoid(x) * w.unsqueeze(1)).reshape(b * self.sources, f, frames)
        return self.decoder(masked).reshape(b, self.sources, -1)


class EncodecAutoencoder(nn.Module):
    """Encodec's encoder and decoder (SEANet convs, reflect padding, LSTMs), the residual
    vector quantizer between them left out: its codes are integers from an ``argmin``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import EncodecConfig, EncodecModel

        cfg = EncodecConfig(
            audio_channels=1, num_filters=8, hidden_size=32, upsampling_ratios=[4, 4, 2],
            num_lstm_layers=2, use_causal_conv=True, pad_mode="reflect", norm_type="weight_norm",
            codebook_dim=32,
        )  # fmt: skip
        model = EncodecModel(cfg)
        self.encoder, self.decoder = model.encoder, model.decoder

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(wave))


class WaveUNet(nn.Module):
    """Demucs (v2, Défossez et al. 2019) in small: the input normalised by its standard
    deviation, strided conv + GLU encoder layers, a BiLSTM bottleneck with a linear back,
    transposed-conv + GLU decoder layers with skip connections trimmed to length."""

    def __init__(self, sources: int = 2, channels: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.sources = sources
        self.encoder = nn.ModuleList()
        self.decoder = nn.ModuleList()
        cin = 1
        for i in range(depth):
            cout = channels * 2**i
            encode = [nn.Conv1d(cin, cout, 8, 4), nn.Conv1d(cout, 2 * cout, 1)]
            self.encoder.append(nn.ModuleList(encode))
            dec_out = sources if i == 0 else cin
            decode = [
                nn.Conv1d(cout, 2 * cout, 3, padding=1),
                nn.ConvTranspose1d(cout, dec_out, 8, 4),
            ]
            self.decoder.insert(0, nn.ModuleList(decode))
            cin = cout
        self.lstm = nn.LSTM(cin, cin, num_layers=2, bidirectional=True, batch_first=True)
        self.lstm_linear = nn.Linear(2 * cin, cin)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:  # [batch, 1, samples]
        mono = wave.mean(1, keepdim=True)
        mean, std = mono.mean(-1, keepdim=True), mono.std(-1, keepdim=True)
        x = (wave - mean) / (1e-5 + std)
        skips = []
        for conv, gate in self.encoder:
            x = nn.functional.glu(gate(torch.relu(conv(x))), dim=1)
            skips.append(x)
        x = self.lstm_linear(self.lstm(x.transpose(1, 2))[0]).transpose(1, 2)
        for i, (gate, up) in enumerate(self.decoder):
            skip = skips.pop()
            offset = (skip.shape[-1] - x.shape[-1]) // 2
            x = x + skip[..., offset : offset + x.shape[-1]]
            x = up(nn.functional.glu(gate(x), dim=1))
            if i < len(self.decoder) - 1:
                x = torch.relu(x)
        return x * std + mean


def hdemucs() -> Case:
    from torchaudio.models import HDemucs

    model = HDemucs(["drums", "rest"], audio_channels=1, channels=8, nfft=256, depth=3)
    return Case(model, randn(1, 1, 4096), recurrent=True)


def build(name: str) -> Case:
    import_model_libraries()
    builders = {
        "mamba": mamba, "mamba2": mamba2, "recurrent_gemma": recurrent_gemma, "xlstm": xlstm,
        "ligru": ligru,
        "dprnn": lambda: Case(DPRNN(), randn(1, 1, 8 * SEQ * 2), recurrent=True),
        "encodec": lambda: Case(EncodecAutoencoder(), randn(1, 1, 32 * SEQ), recurrent=True),
        "wave_unet": lambda: Case(WaveUNet(), randn(1, 1, 4 * 4 * 4 * SEQ), recurrent=True),
        "hdemucs": hdemucs,
    }  # fmt: skip
    if name not in builders:
        raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return builders[name]()


MODELS = ("mamba", "mamba2", "recurrent_gemma", "xlstm", "ligru", "dprnn", "encodec",
          "wave_unet", "hdemucs")  # fmt: skip


def with_dequantized_weights(count: Callable[[nn.Module], Counter]) -> Callable:
    """``zoo.float_ops`` with the float ops that dequantize an int8 weight on every call
    counted apart (``passes/dequantized_constants.py`` should leave none)."""

    def counted(gm: nn.Module) -> Counter:
        found = count(gm)
        per_call = sum(1 for _, _, constant in report_float_ops(gm) if constant)
        if per_call:
            found["weight dequantized per call"] = per_call
        return found

    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--runs", type=int, default=20, help="timed interleaved rounds")
    parser.add_argument("--anchor", choices=("auto", "all", "none"), default="all")
    parser.add_argument("--warnings", action="store_true", help="print QuantreeWarnings")
    parser.add_argument(
        "--extra", default="", help=f"extra quantree rows: {', '.join(zoo.EXTRA_VARIANTS)}"
    )
    args = parser.parse_args()
    one_thread()
    warnings.filterwarnings("ignore", category=UserWarning)
    zoo.build = build  # run_model builds through the module's ``build``: ours
    zoo.float_ops = with_dequantized_weights(zoo.float_ops)
    zoo.run_all(args, note_chars=300)


if __name__ == "__main__":
    main()
