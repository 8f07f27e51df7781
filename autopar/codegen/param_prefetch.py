"""ZeRO-1's parameter broadcast overlapped with the next step's forward, by bucket, as Megatron-Core's
distributed optimizer runs its parameter all-gather (`--overlap-param-gather`).

After the optimizer step every parameter is sent from its owner (autopar.codegen.data_parallel.Zero1Partition,
whose size-balanced owners each hold parameters spread over the whole model). Rather than waiting for all of it
before the step returns, `launch` packs each owner's parameters, in forward (registration) order, into
~BUCKET_BYTES buckets of one dtype (grad_overlap.pack_buckets, the gradient buckets' packer): a bucket is one
broadcast from one owner, packed flat as `Zero1Partition.broadcast_` packs it, so a step issues
Σ_owner ⌈B_owner / BUCKET_BYTES⌉ ≤ ⌈B / BUCKET_BYTES⌉ + dp broadcasts (packing forward-order buckets across
owners would cost up to dp broadcasts per bucket). The buckets are issued asynchronously in the forward order of
their first parameters (the owners interleaved), the same order on every rank, and `launch` returns. A forward
pre-hook on every module that holds a parameter of a bucket waits for every such bucket (once: a bucket spanning
modules is waited for and unpacked by the first) and unpacks it into the parameters: the next forward (its
first micro-batch; each pipeline stage's first) waits only for what the module about to run needs, while the
buckets behind it travel. A module holding parameters whose own forward never runs (nn.MultiheadAttention's
out_proj, an nn.ParameterList: a parent's code reads them) is found in the first step, and its buckets are
waited for as its part's forward starts. A module inside a compiled region (autopar.codegen.compile) gets no
hook (dynamo would trace its waits); the compiled module waits for its whole subtree's buckets before its
compiled call.

Until its bucket is waited for, a non-owner's parameter holds the previous step's value. So everything that
reads parameters outside the forward first calls `wait_pending` (ParallelModel: the optimizer step, eval,
forward, state dicts, saves, loads; checkpoint.Checkpointer; any module's own `state_dict()`, by a state-dict
pre-hook; a user reading `p.data` directly calls `pm.wait_pending()`), which also completes the buckets no forward used
(parameters of modules that did not run). The values are the owners', copied bit for bit whichever way; a
process that exits with broadcasts in flight waits for them first (at exit, up to EXIT_WAIT_S), so no gloo
worker releases a collective's tensors while the interpreter finalizes (autopar.codegen.failures).

`overlap` False broadcasts synchronously after the step (`Zero1Partition.broadcast_`, the path before this
module) — the same toggle as the gradient overlap's (`pm.grad_reduce.overlap`). `waits`: which module waited
for each bucket since the last launch; `last_waits`: all the waits for the buckets the previous launch issued
(tests check that the forward did them).
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import autopar.codegen.failures  # noqa: F401  (imported first: its atexit quiesce runs after this module's drain)
from autopar.codegen import data_parallel
from autopar.codegen.data_parallel import Zero1Partition, local
from autopar.codegen.grad_overlap import pack_buckets

__all__ = ["ParamPrefetch", "Wait", "EXIT_WAIT_S"]

EXIT_WAIT_S = 30.0  # at exit, how long a rank waits for a bucket in flight before giving it up


@dataclass(frozen=True)
class Wait:
    """One bucket completed: by the forward pre-hook of module `where` (`in_forward`), else by `wait_pending`
    called for `where` ("optimizer step", "state_dict", ...)."""
    bucket: int
    where: str
    in_forward: bool


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    owner: int  # local rank in `mesh` of the parameters' owner, the broadcast's source
    mesh: DeviceMesh
    # in flight: (work, flat buffer, the tensors it unpacks into on a receiving rank, else None)
    work: tuple[dist.Work, torch.Tensor, list[torch.Tensor] | None] | None = None


_live: weakref.WeakSet[ParamPrefetch] = weakref.WeakSet()


class ParamPrefetch:
    """The owners' broadcasts of `zero1`'s parameters after each step, waited for in `parts`' forward."""

    def __init__(self, zero1: Zero1Partition, parts: Sequence[nn.Module], *, bucket_bytes: int | None = None) -> None:
        self.zero1 = zero1
        self.overlap = True
        self.waits: list[Wait] = []  # since the last launch
        self.last_waits: list[Wait] = []  # of the previous launch's buckets, all of them (set by `launch`)
        size = bucket_bytes if bucket_bytes is not None else data_parallel.BUCKET_BYTES
        order = {id(p): i for i, p in enumerate(zero1.params)}  # registration order over this rank's stages
        buckets: list[_Bucket] = []
        for params, mesh, owners in zero1.partitions:
            if mesh.size() == 1:
                continue
            for r in range(mesh.size()):  # each owner's parameters, in forward order, one broadcast a bucket
                mine = [p for p, owner in zip(params, owners, strict=True) if owner == r]
                buckets += [_Bucket(ps, r, mesh) for ps in pack_buckets(mine, lambda p: p.dtype, size)]
        # by the forward position of their first parameter: the owners interleaved, expert buckets (their own
        # mesh) among the dense ones where forward reaches them
        self._buckets = sorted(buckets, key=lambda b: order[id(b.params[0])])
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b.params}
        self._pending: set[int] = set()
        # holders whose forward never runs (nn.MultiheadAttention's out_proj, an nn.ParameterList: their
        # parameters read by a parent's code) would leave their buckets unwaited: the first step records which
        # pre-hooks fired, and the buckets of the others are waited for when a part's forward starts
        self._holders: dict[str, list[int]] = {}
        self._fired: set[str] | None = set()  # None once settled (at the first launch)
        self._early: list[int] = []
        self._hook(parts)
        _live.add(self)

    @property
    def buckets(self) -> int:
        return len(self._buckets)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def _hook(self, parts: Sequence[nn.Module]) -> None:
        """A pre-hook on each module holding parameters of some bucket (its own, or its subtree's when compiled);
        and on every module a state-dict pre-hook, so a user's `module.state_dict()` reads the step's weights."""
        for i, part in enumerate(parts):
            part.register_forward_pre_hook(self._early_hook(f"{i}:<start>" if len(parts) > 1 else "<start>"))
            compiled: list[str] = []
            for path, m in part.named_modules():
                m.register_state_dict_pre_hook(self._state_dict_hook)
                if any(path.startswith(c + ".") for c in compiled):
                    continue
                is_compiled = getattr(m, "_compiled_call_impl", None) is not None
                held = sorted({self._bucket_of[id(p)] for p in m.parameters(recurse=is_compiled)
                               if id(p) in self._bucket_of})
                if is_compiled:
                    compiled.append(path)
                if not held:
                    continue
                where = f"{i}:{path}" if len(parts) > 1 else path
                self._holders[where] = held
                if is_compiled:
                    m._compiled_call_impl = self._waiting(m._compiled_call_impl, held, where)
                else:
                    m.register_forward_pre_hook(self._pre_hook(held, where))

    def _state_dict_hook(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.wait_pending("state_dict")

    def _early_hook(self, where: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if self._pending and self._early:
                self._wait_for(self._early, where, in_forward=True)
        return hook

    def _pre_hook(self, held: list[int], where: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if self._fired is not None:
                self._fired.add(where)
            if self._pending:
                self._wait_for(held, where, in_forward=True)
        return hook

    def _waiting(self, call: Callable, held: list[int], where: str) -> Callable:
        def waiting(*args, **kwargs):
            if self._fired is not None:
                self._fired.add(where)
            if self._pending:
                self._wait_for(held, where, in_forward=True)
            return call(*args, **kwargs)
        return waiting

    def _settle(self) -> None:
        """After the first step: the buckets held by modules whose forward did not run, waited for up front."""
        if self._fired is not None:
            self._early = sorted({b for where, held in self._holders.items() if where not in self._fired
                                  for b in held})
            self._fired = None

    @torch.no_grad()
    def launch(self) -> None:
        """After the optimizer step: every bucket's broadcast issued asynchronously (synchronously, all at
        once, with `overlap` False); the previous step's, if any are left, completed first."""
        self.wait_pending("launch")
        self._settle()
        self.last_waits, self.waits = self.waits, []
        if not self.overlap:
            self.zero1.broadcast_()
            return
        for i, b in enumerate(self._buckets):
            group = b.mesh.get_group()
            tensors = [local(p) for p in b.params]
            if b.owner == b.mesh.get_local_rank():
                flat, into = torch.cat([t.reshape(-1) for t in tensors]), None
            else:
                flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
                into = tensors
            src = dist.get_process_group_ranks(group)[b.owner]
            b.work = (dist.broadcast(flat, src=src, group=group, async_op=True), flat, into)
            self._pending.add(i)

    def wait_pending(self, where: str) -> None:
        """Every bucket still in flight completed and unpacked (before anything reads parameters outside the
        forward: `where` names it in `waits`)."""
        if self._pending:
            self._wait_for(sorted(self._pending), where, in_forward=False)

    @torch.no_grad()
    def _wait_for(self, buckets: Sequence[int], where: str, *, in_forward: bool,
                  timeout: timedelta | None = None) -> None:
        for i in buckets:
            if i not in self._pending:
                continue
            b = self._buckets[i]
            (work, flat, into), b.work = b.work, None
            self._pending.discard(i)
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
            if into is not None:
                offset = 0
                for t in into:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
            self.waits.append(Wait(i, where, in_forward))

    def drain_at_exit(self) -> None:
        """Buckets still in flight waited for, each up to EXIT_WAIT_S; a failed or absent peer ends the wait."""
        try:
            self._wait_for(sorted(self._pending), "exit", in_forward=False, timeout=timedelta(seconds=EXIT_WAIT_S))
        except Exception:  # a peer died or the group is gone: nothing left to complete
            self._pending.clear()


@atexit.register
def _drain_all() -> None:
    for prefetch in list(_live):
        if prefetch.pending and dist.is_initialized():
            prefetch.drain_at_exit()
