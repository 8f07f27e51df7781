"""GPT-2/GPT-3 style decoder (pre-LayerNorm, GELU MLP, learned positions), written for tracing.

Shapes follow Radford et al. 2019 (GPT-2) and Brown et al. 2020 (GPT-3, Table 2.1).
q, k and v are separate linears so that column-parallel sharding splits heads cleanly, and the
LM head is untied from the embedding, as Megatron-LM keeps it when they sit on different stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    n_layers: int
    hidden_size: int
    n_heads: int
    vocab_size: int
    max_seq_len: int
    ffn_mult: int = 4
    dropout: float = 0.1  # GPT-2/3 trained with 0.1; tests pass 0.0 for deterministic parity
    attn_impl: str = "sdpa"  # "sdpa" (fused kernel) or "eager" (explicit softmax, as Megatron's unfused path)

    def __post_init__(self) -> None:
        if self.hidden_size % self.n_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by n_heads={self.n_heads}")
        if self.attn_impl not in ("sdpa", "eager"):
            raise ValueError(f"attn_impl={self.attn_impl!r}; expected 'sdpa' or 'eager'")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, impl: str,
                     training: bool) -> torch.Tensor:
    """q: [b, heads, s, d]; k, v: [b, heads, s, d] → [b, heads, s, d]."""
    p = dropout if training else 0.0
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    mask = torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1)  # [s, s], True above the diagonal
    scores = scores.masked_fill(mask, float("-inf"))
    probs = F.dropout(torch.softmax(scores, dim=-1), p=p, training=training)
    return torch.matmul(probs, v)


class GPTAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = h // cfg.n_heads
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.o_proj = nn.Linear(h, h)
        self.dropout = cfg.dropout
        self.attn_impl = cfg.attn_impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: the local head count follows the (possibly sharded) projection width.
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        y = causal_attention(q, k, v, self.dropout, self.attn_impl, self.training)
        y = y.transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(y)


class GPTMLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, cfg.ffn_mult * cfg.hidden_size)
        self.proj = nn.Linear(cfg.ffn_mult * cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = GPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = GPTMLP(cfg)
        self.drop_1 = nn.Dropout(cfg.dropout)
        self.drop_2 = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_1(self.attn(self.ln_1(x)))
        return x + self.drop_2(self.mlp(self.ln_2(x)))


class GPTEmbedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(input_ids.size(1), device=input_ids.device) if position_ids is None else position_ids
        return self.drop(self.wte(input_ids) + self.wpe(pos))


class GPT(nn.Module):
    """input_ids [b, s] (int64) → logits [b, s, vocab]; position_ids [1 or b, s]: the tokens' positions
    (default 0..s−1; a context-parallel shard's are not contiguous)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = GPTEmbedding(cfg)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) if position_ids is None else self.embed(input_ids, position_ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2·layers)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * self.config.n_layers) if name.endswith(("o_proj.weight",
                                                                                    "proj.weight")) else 0.02
                p.normal_(0.0, std)
