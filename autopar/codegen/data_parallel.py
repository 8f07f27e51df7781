"""Data parallelism and ZeRO stages 0–3 over the mesh's "dp" axis (Rajbhandari et al. 2020).

- ZeRO-0: every rank keeps everything; gradients are averaged by bucketed all-reduce after backward.
- ZeRO-1: gradients are averaged the same way; each rank keeps optimizer state for, and updates,
  only the parameters it owns (a greedy size-balanced partition), then broadcasts them, packed into
  one flat buffer per owner.
  Written here rather than with `ZeroRedundancyOptimizer` because that one flattens parameters
  into buckets and cannot hold DTensor (tensor-parallel) parameters.
- ZeRO-2 / ZeRO-3: `fully_shard` (FSDP2) per layer, reshard_after_forward False / True; gradients
  are reduce-scattered (averaged) by FSDP itself. With offload="params" the shards live in host
  memory (FSDP2's `CPUOffloadPolicy`): copied to the device for each all-gather, gradients copied back,
  and the optimizer steps them on the CPU.
All work on the local shards of DTensor parameters, so they compose with tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["BUCKET_BYTES", "apply_fsdp", "average_gradients", "ShardedOptimizer", "param_groups_by_kind", "local"]

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb=25 (torch.nn.parallel.DistributedDataParallel)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def apply_fsdp(part: nn.Module, layer_paths: Sequence[str], dp_mesh: DeviceMesh, *, zero_stage: int,
               offload_params: bool = False) -> None:
    """`fully_shard` each layer of `part`, then `part` itself (for the parameters outside layers).

    offload_params: the shards in host memory (pinned when the device is a GPU, so copies run async)."""
    reshard = zero_stage == 3
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_params else OffloadPolicy()
    for path in layer_paths:
        sub = part.get_submodule(path)
        if any(True for _ in sub.parameters()):
            fully_shard(sub, mesh=dp_mesh, reshard_after_forward=reshard, offload_policy=policy)
    fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard, offload_policy=policy)


@torch.no_grad()
def average_gradients(params: Iterable[nn.Parameter], dp_mesh: DeviceMesh) -> None:
    """Average gradients over the data-parallel group in ~BUCKET_BYTES flat buckets (ZeRO-0/1)."""
    if dp_mesh.size() == 1:
        return
    group = dp_mesh.get_group()
    grads = [local(p.grad) for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for g in [*same, None]:
            if g is not None:
                bucket.append(g)
                size += g.numel() * g.element_size()
            if bucket and (g is None or size >= BUCKET_BYTES):
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat, group=group)
                flat /= dp_mesh.size()
                offset = 0
                for b in bucket:
                    b.copy_(flat[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()
                bucket, size = [], 0


def param_groups_by_kind(params: Iterable[nn.Parameter]) -> list[dict]:
    """Parameters split into DTensor and plain groups: foreach optimizers cannot mix the two in one group."""
    params = [p for p in params if p.requires_grad]
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": g} for g in groups if g]


class ShardedOptimizer:
    """ZeRO-1: this rank's optimizer holds state only for the parameters it owns.

    `step()` expects averaged gradients; it updates the owned parameters and broadcasts every
    parameter from its owner so all data-parallel replicas stay identical.
    """

    def __init__(self, params: Sequence[nn.Parameter], make_optimizer: Callable[[list], torch.optim.Optimizer],
                 dp_mesh: DeviceMesh) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.dp_mesh = dp_mesh
        size = dp_mesh.size()
        # Assignment in a deterministic order every rank agrees on (largest first, ties to lowest rank).
        load = [0] * size
        owner_of: dict[int, int] = {}
        for i in sorted(range(len(self.params)), key=lambda i: (-local(self.params[i]).numel(), i)):
            r = min(range(size), key=lambda k: (load[k], k))
            load[r] += local(self.params[i]).numel()
            owner_of[i] = r
        self.owner = [owner_of[i] for i in range(len(self.params))]
        me = dp_mesh.get_local_rank()
        self.owned = [p for p, r in zip(self.params, self.owner, strict=True) if r == me]
        self.optimizer = make_optimizer(param_groups_by_kind(self.owned)) if self.owned else None

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups if self.optimizer else []

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Update the owned parameters, then one broadcast per (owner, dtype) of its parameters packed flat.

        One collective per owner rather than per tensor: on gloo each collective costs a latency of
        0.1–several ms, which per-tensor broadcasts paid dozens of times a step.
        """
        if self.optimizer is not None:
            self.optimizer.step()
        group = self.dp_mesh.get_group()
        ranks = dist.get_process_group_ranks(group)
        me = self.dp_mesh.get_local_rank()
        for r in range(self.dp_mesh.size()):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p, owner in zip(self.params, self.owner, strict=True):
                if owner == r:
                    by_dtype.setdefault(local(p).dtype, []).append(local(p))
            for tensors in by_dtype.values():
                if r == me:
                    flat = torch.cat([t.reshape(-1) for t in tensors])
                else:
                    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype,
                                       device=tensors[0].device)
                dist.broadcast(flat, src=ranks[r], group=group)
                if r != me:
                    offset = 0
                    for t in tensors:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
