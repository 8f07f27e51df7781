"""Activation recompute on one block module, per the mode the plan gives that layer.

The modes (cost_models.memory.RECOMPUTE_MODES, the one vocabulary):
- "none": autograd keeps what each op saves.
- "selective": only the attention core (scores, their scale and mask, softmax, dropout, attention-weighted
  sum: the s²-sized tensors; fused attention whole) is recomputed; every other op's output is saved
  (Korthikanti et al. 2022, §4.2), read by backward or not (autopar.capture.kernels.AttentionCore follows
  the core through the data, and capture prices with the same rule: with fused attention this keeps more
  than none does).
- "op_sac": op-level selective checkpointing as torchtitan runs it: the outputs of fused attention,
  reduce-scatters and every odd-numbered matmul are saved, every second matmul and every other op
  (pointwise ops, norms) runs again in backward (autopar.capture.kernels.op_sac_saves, which capture
  prices with the same rule).
- "full": the block keeps only its inputs and reruns its forward in backward (Chen et al. 2016).
The block's forward is wrapped in place, so module paths and parameter names do not change (composes
with tensor parallelism, `torch.compile` of the block and `fully_shard`, which hook around the call).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import checkpoint as _ckpt
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import autopar.codegen.context_parallel  # noqa: F401  (registers autopar::cp_gather_kv, cp_chunk_attention)
from autopar.capture.kernels import (
    OP_SAC_MATMUL_OPS,
    SDPA_OPS,
    AttentionCore,
    fused_dropout,
    op_sac_saves,
    written_tensors,
)
from autopar.capture.tensors import storage_key
from autopar.errors import PlanMismatchError
from cost_models.memory import RECOMPUTE_MODES

__all__ = ["apply_recompute"]

# the fused attention kernels the core holds whole (their outputs outside it)
_FUSED_ATTENTION = SDPA_OPS | {torch.ops.autopar.cp_chunk_attention}
# context parallelism's K/V all-gather: kept by both selective policies (a collective is not rerun to save
# memory the attention's saved inputs hold anyway); full recompute runs it again
_CP_GATHER = torch.ops.autopar.cp_gather_kv
# its chunks' attention: a fused kernel's output, which op_sac keeps as it keeps SDPA's (capture.kernels.SDPA_OPS)
_CP_ATTENTION = torch.ops.autopar.cp_chunk_attention


def _selective_context():
    """Torch's selective-checkpoint modes under a policy that follows one forward's attention core: torch
    asks the policy after each op runs (`ctx.op_output`), so AttentionCore marks the outputs as it decides;
    the recompute replays the forward's decisions from its cache. An op writing into a tensor the cache kept
    (a router's weights divided in place) turns the entries holding that storage back to "run again", so the
    recompute produces the value before the write (torch refuses a kept entry changed afterwards). That edits
    torch's selective-checkpoint storage (`_sac_storage_key`, `func_counter`, `_RECOMPUTE`: torch 2.13's)."""
    core = AttentionCore(_FUSED_ATTENTION)
    kept: dict[int, list[tuple[Any, int]]] = {}  # storage → the cache entries (key, index) holding it

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        recomputed = core.observe(op, args, kwargs, ctx.op_output)
        for t in written_tensors(op, args, kwargs):
            for key, idx in kept.pop(storage_key(t), ()):
                forward.storage[key][idx] = _ckpt._RECOMPUTE
        if recomputed:
            return CheckpointPolicy.PREFER_RECOMPUTE
        key = _ckpt._sac_storage_key(op, args)
        entry = (key, forward.func_counter[key] - 1)  # the caching mode counted this call before asking
        for t in tree_leaves(ctx.op_output):
            if isinstance(t, torch.Tensor):
                kept.setdefault(storage_key(t), []).append(entry)
        return CheckpointPolicy.MUST_SAVE

    forward, recompute = create_selective_checkpoint_contexts(policy)
    return forward, recompute


def _op_sac_context():
    """A fresh policy per checkpointed call: matmuls are counted from 1 in forward and again from 1 when
    backward recomputes, so the same matmuls are saved both times."""
    counts = {False: 0, True: 0}  # by ctx.is_recompute

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", op)
        if packet is _CP_GATHER or packet is _CP_ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if packet in OP_SAC_MATMUL_OPS:
            counts[ctx.is_recompute] += 1
        saved = op_sac_saves(packet, counts[ctx.is_recompute])
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


_CONTEXTS = {"selective": _selective_context, "op_sac": _op_sac_context}


class _OneOpDropout(TorchFunctionMode):
    """`F.dropout` as `aten.native_dropout`, as CUDA runs it. On the CPU torch's dropout fills a fresh mask in
    place (empty_like, bernoulli_, div_), and torch's selective-checkpoint cache refuses a cached tensor that
    is mutated afterwards; one op has nothing to mutate, and is what selective recompute runs again."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            return fused_dropout(*args, **kwargs)
        return func(*args, **kwargs)


def apply_recompute(module: nn.Module, mode: str) -> None:
    """Wrap `module.forward` so its activations are recomputed in backward per `mode`."""
    if mode not in RECOMPUTE_MODES:
        raise PlanMismatchError(f"recompute mode {mode!r} is not one of {RECOMPUTE_MODES}; re-plan or fix the plan")
    if mode == "none":
        return
    inner = module.forward
    kwargs = {"context_fn": _CONTEXTS[mode]} if mode in _CONTEXTS else {}

    if mode == "selective":
        body = inner

        @functools.wraps(body)
        def inner(*args, **kw):
            first = next((t for t in tree_leaves((args, kw)) if isinstance(t, torch.Tensor)), None)
            if first is None or first.device.type != "cpu":  # CUDA's F.dropout is native_dropout already
                return body(*args, **kw)
            with _OneOpDropout():
                return body(*args, **kw)

    @functools.wraps(inner)
    def forward(*args, **kw):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs, **kw)

    module.forward = forward
