"""The training precision policy at run time (`ParallelConfig.precision`, cost_models.precision).

- Every parameter becomes fp32 on entry (`to_masters`), whatever dtype the model came in: the
  parameters the optimizer steps are the master weights, their gradients are fp32 and reduced in fp32.
- 16-bit compute under every layout: each stage's forward (and the dry run that finds what crosses each
  pipeline cut) runs under `torch.autocast(compute dtype)` (`apply_autocast`), which composes with
  DTensor, pipelining (a stage sends what its autocast forward produced), activation checkpointing
  (torch.utils.checkpoint replays the forward under the autocast state it ran in) and compiled blocks.
  Under ZeRO-2/3, FSDP2 additionally gathers the parameters in the compute dtype
  (`fsdp_mixed_precision`: `MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)`), so its
  all-gathers move 16-bit bytes and reduce-scatters fp32.
- fp16 adds dynamic loss scaling (`LossScaler`, the algorithm of torch.amp.GradScaler with its
  defaults): the loss is multiplied by the scale before backward; after the gradient reduction the
  gradients are unscaled, and one all-reduce over every rank (the global gradient norm's, see
  `autopar.codegen.clipping`) says whether any shard overflowed, so every rank skips the same steps.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from autopar.codegen.device import autocast_device_type
from cost_models.precision import Precision, policy

__all__ = ["torch_dtype", "to_masters", "compute_context", "apply_autocast", "weight_cast_cache",
           "fsdp_mixed_precision", "LossScaler", "policy"]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a policy's dtype name ("bfloat16" → torch.bfloat16)."""
    return getattr(torch, name)


@torch.no_grad()
def to_masters(model: nn.Module, pol: Precision) -> None:
    """Every real floating-point parameter and buffer in the policy's parameter dtype (fp32 masters).

    Not `model.to(dtype)`: that also casts complex tensors to the real dtype, dropping their imaginary part
    (rotary tables kept as complex64, as Meta's Llama keeps `freqs_cis`)."""
    dtype = torch_dtype(pol.param_dtype)
    for p in model.parameters():  # in place: a weight two modules share (tied) stays one parameter
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    for module in model.modules():
        for key, b in module._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                module._buffers[key] = b.to(dtype)


def compute_context(device: torch.device, pol: Precision) -> AbstractContextManager:
    """Autocast to the policy's compute dtype (nothing when it computes on the masters)."""
    if not pol.mixed:
        return nullcontext()
    return torch.autocast(autocast_device_type(device), dtype=torch_dtype(pol.compute_dtype))


def apply_autocast(module: nn.Module, device: torch.device, pol: Precision) -> None:
    """Run `module`'s forward (whatever it is: the model's own, or a pipeline stage's) under
    `compute_context`; backward needs none (autograd replays each op in the dtype its forward used)."""
    if not pol.mixed:
        return
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with compute_context(device, pol):
            return inner(*args, **kwargs)

    module.forward = forward


def weight_cast_cache(device: torch.device, pol: Precision) -> AbstractContextManager:
    """Around a step's forward and backward passes: one 16-bit cast of each weight for the whole step.

    Autocast caches the casts of leaf weights until the outermost autocast region ends; each stage's
    forward is its own region (`apply_autocast`), so without an outer one every micro-batch would cast the
    weights again and its matmuls would save their own copy for backward (a copy per micro-batch in flight).
    This outer region is disabled (backward runs outside autocast, as torch recommends) and only keeps the
    cache alive, so every micro-batch, and recomputation in backward, shares one copy per weight."""
    if not pol.mixed:
        return nullcontext()
    return torch.autocast(autocast_device_type(device), dtype=torch_dtype(pol.compute_dtype), enabled=False)


def fsdp_mixed_precision(pol: Precision) -> MixedPrecisionPolicy:
    """FSDP2's policy: parameters gathered in the compute dtype, gradients reduced in the reduce dtype."""
    if not pol.mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch_dtype(pol.compute_dtype), reduce_dtype=torch_dtype(pol.reduce_dtype))


class LossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018, §3.2), with torch.amp.GradScaler's defaults:
    start at 2^16, halve on a step whose gradients overflow (the step is skipped), double after 2000
    steps in a row without overflow. The decision is global: `update` takes the overflow flag every
    rank agreed on."""

    INIT_SCALE = 2.0 ** 16
    GROWTH_FACTOR = 2.0
    BACKOFF_FACTOR = 0.5
    GROWTH_INTERVAL = 2000

    def __init__(self) -> None:
        self.scale = self.INIT_SCALE
        self.good_steps = 0
        self.skipped_steps = 0

    @torch.no_grad()
    def unscale_(self, grads: Iterable[torch.Tensor]) -> None:
        """Divide the (local shards of the) gradients by the scale, in place."""
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.BACKOFF_FACTOR
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.GROWTH_INTERVAL:
            self.scale *= self.GROWTH_FACTOR
            self.good_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
