"""ZeRO-1 under a 16-bit policy as Megatron-LM's distributed optimizer runs it (`DistributedOptimizer`).

Megatron-LM (docs/source/api-guide/dist_optimizer.md) keeps 2 + 4 + 12/dp bytes per parameter, where a
ZeRO-1 over fp32 masters keeps 4 + 2 + 4 + 8/dp:

- the model's parameters are held in the compute dtype (16 bits): autocast casts nothing for the
  matmuls, and no per-step 16-bit copy of the weights exists;
- each parameter has an fp32 main gradient (`p.main_grad`, Megatron's name) that a post-accumulate-grad
  hook adds every micro-batch's 16-bit gradient into, freeing it; this buffer is what the data-parallel
  reduction, the global norm, clipping and fp16's unscaling see (`autopar.codegen.data_parallel.grad_of`);
- fp32 masters, and so the optimizer's moments, exist only for the parameters this rank owns
  (`Zero1Partition`): the user's optimizer is built over those masters, under the parameters' names, so its
  parameter groups, hyper-parameters and LR schedules stay the user's;
- after the step the owner rounds its masters into its 16-bit parameters and `Zero1Partition.broadcast_`
  sends them to the other ranks (16-bit bytes).

The hook composes with tensor parallelism (a DTensor gradient is laid out as its parameter before the add),
pipelining (its stages' backward is autograd's, which accumulates and so fires the hook) and activation
checkpointing (recomputation produces no gradient of its own). Checkpoints keep the fp32 masters, never the
16-bit rounding (`autopar.codegen.state`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.codegen.data_parallel import Zero1Partition, as_param_layout, local
from autopar.codegen.master_optimizer import MasterOptimizer
from cost_models.precision import Precision

__all__ = ["DistributedOptimizer"]


def _accumulate(p: torch.Tensor) -> None:
    """Post-accumulate-grad hook: the 16-bit gradient into the fp32 main gradient, then freed."""
    with torch.no_grad():
        local(p.main_grad).add_(local(as_param_layout(p.grad, p)))
    p.grad = None


@torch.no_grad()
def _to_dtype(p: nn.Parameter, dtype: torch.dtype) -> None:
    """`p` in `dtype`, the same Python object (modules, ties and pipeline stages keep referring to it). On a
    DTensor `p.data = ...` changes the wrapper's dtype only, so its local shard and spec are re-pointed too
    (`torch.utils.swap_tensors` would do it whole, but refuses a tensor that any weak reference names, as the
    memo of pipelining's shape inference does)."""
    new = p.detach().to(dtype)
    p.data = new
    if isinstance(p, DTensor):
        p._local_tensor, p._spec = new._local_tensor, new._spec
        if p.to_local().dtype != dtype or p._spec.tensor_meta.dtype != dtype:
            raise RuntimeError(f"could not hold a DTensor parameter in {dtype} (its local shard is "
                               f"{p.to_local().dtype}): this torch's DTensor layout is not the one expected")


class DistributedOptimizer(MasterOptimizer):
    """The user's optimizer stepping fp32 masters of the parameters this rank owns; the parameters in 16 bits
    with fp32 main gradients (module docstring). Built after every sharding (DTensor parameters stay
    DTensors, their masters and main gradients too) and before the first forward.

    `named`: this rank's trainable parameters, each once, in fp32; `make_optimizer`: the user's factory,
    given `(name, master)` pairs."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], zero1: Zero1Partition, pol: Precision,
                 make_optimizer: Callable[[list], torch.optim.Optimizer]) -> None:
        self.zero1 = zero1
        self.all_params = [p for _, p in named]
        owned = [(n, p) for n, p in named if zero1.owns(p)]
        self.params = [p for _, p in owned]  # the parameters this rank steps, aligned with `masters`
        compute = getattr(torch, pol.compute_dtype)
        reduce = getattr(torch, pol.reduce_dtype)
        with torch.no_grad():
            self.masters = [p.detach().clone().to(torch.float32) for p in self.params]
            for p in self.all_params:
                _to_dtype(p, compute)
                p.main_grad = torch.zeros_like(p, dtype=reduce)
                p.register_post_accumulate_grad_hook(_accumulate)
        self.optimizer = make_optimizer([(n, m) for (n, _), m in zip(owned, self.masters, strict=True)])

    def master_of(self) -> dict[int, torch.Tensor]:
        """id of an owned parameter → its fp32 master."""
        return {id(p): m for p, m in zip(self.params, self.masters, strict=True)}

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Main gradients to zero (kept allocated: they are the step's accumulation buffers)."""
        for p in self.all_params:
            p.grad = None
            local(p.main_grad).zero_()
        for m in self.masters:
            m.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """The user's optimizer on the owned masters (their gradients: the reduced fp32 main gradients), then
        each master rounded into its 16-bit parameter; `Zero1Partition.broadcast_` sends them on."""
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = p.main_grad
        self.optimizer.step()
        for m in self.masters:
            m.grad = None
        self.weights_from_masters()

    @torch.no_grad()
    def weights_from_masters(self) -> None:
        """Each owned parameter ← its master, rounded to the compute dtype."""
        for p, m in zip(self.params, self.masters, strict=True):
            local(p).copy_(local(m))

    @torch.no_grad()
    def full_precision(self) -> dict[int, torch.Tensor]:
        """id of every trained parameter → its fp32 value on this rank (a DTensor where the parameter is one):
        the owner's master, broadcast to the other ranks (collective over the data-parallel groups)."""
        masters = self.master_of()
        values: dict[int, torch.Tensor] = {}
        for p in self.all_params:
            m = masters.get(id(p))
            if m is None:
                shard = torch.empty_like(local(p), dtype=torch.float32)
                m = (DTensor.from_local(shard, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                     if isinstance(p, DTensor) else shard)
            values[id(p)] = m
        self.zero1.broadcast_(lambda p: local(values[id(p)]))
        return values
