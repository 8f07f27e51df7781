"""A context-parallel rank's causal attention over its query chunks, without a materialized mask.

A query chunk of c tokens at global positions n − c .. n − 1 attends keys 0 .. n − 1, causally: every key of
the prefix 0 .. n − c − 1, and the diagonal block n − c .. n − 1 causally (a square, where SDPA's upper-left
`is_causal` is the lower-right mask the chunk needs). Handing SDPA that mask instead makes it a [c, n] tensor
that the kernel saves for backward in the query dtype: c²·(2·cp + 1) elements per rank and layer (570 MB in
bf16 at c = 4096 and cp = 8, half of the ~34·2c·d_model bytes a d_model = 4096 layer keeps besides), none of
it priced (autopar.planner.cp_costs). Here the two parts run as two flash kernels and their outputs are merged by
their log-sum-exps; backward runs each part's flash backward against the merged output and log-sum-exp,
whose gradients sum to the whole's (the merge ring attention uses: Liu et al. 2023, "Ring Attention with
Blockwise Transformers", §3). Saved for backward: the queries, the gathered keys and values (one storage,
shared by the rank's two chunks), the output and a fp32 log-sum-exp per query and head — what flash saves.

Forward and backward are custom ops, so torch.compile and the recompute policies see each as one op
(codegen/recompute.py: the attention core that "selective" recomputes; saved by "op_sac" as fused attention).
Keys and values may have fewer heads than the queries (grouped-query attention): each kernel sees them
repeated, a transient copy; the gradients are summed back per key/value head. Implemented with the CPU flash
kernels (`aten._scaled_dot_product_flash_attention_for_cpu`); `supported` says where it runs.
"""

from __future__ import annotations

import torch

__all__ = ["supported", "chunk_attention"]

_aten = torch.ops.aten


def supported(query: torch.Tensor, dropout_p: float) -> bool:
    """Whether `chunk_attention` runs for these queries (CPU flash kernels, no dropout: the two parts would
    draw independent masks)."""
    return query.device.type == "cpu" and dropout_p == 0.0


def _parts(kv: torch.Tensor, n_keys: int, c: int, key_dim: int, heads: int) -> list[tuple[torch.Tensor, ...]]:
    """(keys, values, is_causal, first key, end key) of the prefix (absent for the first chunk) and of the
    diagonal block, the key/value heads repeated to the queries' (a transient copy under grouped-query
    attention)."""
    rep = heads // kv.size(1)
    out = []
    for lo, hi, causal in ((0, n_keys - c, False), (n_keys - c, n_keys, True)):
        if hi > lo:
            k, v = kv[..., lo:hi, :key_dim], kv[..., lo:hi, key_dim:]
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out.append((k, v, causal, lo, hi))
    return out


@torch.library.custom_op("autopar::cp_chunk_attention", mutates_args=())
def chunk_attention(query: torch.Tensor, kv: torch.Tensor, chunks: list[int], key_dim: int,
                    scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """query [b, h, s, d_k]: the rank's chunks of s / len(chunks) tokens each, `chunks` their global indices;
    kv: the gathered keys and values [b, h_kv, S, d_k + d_v] in global order → (output [b, h, s, d_v] laid out
    as [b, s, h, d_v], as flash lays out its own, so the model's transpose back is a view of what is saved;
    log-sum-exp [b, h, s] fp32)."""
    b, heads, s, _ = query.shape
    c = s // len(chunks)
    out = query.new_empty((b, s, heads, kv.size(-1) - key_dim)).transpose(1, 2)
    lse = query.new_empty((b, heads, s), dtype=torch.float32)
    for i, chunk in enumerate(chunks):
        q, rows = query[:, :, i * c:(i + 1) * c], slice(i * c, (i + 1) * c)
        outs, lses = [], []
        for k, v, causal, _, _ in _parts(kv, (chunk + 1) * c, c, key_dim, heads):
            o, part = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            outs.append(o)
            lses.append(part)
        if len(outs) == 1:
            out[:, :, rows], lse[:, :, rows] = outs[0], lses[0]
            continue
        whole = torch.logaddexp(lses[0], lses[1])
        out[:, :, rows] = sum(o.float() * (part - whole).exp().unsqueeze(-1)
                              for o, part in zip(outs, lses, strict=True))
        lse[:, :, rows] = whole
    return out, lse


@chunk_attention.register_fake
def _(query, kv, chunks, key_dim, scale):
    b, h, s, _ = query.shape
    return (query.new_empty((b, s, h, kv.size(-1) - key_dim)).transpose(1, 2),
            query.new_empty((b, h, s), dtype=torch.float32))


@torch.library.custom_op("autopar::cp_chunk_attention_backward", mutates_args=())
def chunk_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, chunks: list[int], key_dim: int, scale: float | None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `chunk_attention` for its queries and for the gathered keys and values."""
    heads, kv_heads, s = query.size(1), kv.size(1), query.size(2)
    c = s // len(chunks)
    grad_q = torch.zeros_like(query, memory_format=torch.contiguous_format)
    grad_kv = torch.zeros_like(kv, memory_format=torch.contiguous_format)
    for i, chunk in enumerate(chunks):
        rows = slice(i * c, (i + 1) * c)
        q, o, g, part = query[:, :, rows], out[:, :, rows], grad_out[:, :, rows].contiguous(), lse[:, :, rows]
        for k, v, causal, lo, hi in _parts(kv, (chunk + 1) * c, c, key_dim, heads):
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                g, q, k, v, o, part.contiguous(), 0.0, causal, scale=scale)
            grad_q[:, :, rows] += dq
            if heads != kv_heads:  # each key/value head served heads / kv_heads query heads
                dk = dk.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
                dv = dv.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
            grad_kv[..., lo:hi, :key_dim] += dk
            grad_kv[..., lo:hi, key_dim:] += dv
    return grad_q, grad_kv


@chunk_attention_backward.register_fake
def _(grad_out, query, kv, out, lse, chunks, key_dim, scale):
    return (torch.empty_like(query, memory_format=torch.contiguous_format),
            torch.empty_like(kv, memory_format=torch.contiguous_format))


def _setup(ctx, inputs, output) -> None:
    query, kv, ctx.chunks, ctx.key_dim, ctx.scale = inputs
    out, lse = output
    ctx.save_for_backward(query, kv, out, lse)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None):
    query, kv, out, lse = ctx.saved_tensors
    grad_q, grad_kv = torch.ops.autopar.cp_chunk_attention_backward(grad_out, query, kv, out, lse, ctx.chunks,
                                                                     ctx.key_dim, ctx.scale)
    return grad_q, grad_kv, None, None, None


chunk_attention.register_autograd(_backward, setup_context=_setup)
