"""Joining a torchrun job that may be a restart of a failed attempt.

torchrun's default (static) rendezvous keeps one TCPStore for the whole job, and `init_process_group`
keys its bootstrap under the same names ("default_pg/...") on every attempt. After a restart
(`--max-restarts`) the new workers then read the dead workers' addresses that attempt 0 left in
the store and gloo fails with "connectFullMesh failed ... Connection refused" (the same root cause
as pytorch/pytorch#135712 for the c10d rendezvous and NCCL). Each attempt here joins through the
store under a prefix naming the attempt (TORCHELASTIC_RESTART_COUNT, which torchelastic increments
on every agent together when it restarts the worker group), so attempts never read each other's keys.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

__all__ = ["restart_count", "init_process_group"]


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (0 on the first attempt or without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_process_group(backend: str, *, timeout: timedelta = timedelta(minutes=10)) -> None:
    """`dist.init_process_group` from the torchrun environment, isolated from earlier attempts' keys."""
    if restart_count() == 0 or "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"autopar/attempt{restart_count()}", store),
                            rank=rank, world_size=world, timeout=timeout)
