"""Process group and device mesh: the ("pp", "dp", "cp", "tp") grid every other codegen step slices.

tp is the innermost (fastest-varying) axis, so consecutive ranks — the GPUs of one node under
torchrun — form a tensor-parallel group; cp next, so a context-parallel group stays inside a node
where it fits (its K/V exchange on NVLink); pp is outermost, so pipeline neighbours may sit on other
nodes (Narayanan et al. 2021, §3.3: TP inside a node, PP across nodes). Gradients are reduced over
the flattened ("dp", "cp") axis "dp_cp": cp ranks hold the same weights and see other tokens.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.codegen.device import backend_for
from autopar.codegen.elastic import init_process_group
from autopar.config import ParallelConfig
from autopar.errors import PlanMismatchError

__all__ = ["MESH_AXES", "GRAD_AXIS", "init_distributed", "build_mesh"]

MESH_AXES = ("pp", "dp", "cp", "tp")
GRAD_AXIS = "dp_cp"  # the flattened ("dp", "cp") axis gradients are averaged and ZeRO shards over


def init_distributed(config: ParallelConfig, device: torch.device, *, timeout_s: float = 600.0) -> None:
    """Initialise the default process group (unless the user already has) and check its size.

    Under torchrun the rendezvous comes from the environment; outside it a plan for one process
    still works (a private single-rank group is created). NCCL for CUDA, gloo otherwise.
    """
    if not dist.is_initialized():
        if "RANK" not in os.environ and config.world_size == 1:
            # one process needs no rendezvous: an in-memory store, no port to find free (a port probed free
            # can be taken by another process's connection before the store binds it: EADDRINUSE)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s))
        elif "RANK" not in os.environ:
            raise PlanMismatchError(
                f"the plan needs {config.world_size} processes (tp·cp·pp·dp = {config.tp}·{config.cp}·{config.pp}·"
                f"{config.dp}) but this is not a distributed launch; run "
                f"`torchrun --nproc_per_node {config.world_size} your_script.py`"
            )
        else:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s))  # restart-safe (torchrun)
    world = dist.get_world_size()
    if world != config.world_size:
        raise PlanMismatchError(
            f"the plan needs {config.world_size} processes (tp·cp·pp·dp = {config.tp}·{config.cp}·{config.pp}·"
            f"{config.dp}) but the world size is {world}; launch with `torchrun --nproc_per_node {config.world_size}` "
            f"(or make a plan for {world} process{'' if world == 1 else 'es'})"
        )


def build_mesh(config: ParallelConfig, device: torch.device) -> tuple[DeviceMesh, DeviceMesh]:
    """The 4-D mesh (pp, dp, cp, tp), axes of size 1 kept so every rank can slice every axis, and its
    flattened ("dp", "cp") axis `GRAD_AXIS`, over which gradients are averaged and ZeRO shards."""
    mesh = init_device_mesh(device.type, (config.pp, config.dp, config.cp, config.tp), mesh_dim_names=MESH_AXES)
    return mesh, mesh["dp", "cp"]._flatten(GRAD_AXIS)
