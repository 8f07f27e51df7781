"""State dicts of a parallel model: gathered to one full single-device state dict, or saved and loaded
sharded through `torch.distributed.checkpoint` (DCP), keyed by the original parameter names.

Optimizer state is keyed by parameter name too (`"<param>.<state>"`), not by the optimizer's
integer ids, so DCP can deduplicate replicated entries and place sharded ones (DTensor) correctly.

Under ZeRO-1 with a 16-bit policy (`DistributedOptimizer`) the parameters are 16-bit roundings of fp32
masters that only their owners hold: the model entries of trained parameters are then the masters — an
owner writes its masters, the other ranks write nothing for them (DCP takes each name from the rank that
lists it), a load reads the owned masters and rounds the rest into the 16-bit parameters, and the full state
dict broadcasts the masters from their owners. Entries are fp32 under every layout, so checkpoints move
between this layout and the fp32-parameter ones both ways.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from autopar.codegen.data_parallel import grad_of
from autopar.codegen.dist_optimizer import DistributedOptimizer
from autopar.codegen.offload import HostOptimizer

__all__ = ["model_state", "full_model_state", "full_gradients", "optimizer_state", "init_optimizer_state",
           "save", "load", "restore_scalars"]


def _replace_params(state: dict[str, torch.Tensor], parts: Sequence[nn.Module],
                    values: dict[int, torch.Tensor], drop: set[int] | frozenset[int] = frozenset()) -> None:
    """In `state`, every name of a parameter in `values` (by id) ← that value; names of those in `drop` removed."""
    for part in parts:
        for name, p in part.named_parameters(remove_duplicate=False):
            if name in state and id(p) in values:
                state[name] = values[id(p)]
            elif name in state and id(p) in drop:
                del state[name]


def model_state(parts: Sequence[nn.Module], optimizer: Optimizer | None = None, *,
                writing: bool = False) -> dict[str, torch.Tensor]:
    """Sharded model state of this rank (DTensors for sharded parameters), original names. Under a
    `DistributedOptimizer` the trained parameters this rank owns are their fp32 masters, and with `writing`
    the others are left to their owners (module docstring)."""
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        state.update(part.state_dict())
    if isinstance(optimizer, DistributedOptimizer):
        masters = optimizer.master_of()
        drop = {id(p) for p in optimizer.all_params} - masters.keys() if writing else set()
        _replace_params(state, parts, masters, drop)
    return state


def full_model_state(parts: Sequence[nn.Module], pp_mesh: DeviceMesh,
                     optimizer: Optimizer | None = None) -> dict[str, torch.Tensor]:
    """The full single-device state dict (CPU tensors), on every rank; under a `DistributedOptimizer` its
    trained parameters are the fp32 masters, broadcast from their owners.

    DTensors are gathered over their own mesh (every rank of a pipeline stage holds the same names, in
    the same order), then the stages' dicts are exchanged over the pipeline group.
    """
    state = model_state(parts)
    if isinstance(optimizer, DistributedOptimizer):
        _replace_params(state, parts, optimizer.full_precision())
    mine = {}
    for name, value in sorted(state.items()):
        full = value.full_tensor() if isinstance(value, DTensor) else value
        mine[name] = full.detach().cpu().clone()
    if pp_mesh.size() == 1:
        return mine
    gathered: list[Any] = [None] * pp_mesh.size()
    dist.all_gather_object(gathered, mine, group=pp_mesh.get_group())
    out: dict[str, torch.Tensor] = {}
    for d in gathered:
        out.update(d)
    return out


def full_gradients(parts: Sequence[nn.Module], pp_mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """Full gradients (as left by the last step) by parameter name, on every rank; for parity checks."""
    mine = {}
    for name, p in sorted((n, p) for part in parts for n, p in part.named_parameters()):
        if (g := grad_of(p)) is not None:
            g = g.full_tensor() if isinstance(g, DTensor) else g
            mine[name] = g.detach().cpu().clone()
    if pp_mesh.size() == 1:
        return mine
    gathered: list[Any] = [None] * pp_mesh.size()
    dist.all_gather_object(gathered, mine, group=pp_mesh.get_group())
    return {k: v for d in gathered for k, v in d.items()}


def _param_names(parts: Sequence[nn.Module]) -> dict[int, list[str]]:
    """Every name each parameter has in `parts` (a tied weight has several; the stage holding one end of
    a tie knows it by that end's name), in registration order."""
    names: dict[int, list[str]] = {}
    for part in parts:
        for name, p in part.named_parameters(remove_duplicate=False):
            if name not in names.setdefault(id(p), []):
                names[id(p)].append(name)
    return names


Optimizer = torch.optim.Optimizer | HostOptimizer | DistributedOptimizer


def _inner(optimizer: Optimizer | None) -> torch.optim.Optimizer | None:
    """The torch optimizer holding state (ZeRO-1: for this rank's owned parameters only, the others never
    having a gradient at its step); under offload="optimizer" it holds it for the host masters, under a
    `DistributedOptimizer` for the owned fp32 masters."""
    return optimizer.optimizer if isinstance(optimizer, (HostOptimizer, DistributedOptimizer)) else optimizer


def _host(optimizer: Optimizer | None) -> HostOptimizer | DistributedOptimizer | None:
    """The wrapper whose masters the optimizer steps in place of the model's parameters, if any."""
    return optimizer if isinstance(optimizer, (HostOptimizer, DistributedOptimizer)) else None


def _state_names(optimizer: Optimizer | None, parts: Sequence[nn.Module]) -> dict[int, list[str]]:
    """Names of each tensor the optimizer steps: the parameter's, or for a host master its parameter's."""
    names = _param_names(parts)
    host = _host(optimizer)
    return host.master_names(names) if host is not None else names


_HYPER = "hyper."  # "<param name>.hyper.<key>": the scalar hyper-parameters of the parameter's group


def _hyper_keys(optimizer: torch.optim.Optimizer, group: dict) -> list[str]:
    """The group's numeric hyper-parameters among the optimizer's defaults (lr, eps, weight_decay, flags):
    every group has them, under any layout."""
    return [k for k in optimizer.defaults if isinstance(group.get(k), (int, float, bool))]


def optimizer_state(optimizer: Optimizer | None,
                    parts: Sequence[nn.Module]) -> dict[str, Any]:
    """Live optimizer state tensors keyed "<param name>.<state key>" under every name the parameter has
    here, plus the scalar hyper-parameters of its group ("<param name>.hyper.<key>", 0-d float64 tensors),
    so parameter groups with their own settings (no weight decay on norms and biases, a scheduled lr)
    come back per parameter whatever groups the loading layout splits them into.

    Keys name parameters, never the optimizer's integer ids or group indices, which depend on the layout
    (ZeRO-1 ranks hold a subset; TP splits DTensor and plain parameters into two groups): a checkpoint
    saved under one layout is then loadable under any other. Tied weights are saved under each alias, so
    a stage that holds only one end of the tie finds its state.
    """
    names = _state_names(optimizer, parts)
    optimizer = _inner(optimizer)
    if optimizer is None:
        return {}
    state: dict[str, Any] = {}
    for group in optimizer.param_groups:
        hyper = {k: torch.tensor(float(group[k]), dtype=torch.float64) for k in _hyper_keys(optimizer, group)}
        for p in group["params"]:
            for name in names[id(p)]:
                for key, value in optimizer.state.get(p, {}).items():
                    state[f"{name}.{key}"] = value
                for key, value in hyper.items():
                    state[f"{name}.{_HYPER}{key}"] = value.clone()
    return state


@torch.no_grad()
def init_optimizer_state(optimizer: Optimizer | None,
                         updates: Callable[[nn.Parameter], bool] = lambda p: True) -> None:
    """Create state tensors (so a checkpoint can be loaded into them) with a step at lr=0 on zero grads,
    for the parameters this rank `updates` (ZeRO-1: those it owns)."""
    host = _host(optimizer)
    param_of = {id(m): p for p, m in zip(host.params, host.masters, strict=True)} if host is not None else {}
    optimizer = _inner(optimizer)
    if optimizer is None or optimizer.state:
        return
    saved = []  # lr 0: the step moves nothing (AdamW's decoupled weight decay scales by lr too)
    for group in optimizer.param_groups:
        saved.append(group["lr"])
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p) if updates(param_of.get(id(p), p)) else None
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr
        for p in group["params"]:
            p.grad = None


def _strided_alone(value: Any) -> tuple[Placement, ...] | None:
    """For a DTensor whose shard is not one block of the global tensor, a _StridedShard the only placement
    splitting its tensor dim (an expert's [gate; up] halves split over tp, autopar.codegen.expert_tp), the
    placements DCP can write and read (that one replicated); None for every other value."""
    if not isinstance(value, DTensor):
        return None
    places = value.placements
    alone = [i for i, p in enumerate(places) if isinstance(p, _StridedShard)
             and sum(isinstance(q, (Shard, _StridedShard)) and q.dim == p.dim for q in places) == 1]
    return tuple(Replicate() if i in alone else p for i, p in enumerate(places)) if alone else None


def _writable(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with each strided value (`_strided_alone`) replicated over the mesh dim that strides it."""
    return {k: v.redistribute(v.device_mesh, places) if (places := _strided_alone(v)) else v
            for k, v in state.items()}


def save(path: str, parts: Sequence[nn.Module], optimizer: Optimizer | None) -> None:
    """Sharded checkpoint of model and optimizer state by parameter name (collective)."""
    dcp.save({"model": _writable(model_state(parts, optimizer, writing=True)),
              "optim": _writable(optimizer_state(optimizer, parts))}, checkpoint_id=path)


def load(path: str, parts: Sequence[nn.Module], optimizer: Optimizer | None,
         updates: Callable[[nn.Parameter], bool] = lambda p: True, **dcp_kwargs: Any) -> None:
    """Load in place, resharding as needed: DCP reads, for every name this rank holds, the slice of the
    saved global tensor its shard covers, whatever layout (tp, pp, dp, ZeRO stage, world size) saved it.
    The optimizer's hyper-parameters are restored too (collective)."""
    init_optimizer_state(optimizer, updates)
    live = {"model": model_state(parts, optimizer), "optim": optimizer_state(optimizer, parts)}
    state = {k: _writable(v) for k, v in live.items()}
    dcp.load(state, checkpoint_id=path, **dcp_kwargs)  # tensors in place; plain values come back in `state`
    with torch.no_grad():  # strided values were read replicated: this rank's slice back into the live tensor
        for group, values in live.items():
            for k, v in values.items():
                if _strided_alone(v):
                    v.to_local().copy_(state[group][k].redistribute(v.device_mesh, v.placements).to_local())
    restore_scalars(state["optim"], optimizer, parts)


def restore_scalars(loaded: dict[str, Any], optimizer: Optimizer | None,
                    parts: Sequence[nn.Module]) -> None:
    """Put the loaded non-tensor optimizer values (hyper-parameters, float steps) back in the optimizer."""
    if isinstance(optimizer, HostOptimizer):  # the parameters were just loaded: the host masters copy them
        optimizer.reload_masters()
    elif isinstance(optimizer, DistributedOptimizer):  # the masters were loaded: the owners round them again
        optimizer.weights_from_masters()
    names = _state_names(optimizer, parts)
    optimizer = _inner(optimizer)
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        first = names[id(group["params"][0])][0] if group["params"] else None
        for key in _hyper_keys(optimizer, group) if first else ():
            value = loaded.get(f"{first}.{_HYPER}{key}")
            if isinstance(value, torch.Tensor):
                group[key] = type(group[key])(value.item())
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    optimizer.state[p][key] = loaded[f"{names[id(p)][0]}.{key}"]
