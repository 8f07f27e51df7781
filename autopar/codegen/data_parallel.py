"""Data parallelism and ZeRO stages 0–3 over the mesh's "dp" axis (Rajbhandari et al. 2020).

- ZeRO-0: every rank keeps everything; gradients are averaged by bucketed all-reduce, launched during the
  last micro-batch's backward (autopar.codegen.grad_overlap; `average_gradients` is the after-backward path).
- ZeRO-1: gradients are averaged the same way; each rank keeps optimizer state for, and updates,
  only the parameters it owns (a greedy size-balanced partition), then broadcasts them, packed into
  one flat buffer per owner. The optimizer stays the user's own object over every parameter.
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
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["BUCKET_BYTES", "apply_fsdp", "average_gradients", "reduce_gradients", "Zero1Partition",
           "split_mixed_groups", "local", "grad_of", "as_param_layout"]

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb=25 (torch.nn.parallel.DistributedDataParallel)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def as_param_layout(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient laid out as its parameter (a vocab-parallel head's can come back replicated)."""
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient a step reduces, clips and steps: the fp32 main gradient where the parameter has one
    (ZeRO-1 under a 16-bit policy, autopar.codegen.dist_optimizer), else `p.grad`."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def apply_fsdp(part: nn.Module, layer_paths: Sequence[str], dp_mesh: DeviceMesh, *, zero_stage: int,
               offload_params: bool = False, ignored_params: set[nn.Parameter] | None = None,
               mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """`fully_shard` each layer of `part`, then `part` itself (for the parameters outside layers).

    offload_params: the shards in host memory (pinned when the device is a GPU, so copies run async).
    ignored_params: left unsharded, their gradients not reduced (expert parameters no other rank holds).
    mp_policy: the dtypes FSDP2 gathers parameters and reduces gradients in (autopar.codegen.precision)."""
    reshard = zero_stage == 3
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_params else OffloadPolicy()
    mp = mp_policy or MixedPrecisionPolicy()
    for path in layer_paths:
        sub = part.get_submodule(path)
        if any(True for _ in sub.parameters()):
            fully_shard(sub, mesh=dp_mesh, reshard_after_forward=reshard, offload_policy=policy,
                        ignored_params=ignored_params, mp_policy=mp)
    fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard, offload_policy=policy,
                ignored_params=ignored_params, mp_policy=mp)


@torch.no_grad()
def average_gradients(params: Iterable[nn.Parameter], dp_mesh: DeviceMesh) -> None:
    """Average gradients over the data-parallel group in ~BUCKET_BYTES flat buckets (ZeRO-0/1)."""
    reduce_gradients(params, dp_mesh, divisor=dp_mesh.size())


@torch.no_grad()
def reduce_gradients(params: Iterable[nn.Parameter], mesh: DeviceMesh, *, divisor: int) -> None:
    """Sum gradients over `mesh`'s group in ~BUCKET_BYTES flat buckets, then divide them by `divisor` (the
    group's size for an average; expert parallelism divides by more ranks than hold the experts)."""
    grads = [local(g) for p in params if (g := grad_of(p)) is not None]
    if mesh.size() == 1:
        if divisor != 1:
            for g in grads:
                g.div_(divisor)
        return
    group = mesh.get_group()
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
                flat /= divisor
                offset = 0
                for b in bucket:
                    b.copy_(flat[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()
                bucket, size = [], 0


def split_mixed_groups(optimizer: torch.optim.Optimizer) -> None:
    """Split each parameter group that mixes DTensor and plain parameters into two with the same settings:
    foreach optimizers cannot mix the two in one group, and the user's groups (by name) do not know which
    of their parameters tensor parallelism or FSDP made DTensors. Call before any step or LR scheduler."""
    groups = []
    for group in optimizer.param_groups:
        kinds = [isinstance(p, DTensor) for p in group["params"]]
        if all(kinds) or not any(kinds):
            groups.append(group)
            continue
        for want in (True, False):
            sub = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            sub["params"] = [p for p, k in zip(group["params"], kinds, strict=True) if k == want]
            if "param_names" in group:
                sub["param_names"] = [n for n, k in zip(group["param_names"], kinds, strict=True) if k == want]
            groups.append(sub)
    optimizer.param_groups = groups


class Zero1Partition:
    """ZeRO-1: which data-parallel rank updates each parameter, and the broadcast that follows.

    The optimizer is the user's, over every parameter; after the gradient reduction this rank drops the
    gradients of the parameters it does not own (`drop_unowned_grads`), so the optimizer step skips them
    and creates state for the owned ones only, then every parameter is broadcast from its owner
    (`broadcast_`). The optimizer object, its parameter groups and LR schedules stay the user's. Expert
    parameters (`autopar.codegen.experts`) differ between the ranks of an EP group: they are owned and
    broadcast within `expert_mesh`, the ranks holding the same experts.
    """

    def __init__(self, params: Sequence[nn.Parameter], dp_mesh: DeviceMesh, *,
                 expert_params: Sequence[nn.Parameter] = (), expert_mesh: DeviceMesh | None = None) -> None:
        experts = {id(p) for p in expert_params}
        self.params = [p for p in params if p.requires_grad]
        self.dp_mesh = dp_mesh
        parts = [([p for p in self.params if id(p) not in experts], dp_mesh)]
        if experts:
            if expert_mesh is None:
                raise ValueError("Zero1Partition: expert_params need their expert_mesh")
            parts.append(([p for p in self.params if id(p) in experts], expert_mesh))
        # (parameters, mesh, owner of each) per partition; owners in a deterministic order every rank of the
        # mesh agrees on (largest first, ties to lowest rank)
        self.partitions = [(ps, mesh, self._owners(ps, mesh.size())) for ps, mesh in parts]
        self.owned = [p for ps, mesh, owners in self.partitions for p, r in zip(ps, owners, strict=True)
                      if r == mesh.get_local_rank()]
        self._owned_ids = {id(p) for p in self.owned}

    @staticmethod
    def _owners(params: Sequence[nn.Parameter], size: int) -> list[int]:
        load = [0] * size
        owner_of: dict[int, int] = {}
        for i in sorted(range(len(params)), key=lambda i: (-local(params[i]).numel(), i)):
            r = min(range(size), key=lambda k: (load[k], k))
            load[r] += local(params[i]).numel()
            owner_of[i] = r
        return [owner_of[i] for i in range(len(params))]

    def owns(self, p: nn.Parameter) -> bool:
        return id(p) in self._owned_ids

    def drop_unowned_grads(self) -> None:
        for p in self.params:
            if id(p) not in self._owned_ids:
                p.grad = None

    @torch.no_grad()
    def broadcast_(self, tensor_of: Callable[[nn.Parameter], torch.Tensor] = local) -> None:
        """Every parameter from its owner, one broadcast per (owner, dtype) of its parameters packed flat.
        `tensor_of`: the local tensor sent and received for a parameter (its own local shard, or another
        tensor standing for it, as the fp32 masters do for a checkpoint).

        One collective per owner rather than per tensor: on gloo each collective costs a latency of
        0.1–several ms, which per-tensor broadcasts paid dozens of times a step.
        """
        for params, mesh, owners in self.partitions:
            if mesh.size() > 1:
                self._broadcast([tensor_of(p) for p in params], mesh, owners)

    @staticmethod
    def _broadcast(tensors: Sequence[torch.Tensor], mesh: DeviceMesh, owners: Sequence[int]) -> None:
        group = mesh.get_group()
        ranks = dist.get_process_group_ranks(group)
        me = mesh.get_local_rank()
        for r in range(mesh.size()):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t, owner in zip(tensors, owners, strict=True):
                if owner == r:
                    by_dtype.setdefault(t.dtype, []).append(t)
            for same in by_dtype.values():
                if r == me:
                    flat = torch.cat([t.reshape(-1) for t in same])
                else:
                    flat = torch.empty(sum(t.numel() for t in same), dtype=same[0].dtype, device=same[0].device)
                dist.broadcast(flat, src=ranks[r], group=group)
                if r != me:
                    offset = 0
                    for t in same:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
