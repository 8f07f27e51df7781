"""Cases for tests/test_param_prefetch.py, run inside gloo ranks: the same model, data and plan trained twice under
ZeRO-1, the owners' parameter broadcast overlapped with the next forward (autopar.codegen.param_prefetch) and
after the step (the old path, `pm.param_prefetch.overlap = False`); losses, reduced gradients and weights of every
step compared bit for bit, a checkpoint saved mid-training (broadcasts in flight) compared file content for file
content, and the overlapped run's bucket waits recorded."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from grad_overlap_cases import bitwise_differences, train_both_ways
from parity_models import batches, make_plan
from precision_cases import adamw
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from autopar.codegen import data_parallel, lm_cross_entropy, parallelize
from autopar.codegen.data_parallel import grad_of, local

__all__ = ["job"]

SAVE_AFTER = 2  # the checkpoint is saved after this step, its broadcasts still in flight


def _train(model, graph, config: dict[str, Any], *, overlap: bool, steps: int, max_grad_norm: float | None,
           root: str) -> dict[str, Any]:
    pm = parallelize(model, make_plan(graph, **config), graph=graph, optimizer=adamw(1e-2),
                     loss_fn=lm_cross_entropy, max_grad_norm=max_grad_norm)
    pm.param_prefetch.overlap = overlap
    broadcasts: list[int] = []  # issued by each step (torch.distributed.broadcast calls)
    count = _count_broadcasts(broadcasts)
    names = {id(p): n for part in pm.modules for n, p in part.named_parameters()}
    losses, grads, waits, in_flight = [], [], [], []
    for step, (x, t) in enumerate(batches(steps), start=1):
        with count:
            losses.append(pm.train_step(pm.local_batch(x), pm.local_batch(t)))
        in_flight.append(pm.param_prefetch.pending)
        grads.append({names[id(p)]: local(g).detach().clone() for p in pm.zero1.params
                      if (g := grad_of(p)) is not None})
        waits.append(list(pm.param_prefetch.last_waits))
        if step == SAVE_AFTER:
            pm.save(root)
    # a user's own `module.state_dict()` after the last step waits for the broadcasts still in flight
    before = pm.param_prefetch.pending
    pm.modules[0].state_dict()
    user = (before, pm.param_prefetch.pending, sorted({w.where for w in pm.param_prefetch.waits}))
    return {"losses": losses, "grads": grads, "weights": pm.state_dict(), "waits": waits, "in_flight": in_flight,
            "user_state_dict": user,
            "buckets": pm.param_prefetch.buckets, "broadcasts": broadcasts[1:] if overlap else [],
            "owner_buckets": _owner_buckets(pm.zero1, data_parallel.BUCKET_BYTES) if overlap else (0, 0)}


class _count_broadcasts:
    """Within `with`: torch.distributed.broadcast counted; each exit appends the count to `into`."""

    def __init__(self, into: list[int]) -> None:
        self.into, self.real = into, dist.broadcast

    def __enter__(self) -> None:
        self.into.append(0)

        def counted(*args, **kwargs):
            self.into[-1] += 1
            return self.real(*args, **kwargs)
        dist.broadcast = counted

    def __exit__(self, *exc) -> None:
        dist.broadcast = self.real


def _owner_buckets(zero1, bucket_bytes: int) -> tuple[int, int]:
    """(Σ_owner its parameters' buckets, ⌈B / bucket_bytes⌉ + dp) over the partitions that broadcast, by hand:
    one bucket closed each time an owner's bytes since the last reach bucket_bytes, in forward order."""
    want = bound = 0
    for params, mesh, owners in zero1.partitions:
        if mesh.size() == 1:
            continue
        nbytes = [local(p).numel() * p.dtype.itemsize for p in params]
        bound += -(-sum(nbytes) // bucket_bytes) + mesh.size()
        for r in range(mesh.size()):
            open_ = 0
            for n, owner in zip(nbytes, owners, strict=True):
                if owner == r:
                    open_ += n
                    if open_ >= bucket_bytes:
                        want, open_ = want + 1, 0
            want += open_ > 0
    return want, bound


def _same(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two loaded checkpoints differ (tensors bit for bit, other values by ==)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in a.keys() | b.keys()
                for d in (_same(a[k], b[k], f"{path}/{k}") if k in a and k in b else [f"{path}/{k}"])]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if a.dtype == b.dtype and torch.equal(a, b) else [path]
    return [] if a == b else [path]


def _checkpoints_differ(old: str, new: str) -> list[str]:
    """On rank 0: the two DCP checkpoints converted to torch.save files and compared."""
    dist.barrier()
    differ: list[str] = []
    if dist.get_rank() == 0:
        loaded = []
        for root in (old, new):
            dcp_to_torch_save(root, root + ".pt")
            loaded.append(torch.load(root + ".pt", weights_only=False))
        differ = _same(*loaded)
    dist.barrier()
    return differ


def case(kind: str, config: dict[str, Any], root: str, *, steps: int = 4, max_grad_norm: float | None = None,
         bucket_bytes: int = 4096) -> dict[str, Any]:
    """Overlapped vs after-step broadcast: the names of gradients and weights that differ (any bit), the losses,
    the checkpoint entries that differ, and the overlapped run's waits per step and bucket count. bucket_bytes:
    small, so a tiny model has several buckets (both runs use it)."""
    old, new = train_both_ways(kind, bucket_bytes, lambda model, graph, overlap: _train(
        model, graph, dict(config), overlap=overlap, steps=steps, max_grad_norm=max_grad_norm,
        root=os.path.join(root, "new" if overlap else "old")))
    return {"case": f"{kind} {config}", **bitwise_differences(old, new),
            "checkpoint_differs": _checkpoints_differ(os.path.join(root, "old"), os.path.join(root, "new")),
            "waits": new["waits"], "old_waits": old["waits"], "in_flight": (old["in_flight"], new["in_flight"]),
            "buckets": new["buckets"], "broadcasts": new["broadcasts"], "owner_buckets": new["owner_buckets"],
            "user_state_dict": new["user_state_dict"]}


def job(root: str, cases: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    return [case(kind, config, os.path.join(root, str(i)), **kw) for i, (kind, config, kw) in enumerate(cases)]
