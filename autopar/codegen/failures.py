"""When one rank of a job fails, the others say which rank failed and why, instead of a bare socket error.

A rank that raises inside a collective entry point (a training step, an evaluation, a checkpoint save or
load) writes its error to the job's key-value store (the
rendezvous store torchrun and `init_process_group` already run) before the exception leaves it.
Its peers are then stopped by the collective they were blocked in: at once when the failing
process exits (gloo and NCCL see the closed connection), at the process group's timeout otherwise.
Whatever they raise, they first look in the store: if a peer published a failure, they raise
`PeerFailedError` naming it, so every rank's log points at the rank to look at.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from autopar.errors import PeerFailedError

__all__ = ["named_failures"]

_KEY = "autopar/failed/{rank}"


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # no default group, or no store behind it
        return None


def _published(store, world: int, me: int) -> list[tuple[int, str]]:
    out = []
    for rank in range(world):
        key = _KEY.format(rank=rank)
        if rank != me and store.check([key]):
            out.append((rank, store.get(key).decode(errors="replace")))
    return out


@contextmanager
def named_failures(what: str) -> Iterator[None]:
    """Run `what` (e.g. "train_step"); on failure publish this rank's error or name the peer that failed."""
    try:
        yield
    except Exception as e:
        if not dist.is_initialized() or (store := _store()) is None:
            raise
        me, world = dist.get_rank(), dist.get_world_size()
        try:
            peers = _published(store, world, me)
            if not peers:
                store.set(_KEY.format(rank=me), f"{type(e).__name__}: {e}"[:2000])
        except Exception:  # the store itself is gone (its host rank died): the original error is all we have
            raise e from None
        if peers:
            rank, message = peers[0]
            raise PeerFailedError(f"rank {rank} failed during {what} ({message.splitlines()[0][:300]}); rank {me} "
                                  "stopped with it. Look at rank "
                                  f"{rank}'s error; this rank's own was: {type(e).__name__}") from e
        raise
