"""Llama 3 style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP.

Shapes follow Dubey et al. 2024 ("The Llama 3 Herd of Models", Table 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo.gpt import causal_attention


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    attn_impl: str = "sdpa"

    def __post_init__(self) -> None:
        if self.hidden_size % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}: "
                "hidden_size must divide by n_heads and n_heads by n_kv_heads"
            )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_seq_len, head_dim] (Su et al. 2021, rotate-half layout)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    ang = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, s, d]; cos, sin: [s, d], or [1 or b, 1, s, d] for positions given per token."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_rows(rope_cos: torch.Tensor, rope_sin: torch.Tensor, seq_len: int, position_ids: torch.Tensor | None,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables' rows for a sequence: positions 0..seq_len−1, or each token's `position_ids`
    ([1 or b, s] → [1 or b, 1 (heads), s, d]; a context-parallel shard's positions are not contiguous)."""
    if position_ids is None:
        return rope_cos.narrow(0, 0, seq_len).to(dtype), rope_sin.narrow(0, 0, seq_len).to(dtype)
    return rope_cos[position_ids].unsqueeze(1).to(dtype), rope_sin[position_ids].unsqueeze(1).to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = h // cfg.n_heads
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(h, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(h, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(h, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, h, bias=False)
        self.attn_impl = cfg.attn_impl

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        cos, sin = rope_rows(rope_cos, rope_sin, s, position_ids, x.dtype)
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        y = causal_attention(q, k, v, 0.0, self.attn_impl, self.training)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)  # gate
        self.w3 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = LlamaMLP(cfg)
        cos, sin = rope_tables(cfg.hidden_size // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        # Each block keeps its own (non-persistent) rope tables so a pipeline stage is self-contained.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # the attention picks the tables' rows for the sequence it sees: under sequence parallelism the block's
        # x is a shard of the sequence and the attention's input the whole of it (Korthikanti et al. §4.2.2)
        x = x + self.attention(self.attention_norm(x), self.rope_cos, self.rope_sin, position_ids)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """input_ids [b, s] (int64) → logits [b, s, vocab]; position_ids [1 or b, s]: the tokens' positions
    (default 0..s−1; a context-parallel shard's are not contiguous)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x) if position_ids is None else layer(x, position_ids)
        return self.output(self.norm(x))

    @torch.no_grad()
    def init_weights(self) -> None:
        cfg = self.config
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                p.normal_(0.0, std)
        cos, sin = rope_tables(cfg.hidden_size // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta,
                               device=self.output.weight.device)
        for layer in self.layers:
            layer.rope_cos.copy_(cos)
            layer.rope_sin.copy_(sin)
