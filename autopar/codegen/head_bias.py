"""Per-head tensors that every rank computes whole, cut to the rank's heads where they meet its attention.

Under tensor parallelism an attention module holds `heads / tp` heads per rank, but some of what its
code adds to (or multiplies with) the scores is indexed by all heads and computed from parameters, not
from the column-parallel projections: T5's relative position bias (built in the first block and passed
to the next ones), Swin's window bias table, Swin v2's position-bias MLP and per-head logit scale. Those
stay replicated (they are small: one value per head and position pair) and are cut to the rank's heads:
- at the output of a linear or embedding inside the attention module with one output per head (T5's
  bucketed bias table, the last linear of Swin v2's bias MLP), so code after it that reshapes with the
  (rewritten, local) head count sees this rank's heads;
- inside the module's forward, wherever an element-wise op, a concatenation or a fused attention kernel meets
  a tensor of all heads next to one of the rank's per-head tensors (Swin's table, indexed by a parameter; a
  scale; GPT-OSS's attention sinks, a parameter of one logit per head joined to the scores).

The heads axis is the third from last, as in scores (batch, heads, queries, keys), a bias (1, heads,
queries, keys) and a scale (heads, 1, 1). The slice is DTensor's Replicate → Shard redistribution, whose
backward all-gathers the slices' gradients, so the replicated parameter behind the bias receives its
whole gradient, the same on every rank (the all-gather is priced with the pattern's communication).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["HEAD_AXIS", "cut_head_outputs", "slice_rank_blocks"]

HEAD_AXIS = -3
# element-wise ops between scores and a bias or mask, the fused attention kernel (its attn_mask), and the
# concatenations that join per-head logits to the scores (GPT-OSS's attention sinks: one learned logit per head
# appended to each row of scores before the softmax)
_OPS = frozenset({
    "cat", "concat", "concatenate",
    "add", "sub", "mul", "div", "where", "masked_fill", "add_", "sub_", "mul_", "div_", "masked_fill_",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__truediv__", "__itruediv__", "scaled_dot_product_attention",
})


class _RankBlocks(TorchFunctionMode):
    """While a forward runs: a replicated tensor with `whole` entries on `axis`, met by one with this rank's
    `whole // tp`, is cut to this rank's block (its heads; its share of the vocabulary); met by a DTensor of
    `whole` entries there (logits kept vocab-parallel for the model's own loss), it joins as a replicated DTensor,
    which DTensor cuts to the other's blocks itself."""

    def __init__(self, tp_mesh: DeviceMesh, axis: int, whole: int) -> None:
        super().__init__()
        self.mesh, self.axis, self.whole, self.local = tp_mesh, axis, whole, whole // tp_mesh.size()

    def _sized(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.dim() >= -self.axis

    def _cut(self, t: Any) -> Any:
        if self._sized(t) and t.size(self.axis) == self.whole:
            return _rank_block(t, self.mesh, t.dim() + self.axis)
        return t

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _OPS:
            sizes = {t.size(self.axis) for t in tree_leaves((args, kwargs)) if self._sized(t)}
            if self.whole in sizes and self.local in sizes:
                args, kwargs = tree_map(self._cut, (args, kwargs))
            elif self.whole in sizes and any(isinstance(t, DTensor) and t.dim() >= -self.axis
                                             and t.size(self.axis) == self.whole for t in tree_leaves((args, kwargs))):
                args, kwargs = tree_map(self._replicated, (args, kwargs))
        return func(*args, **kwargs)

    def _replicated(self, t: Any) -> Any:
        if self._sized(t) and t.size(self.axis) == self.whole:
            return DTensor.from_local(t, self.mesh, [Replicate()], run_check=False)
        return t


def _rank_block(t: torch.Tensor, tp_mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """This rank's block of `t` along `dim` (the heads' order of column-parallel projections); backward
    all-gathers the blocks' gradients."""
    whole = DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False)
    return whole.redistribute(tp_mesh, [Shard(dim)]).to_local()


def cut_head_outputs(owner: nn.Module, projections: set[nn.Module], tp_mesh: DeviceMesh, heads: int) -> None:
    """Linears and embeddings under an attention `owner`, other than its sharded `projections`, that give one
    value per head (`heads` outputs): their outputs are cut to this rank's heads."""

    def hook(module: nn.Module, args: tuple, out: Any) -> Any:
        if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) and out.dim() and out.size(-1) == heads:
            return _rank_block(out, tp_mesh, out.dim() - 1)
        return None

    if heads % tp_mesh.size() or tp_mesh.size() == 1:
        return
    for sub in owner.modules():
        if sub not in projections and (isinstance(sub, nn.Linear) and sub.out_features == heads
                                       or isinstance(sub, nn.Embedding) and sub.embedding_dim == heads):
            sub.register_forward_hook(hook)


def slice_rank_blocks(forward: Callable, tp_mesh: DeviceMesh, *, axis: int, whole: int) -> Callable:
    """`forward` with the whole-size tensors it combines with this rank's blocks cut to those blocks: an
    attention module's per-head biases (axis -3, all heads); a model's per-vocabulary bias added to
    vocab-parallel logits (axis -1, the vocabulary: BART's `final_logits_bias`)."""
    if whole % tp_mesh.size() or tp_mesh.size() == 1:
        return forward

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _RankBlocks(tp_mesh, axis, whole):
            return forward(*args, **kwargs)

    return run
