"""Activation recompute on the planned layers (Chen et al. 2016; Korthikanti et al. 2022, §4).

- "full": the layer keeps only its inputs and reruns its forward during backward.
- "selective": only the attention core (scores, softmax, attention-weighted sum — the s²-sized
  tensors) is recomputed; every other op's output is saved, as in Korthikanti et al. §4.2.
The layer's forward is wrapped in place, so module paths and parameter names do not change
(composes with tensor parallelism and `fully_shard`, which hook around the wrapped forward).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["ATTENTION_CORE_OPS", "apply_recompute"]

_aten = torch.ops.aten
# The attention core: fused SDPA kernels, and the eager path's batched matmuls and softmax
# (projections are mm/addmm on 2-D views, so bmm only appears in q·kᵀ and probs·v).
ATTENTION_CORE_OPS = frozenset(
    op for op in (
        getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
        getattr(_aten, "_scaled_dot_product_flash_attention", None),
        getattr(_aten, "_scaled_dot_product_efficient_attention", None),
        getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
        _aten.bmm.default,
        _aten._softmax.default,
        _aten.native_dropout.default,
    ) if op is not None
)


def _attention_core_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    packet = getattr(op, "overloadpacket", op)
    core = op in ATTENTION_CORE_OPS or any(packet is getattr(c, "overloadpacket", c) for c in ATTENTION_CORE_OPS)
    return CheckpointPolicy.PREFER_RECOMPUTE if core else CheckpointPolicy.MUST_SAVE


def _selective_context():
    return create_selective_checkpoint_contexts(_attention_core_policy)


def apply_recompute(module: nn.Module, mode: str) -> None:
    """Wrap `module.forward` so its activations are recomputed in backward per `mode`."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute mode {mode!r}; expected 'none', 'selective' or 'full'")
    inner = module.forward
    kwargs = {"context_fn": _selective_context} if mode == "selective" else {}

    @functools.wraps(inner)
    def forward(*args, **kw):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs, **kw)

    module.forward = forward
