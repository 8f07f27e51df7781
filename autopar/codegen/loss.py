"""Losses on vocab-parallel logits: each tensor-parallel rank holds logits for a slice of the vocabulary.

The parallel cross-entropy never materialises the full [tokens, vocab] logits: it all-reduces the
per-token max, then the per-token sum of exponentials stacked with the target logit — two small
all-reduces of [tokens] floats instead of an all-gather of [tokens, vocab] (Megatron-LM's
vocab-parallel cross entropy, Shoeybi et al. 2019, §3). Any other loss gets the gathered logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autopar.errors import PlanMismatchError

__all__ = ["IGNORE_INDEX", "lm_cross_entropy", "vocab_parallel_cross_entropy", "gather_vocab", "resolve_loss"]

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
    """Mean next-token cross-entropy: logits [..., vocab], targets [...] (IGNORE_INDEX skipped).

    Pass this as `loss_fn` to get the vocab-parallel version under tensor parallelism.
    """
    _check_shapes(logits, targets)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        x = logits.float()
        v_local = x.size(-1)
        row_max = x.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x = x - row_max.unsqueeze(-1)
        local_t = targets - vocab_start
        here = (local_t >= 0) & (local_t < v_local)
        idx = local_t.clamp(0, v_local - 1)
        target_logit = x.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * here
        exp = x.exp()
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        dist.all_reduce(sums, group=group)
        sum_exp, target_logit = sums[0], sums[1]
        valid = targets != IGNORE_INDEX
        n_valid = valid.sum().clamp(min=1)
        loss = ((sum_exp.log() - target_logit) * valid).sum() / n_valid
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, idx, here & valid, valid, n_valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, idx, hit, valid, n_valid = ctx.saved_tensors
        grad = softmax * valid.unsqueeze(-1)
        grad.scatter_add_(-1, idx.unsqueeze(-1), -hit.unsqueeze(-1).to(grad.dtype))
        grad = grad * (grad_loss / n_valid)
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor,
                                 tp_mesh: DeviceMesh) -> torch.Tensor:
    """`lm_cross_entropy` of logits sharded along the vocabulary over `tp_mesh` (equal, contiguous slices)."""
    _check_shapes(local_logits, targets)
    v_local = local_logits.size(-1)
    vocab_start = tp_mesh.get_local_rank() * v_local
    return _VocabParallelCrossEntropy.apply(local_logits, targets, vocab_start, tp_mesh.get_group())


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
