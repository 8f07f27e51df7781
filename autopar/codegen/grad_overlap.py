"""ZeRO-0/1 gradient all-reduce overlapped with backward, by bucket, as DDP and Megatron-Core run it.

The step's dense gradients are packed into ~BUCKET_BYTES flat buckets per dtype, built from the
parameters in reverse registration order (the order backward produces their gradients). A
post-accumulate-grad hook counts each parameter's gradients in the step; when a parameter has had its
last one (m micro-batches times the number of this rank's pipeline stages holding it: autograd
accumulates every use inside one backward into one firing), it is ready, and every bucket whose
parameters are all ready is all-reduced asynchronously, strictly in bucket order, so every rank issues
the same collectives in the same order. Nothing launches before the step's last micro-batch's backward
(under pipelining: the last backward of each stage holding the parameter).

`finish` completes the step whatever happened: parameters that never got their last gradient (unused,
data-dependent branches) and the buckets behind them are reduced then, synchronously, as
`data_parallel.reduce_gradients` reduces everything without overlap; a bucket whose parameter got a
gradient after its launch (a reentrant checkpoint firing a parameter twice per backward) is reduced again
from the gradients. Then it waits for the launched buckets and unpacks and divides them, as the
after-backward path does: the same sums, the same division, bit for bit (a sum of two values is exact
in either order; over more ranks an all-reduce's order of addition is the collective's, as always).

Hooks are registered after the distributed optimizer's (autopar.codegen.dist_optimizer), so a 16-bit
gradient is already added into the fp32 main gradient when its parameter is counted ready; a tensor-parallel
gradient is given its parameter's placements before it is packed (tensor_parallel.align_grad_placements:
a local slice, no communication).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.codegen import data_parallel
from autopar.codegen.data_parallel import grad_of, local, reduce_gradients
from autopar.codegen.tensor_parallel import align_grad_placements

__all__ = ["OverlappedGradReduce", "Launch", "pack_buckets"]


def pack_buckets(params: Sequence[nn.Parameter], dtype_of: Callable[[nn.Parameter], torch.dtype],
                 bucket_bytes: int) -> list[list[nn.Parameter]]:
    """`params` (in the order given) packed into buckets of one dtype each (`dtype_of`), a bucket closed once it
    holds ≥ bucket_bytes of this rank's elements; each dtype's partial last bucket closes after every parameter
    is placed. Shared by the gradient all-reduce (reverse registration order) and ZeRO-1's parameter broadcast
    (autopar.codegen.param_prefetch, forward order)."""
    open_: dict[torch.dtype, tuple[list[nn.Parameter], int]] = {}
    buckets: list[list[nn.Parameter]] = []
    for p in params:
        dtype = dtype_of(p)
        ps, size = open_.get(dtype, ([], 0))
        ps, size = [*ps, p], size + local(p).numel() * dtype.itemsize
        if size >= bucket_bytes:
            buckets.append(ps)
            open_.pop(dtype, None)
        else:
            open_[dtype] = (ps, size)
    return buckets + [ps for ps, _ in open_.values()]


@dataclass(frozen=True)
class Launch:
    """One bucket's all-reduce: which bucket, whether a backward hook launched it (else `finish`, after
    backward), and how many gradients the step's hooks had counted by then (all parameters together)."""
    bucket: int
    in_backward: bool
    grads_seen: int


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    pending: int  # parameters not yet ready
    work: dist.Work | None = None
    flat: torch.Tensor | None = None
    stale: bool = False  # a parameter got another gradient after the launch


class OverlappedGradReduce:
    """The dense gradients of one rank, averaged over `mesh` (dp·cp) overlapped with the step's backward.

    params: this rank's dense trainable parameters, each once, in registration order; uses[id(p)]: how
    many of this rank's stage modules hold p; micro_batches: m. `overlap` False runs the after-backward
    path (`data_parallel.average_gradients`) instead. `launches`: the last step's trace."""

    def __init__(self, params: Sequence[nn.Parameter], uses: dict[int, int], mesh: DeviceMesh, *,
                 micro_batches: int, bucket_bytes: int | None = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.mesh = mesh
        self.overlap = True
        self.launches: list[Launch] = []
        self._expected = {id(p): micro_batches * uses.get(id(p), 1) for p in self.params}
        self._buckets = self._build(bucket_bytes if bucket_bytes is not None else data_parallel.BUCKET_BYTES)
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b.params}
        self._armed = False
        self._seen: dict[int, int] = {}
        self._next = 0  # the next bucket to launch
        self._grads_seen = 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _build(self, bucket_bytes: int) -> list[_Bucket]:
        """Buckets in launch order: reverse registration order (`pack_buckets`)."""
        return [_Bucket(ps, len(ps)) for ps in pack_buckets(list(reversed(self.params)), self._grad_dtype,
                                                             bucket_bytes)]

    @staticmethod
    def _grad_dtype(p: nn.Parameter) -> torch.dtype:
        main = getattr(p, "main_grad", None)
        return main.dtype if main is not None else p.dtype

    @property
    def buckets(self) -> int:
        return len(self._buckets)

    def start(self) -> None:
        """Before the step's first forward: counts reset, hooks armed (outside a step they count nothing)."""
        self._armed = self.overlap and self.mesh.size() > 1
        self._seen = {}
        self._next = 0
        self._grads_seen = 0
        self.launches = []
        for b in self._buckets:
            b.pending, b.work, b.flat, b.stale = len(b.params), None, None, False

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        key = id(p)
        n = self._seen[key] = self._seen.get(key, 0) + 1
        self._grads_seen += 1
        bucket = self._buckets[self._bucket_of[key]]
        if n > self._expected[key]:
            bucket.stale = bucket.stale or bucket.work is not None
            return
        if n < self._expected[key]:
            return
        bucket.pending -= 1
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            self._launch(self._next, in_backward=True)
            self._next += 1

    @torch.no_grad()
    def _launch(self, i: int, *, in_backward: bool) -> None:
        b = self._buckets[i]
        align_grad_placements(b.params)
        b.flat = torch.cat([local(grad_of(p)).reshape(-1) for p in b.params])
        b.work = dist.all_reduce(b.flat, group=self.mesh.get_group(), async_op=True)
        self.launches.append(Launch(i, in_backward, self._grads_seen))

    @torch.no_grad()
    def finish(self) -> None:
        """After backward: the rest reduced, every launched bucket waited for, unpacked and divided."""
        if not self._armed:
            data_parallel.average_gradients(self.params, self.mesh)
            return
        self._armed = False
        launched = self._buckets[:self._next]
        rest = [p for b in self._buckets[self._next:] for p in b.params]
        rest += [p for b in launched if b.stale for p in b.params]
        divisor = self.mesh.size()
        for b in launched:
            if b.work is None:
                continue
            b.work.wait()
            if b.stale:
                continue
            b.flat /= divisor
            offset = 0
            for p in b.params:
                g = local(grad_of(p))
                g.copy_(b.flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            b.flat = b.work = None
        if rest:  # as the after-backward path: only the gradients that exist, bucketed from scratch
            reduce_gradients(list(reversed(rest)), self.mesh, divisor=divisor)
            self.launches += [Launch(i, False, self._grads_seen) for i in range(self._next, len(self._buckets))]
