"""Joining a torchrun job that may be a restart of a failed attempt.

torchrun's agents keep one TCPStore across restarts (the static rendezvous always; the c10d one
when it shares its store with the workers, the default), and `init_process_group` keys its bootstrap
under the same names ("default_pg/...") on every attempt. After a restart (`--max-restarts`) the new
workers then read the dead workers' addresses and gloo fails with "connectFullMesh failed ...
Connection refused" (the root cause of pytorch/pytorch#135712, there with NCCL). Each attempt here
joins under a store prefix of its own:

- one agent (GROUP_WORLD_SIZE 1): the attempt is TORCHELASTIC_RESTART_COUNT;
- several agents: their restart counts disagree (an agent whose own workers were healthy restarts
  them without counting), so the workers number the attempt themselves: joins are counted in the
  store in blocks of WORLD_SIZE with compare-and-set, and the block is the attempt;
- a store that is not the agents' (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) is new for every attempt.
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["restart_count", "job_restart_count", "init_process_group", "collective_device"]


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (0 on the first attempt or without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def collective_device() -> torch.device:
    """Where a tensor handed to a collective of the default group must live: NCCL reduces only CUDA tensors
    (a CPU tensor fails with "No backend type associated with device type cpu"), gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def job_restart_count() -> int:
    """How many times the job has been restarted, agreed by every rank (collective): the largest
    TORCHELASTIC_RESTART_COUNT, since an agent restarting healthy workers for a peer's failure does not count."""
    count = torch.tensor([restart_count()], dtype=torch.int64, device=collective_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def _join_block(store: dist.Store, world: int) -> int:
    """The attempt this worker belongs to: joins are numbered in blocks of `world`; a block left
    unfilled by a world of another size is abandoned. State "block:world:joined:<last joiner's id>"
    under one key; the id makes compare-and-set's answer say whose write won."""
    key, state, me = "autopar/joins", "", uuid.uuid4().hex  # "" = no attempt yet: compare_set creates the key
    while True:
        block, size, joined = (int(v) for v in (state or "0:0:0:-").split(":")[:3])
        if size == world and joined < world:
            want, mine = f"{block}:{world}:{joined + 1}:{me}", block
        else:
            want, mine = f"{block + 1}:{world}:1:{me}", block + 1
        got = store.compare_set(key, state, want).decode()
        if got == want:
            return mine
        state = got


def init_process_group(backend: str, *, timeout: timedelta = timedelta(minutes=10)) -> None:
    """`dist.init_process_group` from the torchrun environment, isolated from earlier attempts' keys."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    agents = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if not agent_store or (agents == 1 and restart_count() == 0):
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    attempt = f"restart{restart_count()}" if agents == 1 else f"join{_join_block(store, world)}"
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"autopar/{attempt}", store),
                            rank=rank, world_size=world, timeout=timeout)
