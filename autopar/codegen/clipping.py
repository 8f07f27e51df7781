"""The global gradient norm over every rank, and clipping by it (torch.nn.utils.clip_grad_norm_'s rule).

Each element of the model's gradient is counted exactly once over the whole job: a rank adds the
squares of its local gradient shards, except where another rank holds the same values —

- a DTensor replicated along a mesh axis counts only at coordinate 0 of that axis (its shards along
  Shard axes are distinct and all count: TP shards, FSDP shards over the flattened ("dp", "cp") axis);
- a plain tensor is replicated over the data-parallel, context-parallel and tensor-parallel axes its
  DTensor mesh (if any) does not cover, and counts only at coordinate 0 of each (cp ranks hold the same
  weights and, after the gradient average over dp·cp, the same gradients);
- an expert parameter (expert parallelism: its bank split over the ep ranks, dp ranks or folded over tp and
  dp) counts on every ep rank, once among the ranks holding the same experts (`ExpertParallel.grad_mesh`:
  edp·cp, and tp under unfolded sequence parallelism) unless FSDP shards it over them, and once over tp
  where the tp ranks hold the same experts (not folded);
- a weight several pipeline stages hold (a tied embedding and head, a root-level parameter) counts on
  the first stage holding it only (`SharedGradients.counted_once`), and a weight tied inside one stage
  is one parameter;

then one all-reduce (sum) over the default group gives the squared norm on every rank. With fp16 loss
scaling the same sum says whether any shard overflowed (it is then not finite), so no extra collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from autopar.codegen.data_parallel import grad_of, local
from autopar.codegen.elastic import collective_device
from autopar.codegen.experts import ExpertParallel, expert_grad_axes
from autopar.codegen.mesh import GRAD_AXIS

__all__ = ["counted_locally", "global_grad_norm", "clip_grads_"]

_REPLICATED_AXES = ("dp", "cp", "tp")  # axes over which a plain parameter is a copy (pp holds different stages)
_FLATTENED = {GRAD_AXIS: ("dp", "cp")}  # FSDP shards over the flattened axis: a DTensor on it covers both


def _local_ranks(mesh: DeviceMesh) -> dict[str, int]:
    """This rank's coordinate on each replicated axis. `mesh.get_local_rank(name)`, not
    `mesh[name].get_local_rank()`: slicing a DeviceMesh builds a sub-mesh (~0.1-0.3 ms on a CPU), and asked
    per parameter and axis it was most of a gpt-tiny optimizer phase (rank 0: 34 ms CPU time of a step)."""
    return {axis: mesh.get_local_rank(axis) for axis in _REPLICATED_AXES}


def counted_locally(p: nn.Parameter, mesh: DeviceMesh, ranks: dict[str, int] | None = None) -> bool:
    """Whether this rank's shard of `p`'s gradient is the one copy counted in the global norm (`ranks`:
    `_local_ranks(mesh)`, computed once per norm)."""
    ranks = ranks if ranks is not None else _local_ranks(mesh)
    covered: set[str] = set()
    g = grad_of(p) if isinstance(grad_of(p), DTensor) else p  # the gradient's own placements, when it has them
    if isinstance(g, DTensor):
        names = g.device_mesh.mesh_dim_names or ()
        covered = {axis for name in names for axis in _FLATTENED.get(name, (name,))}
        for i, placement in enumerate(g.placements):
            if isinstance(placement, Replicate) and g.device_mesh.get_local_rank(i) != 0:
                return False
    return all(ranks[axis] == 0 for axis in _REPLICATED_AXES if axis not in covered)


def _expert_counted_locally(experts: ExpertParallel, mesh: DeviceMesh) -> bool:
    """Whether this rank counts its expert shards: the first of the ranks holding the same experts (all of
    them when FSDP shards the experts over those ranks), and the first tp rank unless they include tp."""
    tp_inside = "tp" in expert_grad_axes(experts.config) or experts.config.ep_folded  # tp ranks: other experts
    return ((experts.fsdp or experts.grad_mesh.get_local_rank() == 0)
            and (tp_inside or mesh.get_local_rank("tp") == 0))


@torch.no_grad()
def global_grad_norm(params: Sequence[nn.Parameter], mesh: DeviceMesh, skip: set[int] | frozenset[int] = frozenset(),
                     experts: ExpertParallel | None = None) -> float:
    """The L2 norm of the whole model's gradient (every rank gets the same value; collective).

    `params`: this rank's parameters, each once; `skip`: ids of replicas counted elsewhere; `experts`: the
    expert banks split over ep ranks, if any."""
    device = next((local(g).device for p in params if (g := grad_of(p)) is not None),
                  collective_device() if dist.is_initialized() else torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    expert_ids = {id(p) for p in experts.parameters()} if experts is not None else set()
    experts_counted = experts is not None and _expert_counted_locally(experts, mesh)
    ranks = _local_ranks(mesh)
    for p in params:
        if grad_of(p) is None or id(p) in skip:
            continue
        if id(p) in expert_ids:
            if not experts_counted:
                continue
        elif not counted_locally(p, mesh, ranks):
            continue
        g = local(grad_of(p))
        total += torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return math.sqrt(total.item()) if math.isfinite(total.item()) else float("inf")


@torch.no_grad()
def clip_grads_(params: Sequence[nn.Parameter], max_norm: float, total_norm: float) -> None:
    """Scale every local gradient by min(1, max_norm / (total_norm + 1e-6)), as clip_grad_norm_ does."""
    coef = max_norm / (total_norm + 1e-6)
    if coef >= 1.0:
        return
    for p in params:
        if (g := grad_of(p)) is not None:
            local(g).mul_(coef)
