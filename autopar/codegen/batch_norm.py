"""Batch norm synchronised over the data-parallel ranks: the statistics of each micro-batch of the global batch.

Under data parallelism a plain batch norm would normalise each rank's shard by its own statistics,
so training would differ from one process. `apply_sync_batch_norm` makes every `_BatchNorm` of a
stage compute, in training, the mean and variance over micro-batch i of every data-parallel rank
together (what one process computes on the dp·mbs samples of those micro-batches), as
`torch.nn.SyncBatchNorm` does on GPUs (whose kernels refuse CPU tensors): two all-reduces in forward,
the per-channel sums with the sample count, then the sums of squared deviations (two passes, as
`F.batch_norm` computes the variance); the backward of each is the all-reduce of its gradient (`_AllReduce`:
a sum's gradient reaches every rank's addend). Running statistics are updated from the synchronised
ones (unbiased variance), so they are identical on every rank and a checkpoint holds one copy.
Evaluation uses them unchanged. The modules keep their class and parameter names.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["apply_sync_batch_norm", "batch_norms"]


def batch_norms(module: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """The batch norms of `module` that track or compute batch statistics, by path."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, _BatchNorm)]


class _AllReduce(torch.autograd.Function):
    """Sum over `group`; the gradient of every rank's addend is the sum of the ranks' output gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _synced_forward(self: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    if not self.training and self.track_running_stats:
        return _BatchNorm.forward(self, x)
    group = self._autopar_dp_group
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    count = torch.tensor([x.numel() // x.size(1)], dtype=torch.float32, device=x.device)
    sums = _AllReduce.apply(torch.cat([x.float().sum(dims), count]), group)
    n = sums[-1]
    mean = sums[:-1] / n
    centred = x.float() - mean.reshape(shape)
    var = _AllReduce.apply((centred * centred).sum(dims), group) / n
    if self.track_running_stats:
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
            unbiased = var.detach() * (n / (n - 1).clamp(min=1))
            self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
    y = centred * torch.rsqrt(var + self.eps).reshape(shape)
    if self.affine:
        y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
    return y.to(x.dtype)


def apply_sync_batch_norm(module: nn.Module, dp_group: dist.ProcessGroup | None, dp_size: int) -> int:
    """Synchronise every batch norm of `module` over `dp_group` (nothing to do with dp_size 1); returns how many.

    F.batch_norm stays what runs without data parallelism, so one process is its own reference."""
    norms = batch_norms(module)
    if dp_size > 1:
        for _, bn in norms:
            bn._autopar_dp_group = dp_group
            bn.forward = types.MethodType(_synced_forward, bn)
    return len(norms)


