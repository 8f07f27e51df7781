"""The fused attention kernel a framework runs, for transformers models that transformers runs only eagerly.

transformers 5.24 runs GPT-OSS's attention eagerly (its per-head attention sinks are an extra logit per
head that SDPA does not take), materialising every head's s×s scores in fp32 in every layer. Megatron-Bridge
runs the same layer as one fused kernel (cuDNN fused attention through Transformer Engine, with the sinks and
the sliding window inside the kernel), and that is the run `benchmarks/published_runs.py` compares with.

`FUSED_ATTENTION` registers an attention implementation with transformers (`AttentionInterface`) that prices
what the fused kernel does: scaled-dot-product attention over the grouped KV heads, which capture routes to
the flash kernel (autopar.capture.kernels), causal over the whole sequence in full-attention layers; in
sliding-window layers (window w < s) over the key tiles a tiled kernel visits: each w-token tile of queries
against its own and the previous w keys (FlashAttention-2's local attention skips every tile wholly outside
the window, Dao 2023 §3.1), 2·w keys per query instead of the causal s/2 on average. One difference is left
to the price: the sinks, one more logit per head and query in the softmax's denominator (s + 1 columns).

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
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     sliding_window: int | None = None, **_: object) -> tuple[torch.Tensor, None]:
    """[b, heads, s, d] queries over [b, kv_heads, s, d] keys and values as one fused kernel; returns
    [b, s, heads, d] as transformers' attention functions do (a price: sinks dropped, window tiles whole)."""
    gqa = key.shape[1] != query.shape[1]
    b, heads, s, d = query.shape
    w = sliding_window or s
    if w >= s or s % w:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    tiles = s // w

    def tiled(x: torch.Tensor) -> torch.Tensor:  # [b, h, s, d] -> [b·tiles, h, w, d]
        return x.view(b, x.shape[1], tiles, w, d).transpose(1, 2).reshape(b * tiles, x.shape[1], w, d)

    def with_previous(x: torch.Tensor) -> torch.Tensor:  # each tile's keys: the previous tile's and its own
        t = tiled(x).view(b, tiles, x.shape[1], w, d)
        prev = torch.cat([torch.zeros_like(t[:, :1]), t[:, :-1]], dim=1)
        return torch.cat([prev, t], dim=3).view(b * tiles, x.shape[1], 2 * w, d)

    out = F.scaled_dot_product_attention(tiled(query), with_previous(key), with_previous(value), scale=scaling,
                                         enable_gqa=gqa)
    return out.view(b, tiles, heads, w, d).permute(0, 1, 3, 2, 4).reshape(b, s, heads, d), None


transformers.AttentionInterface.register(FUSED_ATTENTION, _fused_attention)
