"""Outside models, round 2: builders for the families ``outside_models.py`` adds second.

Failures this round found, and their fixes, are in ``benchmarks/README.md`` ("Outside
models, round 2"). ``squeezebert`` is not here: its config refuses ``embedding_size !=
intermediate hidden_size`` for any small width (the library's assertion, not ours).

Small configurations of library model code (random weights, nothing downloaded), chosen to
widen what the sweep covers rather than to repeat round 1: torchvision's remaining
classification and segmentation models, timm families with unusual blocks (reparameterised
branches, selective kernels, cross-covariance or talking-heads attention, space-to-depth
stems), Hugging Face encoders, decoders and vision models of families round 1 did not hold,
and torchaudio's HuBERT/WavLM factories."""

from __future__ import annotations

import torch
from torch import nn
from zoo import Case, First, randn, tokens


class Key(nn.Module):
    """A model returning a dict or dataclass, reduced to one named entry."""

    def __init__(self, inner: nn.Module, key: str) -> None:
        super().__init__()
        self.inner, self.key = inner, key

    def forward(self, *args):
        return self.inner(*args)[self.key]


class Keywords(nn.Module):
    """A Hugging Face model called with keyword inputs, reduced to its first output tensor."""

    def __init__(self, inner: nn.Module, *names: str) -> None:
        super().__init__()
        self.inner, self.names = inner, names

    def forward(self, *args):
        return self.inner(**dict(zip(self.names, args, strict=True)))[0]


BATCH_2 = {"deeplabv3_mobilenet_v3_large", "rexnet_100", "repvit_m0_9", "skresnet18"}
"""Batch norm over a 1x1 map (a pooled branch, squeeze-excite, a BatchNorm1d head): its
running statistics warm (``warm_batch_norm``, train mode) on 2 rows, not 1."""

TV_SIZE = {"convnext_tiny": 128, "vgg11_bn": 128, "resnet50": 160, "alexnet": 224}


def torchvision2(name: str) -> Case:
    import torchvision.models as tvm

    if name in ("fcn_resnet50", "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large"):
        model = getattr(tvm.segmentation, name)(weights=None, weights_backbone=None)
        return Case(Key(model, "out"), randn(2 if name in BATCH_2 else 1, 3, 128, 128))
    if name == "r3d_18":
        return Case(tvm.video.r3d_18(), randn(1, 3, 8, 64, 64))
    if name == "swin_v2_t":
        return Case(tvm.swin_v2_t(), randn(1, 3, 256, 256))
    size = TV_SIZE.get(name, 224)
    return Case(getattr(tvm, name)(), randn(1, 3, size, size))


TIMM_SIZE = {"nfnet_l0": 160, "dpn48b": 160, "res2net50_14w_8s": 160, "tresnet_m": 224}


def timm2(name: str) -> Case:
    import timm

    model = timm.create_model(name, pretrained=False)
    size = model.default_cfg.get("input_size", (3, 224, 224))
    if name in TIMM_SIZE:
        size = (3, TIMM_SIZE[name], TIMM_SIZE[name])
    return Case(model, randn(2 if name in BATCH_2 else 1, *size))


def hf2(name: str) -> Case:
    import transformers as tf

    small = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
    small["intermediate_size"] = 256
    seq = (1, 64)
    encoders = {
        "deberta_v2": tf.DebertaV2Config, "electra": tf.ElectraConfig,
        "xlm_roberta": tf.XLMRobertaConfig, "squeezebert": tf.SqueezeBertConfig,
        "convbert": tf.ConvBertConfig,
    }  # fmt: skip
    decoders = {
        "gpt_neo": (tf.GPTNeoConfig, dict(hidden_size=128, num_layers=2, num_heads=4,
                                          attention_types=[[["global", "local"], 1]],
                                          window_size=32)),
        "gptj": (tf.GPTJConfig, dict(n_embd=128, n_layer=2, n_head=4, rotary_dim=16)),
        "opt": (tf.OPTConfig, dict(hidden_size=128, num_hidden_layers=2, ffn_dim=256,
                                   num_attention_heads=4, word_embed_proj_dim=128)),
        "bloom": (tf.BloomConfig, dict(hidden_size=128, n_layer=2, n_head=4)),
        "falcon": (tf.FalconConfig, dict(hidden_size=128, num_hidden_layers=2,
                                         num_attention_heads=4)),
        "phi": (tf.PhiConfig, dict(small)),
        "qwen2": (tf.Qwen2Config, dict(small, num_key_value_heads=2)),
        "gemma": (tf.GemmaConfig, dict(small, num_key_value_heads=2, head_dim=32)),
        "stablelm": (tf.StableLmConfig, dict(small, num_key_value_heads=2)),
        "mpt": (tf.MptConfig, dict(d_model=128, n_layers=2, n_heads=4)),
        "gpt_neox": (tf.GPTNeoXConfig, dict(small)),
    }  # fmt: skip
    if name in encoders:
        cfg = encoders[name](vocab_size=1000, **small)
        return Case(Keywords(tf.AutoModel.from_config(cfg), "input_ids"), tokens(1000, *seq))
    if name == "mobilebert":
        cfg = tf.MobileBertConfig(
            vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, embedding_size=64, intra_bottleneck_size=64,
        )  # fmt: skip
        return Case(Keywords(tf.MobileBertModel(cfg), "input_ids"), tokens(1000, *seq))
    if name == "funnel":
        cfg = tf.FunnelConfig(
            vocab_size=1000, block_sizes=[1, 1], d_model=128, n_head=4, d_head=32,
            d_inner=256, num_decoder_layers=1,
        )  # fmt: skip
        return Case(Keywords(tf.FunnelModel(cfg), "input_ids"), tokens(1000, *seq))
    if name in decoders:
        config, kwargs = decoders[name]
        cfg = config(vocab_size=1000, use_cache=False, **kwargs)
        return Case(Keywords(tf.AutoModel.from_config(cfg), "input_ids"), tokens(1000, *seq))
    audio = {
        "hubert": tf.HubertConfig, "wavlm": tf.WavLMConfig,
        "wav2vec2_conformer": tf.Wav2Vec2ConformerConfig,
    }  # fmt: skip
    if name in audio:
        cfg = audio[name](
            conv_dim=(64, 64, 64), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, **small,
        )  # fmt: skip
        return Case(Keywords(tf.AutoModel.from_config(cfg), "input_values"), randn(1, 8000))
    vision = {
        "hf_vit": (tf.ViTConfig, dict(small, image_size=224, patch_size=16)),
        "hf_deit": (tf.DeiTConfig, dict(small, image_size=224, patch_size=16)),
        "hf_swin": (tf.SwinConfig, dict(embed_dim=32, depths=[2, 2], num_heads=[2, 4])),
        "hf_convnext": (tf.ConvNextConfig, dict(hidden_sizes=[32, 64, 128, 256],
                                                depths=[1, 1, 2, 1])),
        "segformer": (tf.SegformerConfig, dict(hidden_sizes=[32, 64, 160, 256],
                                               depths=[1, 1, 1, 1])),
        "hf_mobilevit": (tf.MobileViTConfig, dict(image_size=256)),
        "beit": (tf.BeitConfig, dict(small, image_size=224, patch_size=16)),
    }  # fmt: skip
    if name in vision:
        config, kwargs = vision[name]
        size = kwargs.get("image_size", 224)
        model = tf.AutoModel.from_config(config(**kwargs))
        return Case(Keywords(model, "pixel_values"), randn(1, 3, size, size))
    raise KeyError(name)


def torchaudio2(name: str) -> Case:
    import torchaudio.models as tam

    common = dict(
        extractor_mode="group_norm", extractor_conv_layer_config=[(64, 10, 5), (64, 3, 2)],
        extractor_conv_bias=False, encoder_embed_dim=128, encoder_projection_dropout=0.0,
        encoder_pos_conv_kernel=16, encoder_pos_conv_groups=4, encoder_num_layers=2,
        encoder_num_heads=4, encoder_attention_dropout=0.0, encoder_ff_interm_features=256,
        encoder_ff_interm_dropout=0.0, encoder_dropout=0.0, encoder_layer_norm_first=True,
        encoder_layer_drop=0.0, aux_num_out=None,
    )  # fmt: skip
    if name == "ta_wavlm":
        model = tam.wavlm_model(encoder_num_buckets=32, encoder_max_distance=128, **common)
        return Case(First(model), randn(1, 8000))
    if name == "ta_hubert_large_form":  # layer norm first, as hubert_large/xlarge
        return Case(First(tam.wav2vec2_model(**common)), randn(1, 8000))
    if name == "ta_conformer":
        model = tam.Conformer(
            input_dim=80, num_heads=4, ffn_dim=128, num_layers=2,
            depthwise_conv_kernel_size=15, convolution_first=True,
        )  # fmt: skip
        return Case(
            First(model), lambda g: (torch.randn(1, 100, 80, generator=g), torch.tensor([100]))
        )
    raise KeyError(name)


FAMILIES2 = {
    "torchvision2": (
        "alexnet", "squeezenet1_0", "resnet50", "mobilenet_v3_large", "regnet_x_400mf",
        "convnext_tiny", "swin_v2_t", "shufflenet_v2_x0_5", "mnasnet1_0",
        "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large",
    ),
    "timm2": (
        "hrnet_w18_small", "dla34", "regnetz_005", "pit_ti_224", "crossvit_tiny_240",
        "nest_tiny", "res2net50_14w_8s", "selecsls42b", "tresnet_m", "ese_vovnet19b_dw",
        "dpn48b", "resmlp_12_224", "gmlp_ti16_224", "volo_d1_224",
    ),
    "hf2": (
        "deberta_v2", "electra", "mobilebert", "xlm_roberta", "convbert", "funnel", "gpt_neo",
        "gptj", "opt", "bloom", "falcon", "phi", "qwen2", "gemma", "mpt", "stablelm",
        "gpt_neox", "hubert", "wavlm", "wav2vec2_conformer", "hf_vit", "hf_deit", "hf_swin",
        "hf_convnext", "segformer", "beit",
    ),
    "torchaudio2": ("ta_wavlm", "ta_hubert_large_form", "ta_conformer"),
}  # fmt: skip
"""The rows of the round-2 table: each ran its whole quickstart in well under a minute on the
loaded machine (about 20 s at ``--runs 5`` when quiet)."""

SLOW2 = {
    "torchvision2": ("efficientnet_b1", "fcn_resnet50", "maxvit_t", "r3d_18"),
    "timm2": (
        "rexnet_100", "cspresnet50", "efficientformer_l1", "fastvit_t8", "mobileone_s0",
        "repvit_m0_9", "edgenext_xx_small", "coat_lite_tiny", "tnt_s_patch16_224",
        "xcit_nano_12_p16_224", "gcvit_xxtiny", "maxvit_rmlp_pico_rw_256", "skresnet18",
        "nfnet_l0",
    ),
    "hf2": ("hf_mobilevit",),
}  # fmt: skip
"""Round-2 models that work but take 30-130 s each under load: ``--models`` names them."""

BUILDERS2 = {"torchvision2": torchvision2, "timm2": timm2, "hf2": hf2}
BUILDERS2 |= {"torchaudio2": torchaudio2}
