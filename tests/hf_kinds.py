"""Tiny transformers models of other kinds than causal LMs, with their inputs as their forwards take them.

Two families of each kind: vision transformers (ViT, DeiT), convolutional nets with batch norm (ResNet,
RegNet), encoder masked LMs (BERT, RoBERTa), encoder–decoders (T5, BART) and windowed-attention vision
models (Swin, Swin v2); and ConvNeXt, a conv net whose blocks run a channels-last MLP (no sequence: never
sequence-parallel). Sizes follow the CI budget: 2 layers (or stages), hidden 32–64, sequences of 16
tokens or 16 patches, vocabulary 128, fp32, dropout 0. `example(kind, batch)` gives the inputs a model
is captured with and `batch(kind, batch, seed)` one training batch `(inputs, targets)`: inputs a dict of
the model's keyword inputs, targets what `lm_cross_entropy` compares the logits with (class labels of
images, the tokens of a masked LM, decoder labels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB, HIDDEN, HEADS, LAYERS, FFN, SEQ, DEC_SEQ, CLASSES, IMAGE = 128, 64, 4, 2, 96, 16, 8, 10, 16
KINDS = {"vit": "vision transformer", "deit": "vision transformer", "resnet": "conv net with batch norm",
         "regnet": "conv net with batch norm", "bert": "encoder masked LM", "roberta": "encoder masked LM",
         "t5": "encoder-decoder", "bart": "encoder-decoder", "swin": "windowed attention",
         "swinv2": "windowed attention", "convnext": "conv net with a channels-last MLP"}


def _builders() -> dict[str, Callable[[], nn.Module]]:
    import transformers as hf

    vit = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
               image_size=IMAGE, patch_size=4, num_channels=3, num_labels=CLASSES, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
    enc = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               intermediate_size=FFN, max_position_embeddings=4 * SEQ, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, pad_token_id=0)
    swin = dict(image_size=IMAGE, patch_size=2, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                window_size=4, mlp_ratio=2.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                drop_path_rate=0.0, num_labels=CLASSES)
    conv = dict(num_channels=3, num_labels=CLASSES, hidden_sizes=[16, 32], depths=[1, 1])
    seq2seq = dict(vocab_size=VOCAB, pad_token_id=0, decoder_start_token_id=0)

    def make(config_cls, model_cls, attention: str | None = "sdpa", **kw):
        def build():
            cfg = config_cls(**kw)
            if attention is not None:
                cfg._attn_implementation = attention
            return model_cls(cfg)
        return build

    return {
        "vit": make(hf.ViTConfig, hf.ViTForImageClassification, **vit),
        "deit": make(hf.DeiTConfig, hf.DeiTForImageClassification, **vit),
        "resnet": make(hf.ResNetConfig, hf.ResNetForImageClassification, attention=None, embedding_size=16,
                       layer_type="basic", **conv),
        "regnet": make(hf.RegNetConfig, hf.RegNetForImageClassification, attention=None, embedding_size=16,
                       groups_width=8, **conv),
        "bert": make(hf.BertConfig, hf.BertForMaskedLM, **enc),
        "roberta": make(hf.RobertaConfig, hf.RobertaForMaskedLM, **{**enc, "pad_token_id": 1}),
        "t5": make(hf.T5Config, hf.T5ForConditionalGeneration, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN,
                   num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0,
                   relative_attention_num_buckets=8, **seq2seq),
        "bart": make(hf.BartConfig, hf.BartForConditionalGeneration, d_model=HIDDEN, encoder_layers=LAYERS,
                     decoder_layers=LAYERS, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                     encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_position_embeddings=4 * SEQ, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0, bos_token_id=2, eos_token_id=3, **seq2seq),
        "swin": make(hf.SwinConfig, hf.SwinForImageClassification, attention=None, **swin),
        "swinv2": make(hf.Swinv2Config, hf.Swinv2ForImageClassification, attention=None, **swin),
        # depthwise conv, then a channels-last norm and pointwise MLP (split by TP) and a layer scale
        "convnext": make(hf.ConvNextConfig, hf.ConvNextForImageClassification, attention=None, num_stages=2,
                         image_size=IMAGE, drop_path_rate=0.0, **conv),
    }


def build_kind(kind: str, seed: int = 0) -> nn.Module:
    """The tiny model of family `kind`, fp32, weights drawn from `seed`."""
    torch.manual_seed(seed)
    return _builders()[kind]().float()


def _is_vision(kind: str) -> bool:
    return KINDS[kind] in ("vision transformer", "conv net with batch norm", "windowed attention",
                           "conv net with a channels-last MLP")


def batch(kind: str, size: int, seed: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One training batch of `size` samples: (the model's keyword inputs, the loss's targets)."""
    g = torch.Generator().manual_seed(seed)
    if _is_vision(kind):
        return ({"pixel_values": torch.randn(size, 3, IMAGE, IMAGE, generator=g)},
                torch.randint(0, CLASSES, (size,), generator=g))
    ids = torch.randint(4, VOCAB, (size, SEQ), generator=g)
    mask = torch.ones(size, SEQ, dtype=torch.long)
    mask[: size // 2, SEQ - 3:] = 0  # padded samples: the mask reaches every attention layer
    if KINDS[kind] == "encoder masked LM":
        return {"input_ids": ids, "attention_mask": mask}, torch.randint(4, VOCAB, (size, SEQ), generator=g)
    dec = torch.randint(4, VOCAB, (size, DEC_SEQ), generator=g)
    labels = torch.randint(4, VOCAB, (size, DEC_SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}, labels


def example(kind: str, size: int = 1) -> dict[str, Any]:
    """Keyword inputs to capture the model with (`autopar.capture(model, (), example(kind))`)."""
    return batch(kind, size)[0]
