"""Make meta execution take the kernels a GPU training step takes.

On meta (and CPU) tensors PyTorch picks fallbacks that a GPU run does not: scaled-dot-product
attention decomposes into the math path (fp32 upcast, the s×s score and probability tensors saved
for backward) and dropout saves a mask in the input dtype. Training on GPUs runs

- `F.scaled_dot_product_attention` as the fused flash kernel (Dao et al. 2022): it saves q, k, v,
  the output, a fp32 log-sum-exp [b, heads, s] and the RNG seed/offset, no s×s tensor; with an
  explicit mask, the memory-efficient kernel (Rabe & Staats 2021, xFormers), which also saves the
  mask as an additive bias;
- `F.dropout` as `aten.native_dropout` (ATen `dropout` takes that fused path for CUDA inputs), which
  saves a 1-byte boolean mask, the figure Korthikanti et al. (2022) use.

Under `gpu_kernels()` those two functions are routed to exactly these ATen ops, whose meta kernels,
autograd formulas and FlopCounterMode entries then give the GPU's saved tensors and FLOPs
(flash counts 4·b·heads·s_q·s_k·head_dim forward, causal masking not halved).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["gpu_kernels", "SDPA_OPS", "OP_SAC_MATMUL_OPS", "SELECTIVE_RECOMPUTED_OPS", "op_sac_saves",
           "AttentionCore", "inside_fused_kernel", "fused_dropout",
           "written_tensors"]

aten = torch.ops.aten

# Fused attention kernels (overload packets), forward only: their outputs after the first
# (log-sum-exp, RNG state) exist only for the backward.
SDPA_OPS = frozenset(
    getattr(aten, name) for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
    ) if hasattr(aten, name)
)

# Op-level selective activation checkpointing ("op_sac", as torchtitan's activation_checkpoint.py runs it):
# inside a recomputed block the outputs of fused attention, of reduce-scatters (sequence parallelism) and
# of every odd-numbered matmul against a weight are saved; every second such matmul and every other op
# (pointwise, norms, eager attention's batched matmuls) runs again in backward. torchtitan lists aten.mm
# only, as its bias-free models produce; a linear with a bias dispatches addmm, counted alike here.
OP_SAC_MATMUL_OPS = frozenset({aten.mm, aten.addmm})
_OP_SAC_ALWAYS_SAVED = SDPA_OPS | frozenset(
    op for op in (getattr(getattr(torch.ops, "_c10d_functional", None), "reduce_scatter_tensor", None),)
    if op is not None)


# Selective recompute ("selective", Korthikanti et al. 2022 §4.2) runs the attention core again in backward:
# fused SDPA kernels whole, and on the eager path everything from the score matmul to the probability-weighted
# sum (`AttentionCore`); softmax and dropout anywhere else run again too. Every other op's output is cached
# (torch's selective-checkpoint MUST_SAVE), whether or not backward reads it, views included (a cached view
# keeps its base's storage alive).
SELECTIVE_RECOMPUTED_OPS = SDPA_OPS | frozenset({aten.bmm, aten.baddbmm, aten._softmax, aten.native_dropout})
# the batched matmuls that start the eager core (q·kᵀ, with an additive bias: baddbmm) and end it (probs·v);
# projections dispatch mm/addmm on 2-D views, so a batched matmul inside a block is attention's (or an
# expert's, which recomputing keeps correct)
_CORE_MATMULS = frozenset({aten.bmm, aten.baddbmm})
# fresh buffers (free to make again): an MoE block's output accumulated in place, CPU dropout's mask
_FRESH = frozenset(getattr(aten, name) for name in (
    "zeros", "zeros_like", "empty", "empty_like", "empty_strided", "full", "full_like", "ones", "ones_like",
    "new_zeros", "new_empty", "new_full", "new_ones") if hasattr(aten, name))


def _mutates(func: Any) -> bool:
    """Whether op overload `func` writes into an argument (index_add_, copy_, an out= variant, a c10d
    collective: torch.distributed's ops fill their tensors in place without saying so in their schemas)."""
    schema = getattr(func, "_schema", None)
    return bool(schema is not None and (schema.is_mutable or getattr(func, "namespace", None) == "c10d"))


def _draws(func: Any) -> bool:
    """Whether op overload `func` draws from the RNG (rand_like, bernoulli, randn): run again in backward, as
    the recomputed dropout is, so both replay the forward's draws in order (checkpoint restores the RNG)."""
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors op overload `func` writes into (its schema's write-annotated arguments; every tensor a
    c10d collective is handed, whose schema annotates none)."""
    if not _mutates(func):
        return []
    if func.namespace == "c10d":
        return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            out += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


class AttentionCore:
    """Which ops of one block's forward selective recompute runs again, by following the attention core.

    A batched matmul reading no core tensor (q·kᵀ) starts the core; every op reading a core tensor (the
    scale, the mask and what builds it from the scores, softmax, dropout, the views between them) is in it;
    a batched matmul reading one core tensor beside another tensor (probs·v) ends it: its output is outside.
    Fused attention (`fused`: SDPA and the like) is the core whole, its output outside. Keying by op type
    alone cached the scaled, masked and viewed s²-sized scores (an eager GPT block kept more than without
    recompute); following the data keeps exactly what Megatron-LM's selective recompute keeps.

    Fresh buffers and ops that write into an argument run again too: torch's selective-checkpoint cache
    refuses an entry mutated after it was cached, and a buffer accumulated in place (an MoE block's output,
    index_add_ per expert) would be. An op writing into the output of an op kept earlier (a router's top-k
    weights divided in place) un-keeps it: that op runs again in backward, giving the value before the write
    (`written_tensors`; the runtime's policy and capture's probe both drop what they kept of its storage).

    One instance follows one forward: `observe` decides from the inputs (whether the op runs again in
    backward) and marks the outputs."""

    def __init__(self, fused: frozenset = SDPA_OPS) -> None:
        self._fused = fused
        self._core = WeakTensorKeyDictionary()

    def _classify(self, func: Any, args: tuple, kwargs: dict) -> tuple[bool, bool]:
        """(recomputed, outputs in the core)."""
        packet = getattr(func, "overloadpacket", func)
        core_args = sum(1 for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a in self._core)
        if packet in self._fused:
            return True, False
        if packet in _CORE_MATMULS:
            return True, core_args != 1
        if core_args:
            return True, True
        return (packet in SELECTIVE_RECOMPUTED_OPS or packet in _FRESH or _mutates(func) or _draws(func)), False

    def observe(self, func: Any, args: tuple, kwargs: dict, outs: Any) -> bool:
        """Mark `outs` (op overload `func`'s outputs) core or cached; returns whether the op runs again."""
        recomputed, core = self._classify(func, args, kwargs)
        if core:
            for t in tree_leaves(outs):
                if isinstance(t, torch.Tensor):
                    self._core[t] = True
        return recomputed


# > 0 while `_sdpa` repeats K/V heads for grouped-query attention: the fused kernels (flash, cuDNN) index the
# shared heads themselves, so a checkpoint policy never sees those copies (they are the attention core's)
_KERNEL_INTERNAL = [0]


def inside_fused_kernel() -> bool:
    """Whether the ops now dispatched model the inside of a fused attention kernel (no policy sees them)."""
    return _KERNEL_INTERNAL[0] > 0


def op_sac_saves(packet: Any, matmul_index: int) -> bool:
    """Whether op_sac keeps the output of an op (overload packet); `matmul_index` counts the block's
    OP_SAC_MATMUL_OPS from 1 up to and including this op (in forward, and again from 1 in recompute)."""
    if packet in OP_SAC_MATMUL_OPS:
        return matmul_index % 2 == 1
    return packet in _OP_SAC_ALWAYS_SAVED


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> torch.Tensor:
    if query.dim() != 4:  # the fused kernels take [b, heads, s, d]; leave anything else to PyTorch
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if kv_heads != heads:  # grouped-query attention: the kernel sees each KV head repeated
        _KERNEL_INTERNAL[0] += 1
        try:
            key = key.repeat_interleave(heads // kv_heads, dim=-3)
            value = value.repeat_interleave(heads // kv_heads, dim=-3)
        finally:
            _KERNEL_INTERNAL[0] -= 1
    if attn_mask is None and value.shape[-1] == query.shape[-1]:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    if attn_mask is None:  # a value head narrower than the query's (MLA: 192 / 128): flash's kernel assumes
        # one head size and its meta kernel shapes the output by the query's; the memory-efficient kernel
        # takes both, as SDPA dispatches it on a GPU
        return aten._scaled_dot_product_efficient_attention(query, key, value, None, True, dropout_p, is_causal,
                                                            scale=scale)[0]
    bias = attn_mask
    if bias.dtype == torch.bool:  # a boolean mask becomes an additive bias of the query dtype, as SDPA does
        bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device)
    bias = bias.expand(query.shape[0], heads, query.shape[-2], key.shape[-2])
    return aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, dropout_p, is_causal,
                                                        scale=scale)[0]


def fused_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """`F.dropout` as the one op CUDA runs it (`aten.native_dropout`), on any device."""
    if training and 0.0 < p < 1.0 and input.numel() > 0:
        out = aten.native_dropout(input, p, True)[0]
        return input.copy_(out) if inplace else out
    return F.dropout(input, p, training, inplace)


class gpu_kernels(TorchFunctionMode):  # noqa: N801  (used as a context manager, like torch's own modes)
    """Route attention and dropout to the fused kernels GPU training runs (see the module docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _sdpa(*args, **kwargs)
        if func is F.dropout:
            return fused_dropout(*args, **kwargs)
        return func(*args, **kwargs)
