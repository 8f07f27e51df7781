"""Factories of transformers models of other kinds than causal LMs, at their published sizes, on the meta device.

`autopar plan examples/hf_models.py:vit_h14 --cluster dgx-h100 --nodes 8 --global-batch-size 4096`; each
factory returns `(model, example_inputs, example_kwargs)` with the inputs as the model's forward takes them
(one sample: the planner's figures are per sample). Shapes from the papers:

  vit_h14      ViT-Huge/14 at 224×224 (Dosovitskiy et al. 2021, Table 1: 32 layers, hidden 1280, MLP 5120,
               16 heads, patch 14: 256 patches + the class token), 1000 classes
  bert_large   BERT-large (Devlin et al. 2019: 24 layers, hidden 1024, 16 heads, FFN 4096, vocabulary
               30,522), masked-LM head, sequence 512 with its attention mask
  t5_3b        T5-3B (Raffel et al. 2020, Table 14 / the released config: 24+24 layers, d_model 1024, d_ff 16384,
               32 heads of d_kv 128, vocabulary 32,128), 512 input and 128 target tokens
"""

from __future__ import annotations

import torch
import transformers as hf


def _on_meta(config_cls, model_cls, **config):
    cfg = config_cls(**config)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return model_cls(cfg).to(torch.bfloat16)


def vit_h14():
    model = _on_meta(hf.ViTConfig, hf.ViTForImageClassification, hidden_size=1280, num_hidden_layers=32,
                     num_attention_heads=16, intermediate_size=5120, image_size=224, patch_size=14, num_labels=1000)
    return model, (), {"pixel_values": torch.zeros(1, 3, 224, 224, dtype=torch.bfloat16),
                       "labels": torch.zeros(1, dtype=torch.long)}  # it trains on its own loss: one class per image


def bert_large(seq_len: int = 512):
    model = _on_meta(hf.BertConfig, hf.BertForMaskedLM, vocab_size=30522, hidden_size=1024, num_hidden_layers=24,
                     num_attention_heads=16, intermediate_size=4096, max_position_embeddings=512)
    ids = torch.zeros(1, seq_len, dtype=torch.long)
    return model, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def t5_3b(seq_len: int = 512, target_len: int = 128):
    model = _on_meta(hf.T5Config, hf.T5ForConditionalGeneration, vocab_size=32128, d_model=1024, d_kv=128,
                     d_ff=16384, num_layers=24, num_decoder_layers=24, num_heads=32, decoder_start_token_id=0)
    ids = torch.zeros(1, seq_len, dtype=torch.long)
    return model, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                       "decoder_input_ids": torch.zeros(1, target_len, dtype=torch.long),
                       "labels": torch.zeros(1, target_len, dtype=torch.long)}  # the decoder's targets
