"""The fused attention kernel a framework runs, for transformers models that transformers runs only eagerly.

transformers 5.24 runs GPT-OSS's attention eagerly (its per-head attention sinks are an extra logit per
head that SDPA does not take), materialising every head's s×s scores in fp32 in every layer. Megatron-Bridge
runs the same layer as one fused kernel (cuDNN fused attention through Transformer Engine, with the sinks and
the sliding window inside the kernel), and that is the run `benchmarks/published_runs.py` compares with.

`FUSED_ATTENTION` registers an attention implementation with transformers (`AttentionInterface`) that prices
what the fused kernel does: causal scaled-dot-product attention over the grouped KV heads, which capture
routes to the flash kernel (autopar.capture.kernels). Two differences are left to the price, both small and
both making the real kernel cheaper or equal, never dearer:

- the sinks: one more logit per head and query in the softmax's denominator (s + 1 columns instead of s);
- the sliding window: GPT-OSS's alternate layers attend to the last 128 tokens only, which the fused kernel
  skips and this price computes as full causal attention (about 6% of a GPT-OSS-120B layer's FLOPs at 4,096
  tokens on half the layers).

It is a price, not a numerically equal layer (the sinks are dropped): rows select it with
`overrides = { attn_implementation = "fused_attention" }` in `benchmarks/data/published_runs.toml`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

__all__ = ["FUSED_ATTENTION"]

FUSED_ATTENTION = "fused_attention"


def _fused_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, **_: object
                     ) -> tuple[torch.Tensor, None]:
    """[b, heads, s, d] queries over [b, kv_heads, s, d] keys and values, causal, as one fused kernel;
    returns [b, s, heads, d] as transformers' attention functions do."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register(FUSED_ATTENTION, _fused_attention)
