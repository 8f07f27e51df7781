"""offload="optimizer": fp32 master weights and optimizer moments in host memory, the step on the CPU.

ZeRO-Offload's split (Ren et al., USENIX ATC 2021, §4): forward and backward stay on the device; each
step copies this rank's gradient shards to the host (fp32), runs the user's optimizer there on fp32
master copies of the parameters, and copies the updated masters back into the device parameters (in
their own dtype). The device keeps only the parameters and their gradients; the 12 bytes per parameter
of fp32 masters and Adam moments live on the host. It composes with every ZeRO stage: it sees the local
shards this rank would step (ZeRO-1's owned parameters, FSDP's shards, DTensor local shards).

What a CPU-only run proves: the placement (states on the host device, parameters where they were) and the
step's mechanics (gradient copy, host step, copy back, checkpoints by parameter name) give the same numbers
as one process. What it cannot prove: host↔device transfer speed, their overlap with compute, or pinned
memory behaviour, which the planner prices from the catalog's host bandwidth (autopar.planner.offload_costs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from autopar.codegen.data_parallel import as_param_layout, local
from autopar.codegen.master_optimizer import MasterOptimizer

__all__ = ["HostOptimizer"]

HOST = torch.device("cpu")


def _named(params: Iterable[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in params if p.requires_grad]


class HostOptimizer(MasterOptimizer):
    """The user's optimizer stepping fp32 host copies of this rank's (local shards of) parameters; it is
    given the masters under their parameters' names, as `(name, master)` pairs."""

    def __init__(self, params: Sequence[tuple[str, nn.Parameter]],
                 make_optimizer: Callable[[list], torch.optim.Optimizer]) -> None:
        named = _named(params)
        self.params = [p for _, p in named]
        pin = torch.cuda.is_available()
        self.masters: list[torch.Tensor] = []
        for p in self.params:
            master = local(p).detach().to(HOST, torch.float32, copy=True)
            self.masters.append(master.pin_memory() if pin else master)
        self.optimizer = make_optimizer([(n, m) for (n, _), m in zip(named, self.masters, strict=True)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Gradients to the host (fp32), the step there, the updated masters back to the device parameters."""
        # gradients cross the link in their own dtype and become fp32 on the host; the masters are cast to the
        # weights' dtype on the host and cross back (autopar.planner.offload_costs prices these copies and casts)
        grads = [None if p.grad is None else local(as_param_layout(p.grad, p)).to(HOST, non_blocking=True)
                 for p in self.params]
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies have landed before the CPU reads them
        for m, g in zip(self.masters, grads, strict=True):
            m.grad = None if g is None else g.float()
        self.optimizer.step()
        for p, m in zip(self.params, self.masters, strict=True):
            local(p).copy_(m.to(local(p).dtype), non_blocking=True)

    @torch.no_grad()
    def reload_masters(self) -> None:
        """After the parameters were loaded from a checkpoint: the masters copy them again."""
        for p, m in zip(self.params, self.masters, strict=True):
            m.copy_(local(p))
