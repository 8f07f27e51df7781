"""State dicts of a parallel model: gathered to one full single-device state dict, or saved and loaded
sharded through `torch.distributed.checkpoint` (DCP), keyed by the original parameter names.

Optimizer state is keyed by parameter name too (`"<param>.<state>"`), not by the optimizer's
integer ids, so DCP can deduplicate replicated entries and place sharded ones (DTensor) correctly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["model_state", "full_model_state", "full_gradients", "optimizer_state", "init_optimizer_state",
           "save", "load"]


def model_state(parts: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Sharded model state of this rank (DTensors for sharded parameters), original names."""
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        state.update(part.state_dict())
    return state


def full_model_state(parts: Sequence[nn.Module], pp_mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """The full single-device state dict (CPU tensors), on every rank.

    DTensors are gathered over their own mesh (every rank of a pipeline stage holds the same names, in
    the same order), then the stages' dicts are exchanged over the pipeline group.
    """
    mine = {}
    for name, value in sorted(model_state(parts).items()):
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
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            mine[name] = g.detach().cpu().clone()
    if pp_mesh.size() == 1:
        return mine
    gathered: list[Any] = [None] * pp_mesh.size()
    dist.all_gather_object(gathered, mine, group=pp_mesh.get_group())
    return {k: v for d in gathered for k, v in d.items()}


def _param_names(parts: Sequence[nn.Module]) -> dict[int, str]:
    return {id(p): name for part in parts for name, p in part.named_parameters()}


def optimizer_state(optimizer: torch.optim.Optimizer | None, parts: Sequence[nn.Module]) -> dict[str, Any]:
    """Live optimizer state tensors keyed "<param name>.<state key>", plus hyper-parameters per group."""
    if optimizer is None:
        return {}
    names = _param_names(parts)
    state: dict[str, Any] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key != "params" and isinstance(value, (int, float, bool)):
                state[f"param_groups.{gi}.{key}"] = value
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                state[f"{names[id(p)]}.{key}"] = value
    return state


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer | None) -> None:
    """Create state tensors (so a checkpoint can be loaded into them) with a step at lr=0 on zero grads."""
    if optimizer is None or optimizer.state:
        return
    saved = []
    for group in optimizer.param_groups:
        saved.append(group["lr"])
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr
        for p in group["params"]:
            p.grad = None


def save(path: str, parts: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None) -> None:
    dcp.save({"model": model_state(parts), "optim": optimizer_state(optimizer, parts)}, checkpoint_id=path)


def load(path: str, parts: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None) -> None:
    """Load in place (same layout as the save); hyper-parameters of the optimizer groups are restored."""
    init_optimizer_state(optimizer)
    model = model_state(parts)
    optim = optimizer_state(optimizer, parts)
    state = {"model": model, "optim": optim}
    dcp.load(state, checkpoint_id=path)  # tensors are loaded in place; plain values come back in `state`
    if optimizer is None:
        return
    names = _param_names(parts)
    for gi, group in enumerate(optimizer.param_groups):
        for key in [k for k in group if k != "params"]:
            group[key] = state["optim"].get(f"param_groups.{gi}.{key}", group[key])
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    optimizer.state[p][key] = state["optim"][f"{names[id(p)]}.{key}"]
