"""The default loss, `lm_cross_entropy`: cross-entropy over chunks of tokens, single-process or vocab-parallel.

Only one chunk of rows is upcast to fp32 at a time: the forward keeps a fp32 log-sum-exp per row, the
backward recomputes each chunk's softmax from the 16-bit logits the head already holds and writes the
gradient in their dtype, so the loss holds the logits, their gradient and one chunk, never a [tokens, vocab]
fp32 tensor (cost_models.memory.logits_bytes, "chunked"). Under tensor parallelism each rank holds a slice of
the vocabulary: per chunk it all-reduces the per-row max, then the per-row sum of exponentials stacked with
the target logit — small all-reduces of [chunk] floats instead of an all-gather of [tokens, vocab]
(Megatron-LM's vocab-parallel cross entropy, Shoeybi et al. 2019, §3). Any other loss gets the gathered logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autopar.errors import AutoparError, PlanMismatchError
from cost_models.memory import loss_chunk_tokens

__all__ = ["IGNORE_INDEX", "lm_cross_entropy", "chunked_cross_entropy", "vocab_parallel_cross_entropy", "gather_vocab",
           "resolve_loss"]

IGNORE_INDEX = -100  # the target value skipped by the loss, as torch.nn.functional.cross_entropy


def _check_shapes(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """The default loss needs one logit row per target; say so, rather than failing deep inside torch."""
    if not isinstance(logits, torch.Tensor) or logits.shape[:-1].numel() != targets.numel():
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise PlanMismatchError(
            f"the model returned logits of shape {shape} for targets of shape {tuple(targets.shape)}; the default "
            "loss (lm_cross_entropy) needs logits [..., vocab] with one row per target. Pass loss_fn=(output, "
            "targets) -> loss to parallelize, or give the model's forward a targets argument (targets, labels or "
            "target_arg=) to train on the loss it computes")


def lm_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits [..., vocab], targets [...] (IGNORE_INDEX skipped; 0 if all are).

    Computed over chunks of tokens (`chunked_cross_entropy`), so it never holds the whole fp32 logits. Pass
    this as `loss_fn` to get the vocab-parallel version under tensor parallelism.
    """
    return chunked_cross_entropy(logits, targets)


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int | None = None,
                          vocab_start: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`lm_cross_entropy` with `chunk_tokens` logit rows upcast to fp32 at a time (default:
    cost_models.memory.loss_chunk_tokens); `group`: the ranks holding equal vocabulary slices, this one
    from `vocab_start`, whose per-row max and sum of exponentials are all-reduced per chunk."""
    _check_shapes(logits, targets)
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise AutoparError(f"chunk_tokens={chunk_tokens!r}; pass a positive number of rows per chunk, or None for "
                           "cost_models.memory.loss_chunk_tokens")
    rows = logits.reshape(-1, logits.size(-1))
    chunk = chunk_tokens or loss_chunk_tokens(rows.size(0), rows.size(1))
    return _ChunkedCrossEntropy.apply(rows, targets.reshape(-1), chunk, vocab_start, group)


def _target_index(targets: torch.Tensor, vocab_start: int, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each row's target in this slice, clamped; whether the target is in this slice and counted)."""
    local = targets - vocab_start
    hit = (local >= 0) & (local < v_local) & (targets != IGNORE_INDEX)
    return local.clamp(0, v_local - 1).unsqueeze(-1), hit


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Cross-entropy whose fp32 work is one chunk of rows at a time (cost_models.memory.logits_bytes,
    "chunked"): forward keeps a fp32 log-sum-exp per row; backward recomputes each chunk's softmax from the
    16-bit logits (saved, not copied) and writes the gradient in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int, vocab_start: int,
                group: dist.ProcessGroup | None) -> torch.Tensor:
        n, v_local = logits.shape
        idx, hit = _target_index(targets, vocab_start, v_local)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        target_logit = torch.empty(n, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk):
            x = logits[s:s + chunk].to(torch.float32, copy=True)  # the only [chunk, vocab] fp32 buffer
            row_max = x.amax(dim=-1)
            if group is not None:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            picked = torch.where(hit[s:s + chunk], x.gather(-1, idx[s:s + chunk]).squeeze(-1), 0.0)
            sums = torch.stack([x.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1), picked])
            del x
            if group is not None:
                dist.all_reduce(sums, group=group)
            lse[s:s + chunk] = sums[0].log_() + row_max
            target_logit[s:s + chunk] = sums[1]
        valid = targets != IGNORE_INDEX
        n_valid = valid.sum().clamp(min=1)
        loss = torch.where(valid, lse - target_logit, 0.0).sum() / n_valid
        ctx.save_for_backward(logits, targets, lse, n_valid)
        ctx.chunk, ctx.vocab_start = chunk, vocab_start
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        logits, targets, lse, n_valid = ctx.saved_tensors
        chunk, (n, v_local) = ctx.chunk, logits.shape
        idx, hit = _target_index(targets, ctx.vocab_start, v_local)
        scale = (targets != IGNORE_INDEX).to(torch.float32) * (grad_loss.float() / n_valid)
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for s in range(0, n, chunk):
            x = logits[s:s + chunk].to(torch.float32, copy=True)
            x.sub_(lse[s:s + chunk].unsqueeze(-1)).exp_()  # softmax
            x.scatter_add_(-1, idx[s:s + chunk], hit[s:s + chunk].unsqueeze(-1).to(x.dtype).neg_())
            grad[s:s + chunk] = x.mul_(scale[s:s + chunk].unsqueeze(-1))
            del x
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor,
                                 tp_mesh: DeviceMesh) -> torch.Tensor:
    """`lm_cross_entropy` of logits sharded along the vocabulary over `tp_mesh` (equal, contiguous slices)."""
    _check_shapes(local_logits, targets)
    v_local = local_logits.size(-1)
    return chunked_cross_entropy(local_logits, targets, vocab_start=tp_mesh.get_local_rank() * v_local,
                                 group=tp_mesh.get_group())


def gather_vocab(local_logits: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Full logits from vocab shards (all-gather along the last dim; gradients flow back to the shard)."""
    return DTensor.from_local(local_logits, tp_mesh, [Shard(local_logits.dim() - 1)]).full_tensor()


def resolve_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tp_mesh: DeviceMesh | None,
                 vocab_parallel: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss to run on this rank's logits: unchanged, vocab-parallel CE, or the user's on gathered logits."""
    if not vocab_parallel or tp_mesh is None:
        return loss_fn
    if loss_fn is lm_cross_entropy:
        return lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, tp_mesh)
    return lambda logits, targets: loss_fn(gather_vocab(logits, tp_mesh), targets)
