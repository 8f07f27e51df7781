"""Parameters that more than one place of the model uses: tied weights, and weights the glue reads.

A weight can be used by two units (a language-model head tied to the token embedding) or by the
model's own code outside every unit (a parameter of the root module). Whatever the layout it must
stay one weight:

- inside one stage, after tensor parallelism has replaced the tied modules' parameters by DTensors,
  they are tied again (`retie`): the vocab-parallel embedding and head shard the vocabulary the
  same way, so one sharded parameter serves both;
- across stages, each holding stage keeps a replica (equal at start: every rank starts from rank
  0's weights) and, after the data-parallel reduction, the replicas' gradients are summed over the
  pipeline ranks that hold it (`SharedGradients`), as Megatron-LM's embedding group does, so every
  replica takes the same optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.codegen.data_parallel import grad_of, local
from autopar.errors import PlanMismatchError

__all__ = ["alias_groups", "retie", "stages_holding", "SharedGradients"]


def alias_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """Names of each parameter reachable under several names (tied weights), in registration order."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    path, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        return None
    return (owner, leaf) if leaf in owner._parameters else None


def retie(part: nn.Module, groups: Iterable[tuple[str, ...]], split: set[str]) -> None:
    """Make every name of each alias group that `part` holds point at one parameter again.

    split: the modules the plan's TP patterns shard. An alias outside them whose weight stayed whole, beside
    a sharded one, is a module the forward never calls (capture splits a tie alike wherever it is used): it
    holds the sharded weight too."""
    for names in groups:
        owners = [o for o in (_owner(part, n) for n in names) if o is not None]
        params = [o._parameters[leaf] for o, leaf in owners]
        if len({id(p) for p in params}) <= 1:
            continue
        first = next((p for p in params if isinstance(p, DTensor)), params[0])
        for name, (owner, leaf), p in zip([n for n in names if _owner(part, n) is not None], owners, params,
                                          strict=True):
            unused = not isinstance(p, DTensor) and name.rpartition(".")[0] not in split
            same = unused or (isinstance(p, DTensor) == isinstance(first, DTensor) and p.shape == first.shape
                              and (not isinstance(p, DTensor) or tuple(p.placements) == tuple(first.placements)))
            if not same:
                raise PlanMismatchError(
                    f"parameters {names} are one tied weight, but tensor parallelism shards them differently "
                    f"({getattr(first, 'placements', 'replicated')} vs {getattr(p, 'placements', 'replicated')}); "
                    "capture keeps a tied weight split alike on every side, so this plan was made from another "
                    "graph of the model: re-capture and re-plan it with this autopar version")
            owner._parameters[leaf] = first


def stages_holding(model: nn.Module, stage_of_unit: Mapping[str, int], replicated: Iterable[str],
                   num_stages: int) -> dict[str, tuple[int, ...]]:
    """Canonical name → stages that hold it, for every parameter held by more than one stage.

    A parameter of a unit is held by the unit's stage; one outside every unit (used by the model's
    own code) by every stage, since each stage runs that code.
    """
    skip = set(replicated)
    units = {u for u in stage_of_unit if u not in skip}
    holders: dict[int, set[int]] = {}
    canonical: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
        unit = next((u for u in units if name.startswith(u + ".")), None)
        holders.setdefault(id(p), set()).update({stage_of_unit[unit]} if unit else range(num_stages))
    return {canonical[i]: tuple(sorted(s)) for i, s in holders.items() if len(s) > 1}


class SharedGradients:
    """Sums the gradients of parameters held by several pipeline stages over the ranks holding them."""

    def __init__(self, model: nn.Module, holders: Mapping[str, tuple[int, ...]], pp_mesh_ranks: torch.Tensor,
                 pp: int) -> None:
        """`pp_mesh_ranks`: global ranks as a [pp, dp, tp] tensor (DeviceMesh.mesh); call on every rank."""
        aliases = {n: names for names in alias_groups(model) for n in names}
        self.names = {canon: aliases.get(canon, (canon,)) for canon in holders}
        self.holders = dict(holders)
        self.groups: dict[str, dist.ProcessGroup | None] = {}
        me = dist.get_rank()
        made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for ranks_pp in sorted({tuple(sorted({s % pp for s in stages})) for stages in holders.values()}):
            if len(ranks_pp) < 2:
                made[ranks_pp] = None
                continue
            _, dp, tp = pp_mesh_ranks.shape
            for d in range(dp):
                for t in range(tp):
                    ranks = [int(pp_mesh_ranks[i, d, t]) for i in ranks_pp]
                    group = dist.new_group(ranks)  # collective over the default group: every rank calls it
                    if me in ranks:
                        made[ranks_pp] = group
        for canon, stages in holders.items():
            self.groups[canon] = made.get(tuple(sorted({s % pp for s in stages})))

    def replicas_counted_elsewhere(self, parts: Sequence[tuple[int, nn.Module]]) -> set[int]:
        """Ids of this rank's replicas of shared weights that a global sum over the model (the gradient norm)
        must skip: every replica but the one of the first stage holding the weight."""
        skip: set[int] = set()
        for canon, names in self.names.items():
            first = self.holders[canon][0]
            keep, found_ids = set(), set()
            for index, part in parts:
                for n in names:
                    found = _owner(part, n)
                    if found is not None:
                        pid = id(found[0]._parameters[found[1]])
                        found_ids.add(pid)
                        if index == first:
                            keep.add(pid)
            skip |= found_ids - keep
        return skip

    @torch.no_grad()
    def sync(self, parts: Sequence[nn.Module]) -> None:
        """After the data-parallel reduction: every local replica's gradient ← the sum over holding stages."""
        for canon, names in self.names.items():
            replicas = {}
            for part in parts:
                for n in names:
                    found = _owner(part, n)
                    if found is not None:
                        p = found[0]._parameters[found[1]]
                        replicas[id(p)] = p
            if not replicas:
                continue
            params = list(replicas.values())
            grads = [local(g) if (g := grad_of(p)) is not None else None for p in params]
            like = next((g for g in grads if g is not None), None)
            total = torch.zeros_like(local(params[0])) if like is None else torch.zeros_like(like)
            for g in grads:
                if g is not None:
                    total += g
            group = self.groups.get(canon)
            if group is not None:
                dist.all_reduce(total, group=group)
            for p, g in zip(params, grads, strict=True):
                if g is None:
                    if isinstance(p, DTensor):
                        p.grad = DTensor.from_local(total.clone(), p.device_mesh, p.placements, run_check=False)
                    else:
                        p.grad = total.clone()
                else:
                    g.copy_(total)
