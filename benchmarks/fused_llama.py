"""A zoo Llama that saves for backward what fused training kernels save, for runs that used them.

autopar prices the model it captures. The zoo's Llama runs eager PyTorch ops, which save more than the
fused kernels of Megatron-LM / Transformer Engine or Meta's Llama 3 trainer (Dubey et al. 2024, §3.3):
per token and layer of a 405B block the eager block saves ~46·h bytes, the fused one ~32·h (the sum below).
This module swaps three parts of each block for autograd Functions that compute the same values with the
same ATen kernels but save only what the fused kernels keep:

  RMSNorm         its input and the fp32 reciprocal RMS per token (Apex / TE fused RMSNorm), not x², x·r
  attention       q, the un-repeated GQA k and v, the output and the log-sum-exp (FlashAttention-2 saves
                  these and reads each KV head for its query group), not k and v repeated per query head
                  nor a transposed copy of the output: the fused kernel writes [b, s, heads, d] directly
  SwiGLU          gate and up (Megatron-LM's bias_swiglu / TE's swiglu), not silu(gate) as well

The matmuls, their FLOPs and the attention kernels are unchanged, so only memory and the memory-bound
kernels' count differ from the zoo model. Used by benchmarks/published_runs.py for runs whose source says
they ran fused kernels (`model_impl = "fused"`).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.zoo.llama import apply_rope, rope_rows

__all__ = ["build"]

aten = torch.ops.aten


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)  # [..., 1] fp32
        ctx.save_for_backward(x, weight, rstd)
        return (x * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = (x * rstd).to(x.dtype)
        gw = (g * xhat).sum(dim=tuple(range(g.dim() - 1)))
        gx_hat = g * weight
        gx = rstd * (gx_hat - xhat * (gx_hat * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        gate, up = ctx.saved_tensors
        s = torch.sigmoid(gate)
        return g * up * s * (1 + gate * (1 - s)), g * gate * s


class _FlashGQA(torch.autograd.Function):
    """Causal flash attention over q [b, H, s, d] and k, v [b, KV, s, d]; returns [b, s, H·d]."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, kr, vr, 0.0, True)
        b, heads, s, d = q.shape
        y = out.transpose(1, 2).reshape(b, s, heads * d)  # the fused kernel's own [b, s, H, d] output
        ctx.save_for_backward(q, k, v, y, lse, seed, offset)
        ctx.meta = (cq, ck, mq, mk, rep)
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        q, k, v, y, lse, seed, offset = ctx.saved_tensors
        cq, ck, mq, mk, rep = ctx.meta
        b, heads, s, d = q.shape
        out = y.view(b, s, heads, d).transpose(1, 2)
        g = gy.reshape(b, s, heads, d).transpose(1, 2)
        kr, vr = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(g, q, kr, vr, out, lse, cq, ck, mq, mk, 0.0,
                                                                       True, seed, offset)
        kv = k.shape[1]
        return dq, dk.view(b, kv, rep, s, d).sum(2), dv.view(b, kv, rep, s, d).sum(2)


class _FusedRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


def _attention_forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
    b, s, _ = x.shape
    cos, sin = rope_rows(rope_cos, rope_sin, s, position_ids, x.dtype)
    q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
    k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
    v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return self.wo(_FlashGQA.apply(q, k, v))


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.w2(_SwiGLU.apply(self.w1(x), self.w3(x)))


def build(name: str, seq_len: int, **overrides) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """`autopar.zoo.build(name, seq_len, **overrides)` with each block's norms, attention core and SwiGLU
    saving what fused kernels save (module docstring)."""
    model, x = autopar.zoo.build(name, seq_len=seq_len, **overrides)
    for block in model.layers:
        block.attention_norm = _FusedRMSNorm(block.attention_norm)
        block.ffn_norm = _FusedRMSNorm(block.ffn_norm)
        block.attention.forward = types.MethodType(_attention_forward, block.attention)
        block.feed_forward.forward = types.MethodType(_mlp_forward, block.feed_forward)
    return model, x
