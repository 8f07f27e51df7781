"""Per-head tensors computed from parameters, found while capture measures a call, so that the planner
prices the all-gather of their gradients under tensor parallelism.

Codegen (autopar.codegen.head_bias) keeps such tensors whole on every rank and cuts them to the rank's
heads, by the same two rules mirrored here:
1. the output of a linear or embedding inside an attention module, other than its projections, with one
   output per head (T5's bucketed relative bias, the last linear of Swin v2's position-bias MLP);
2. a tensor of all heads (third axis from last) meeting the attention's scores in an element-wise op or
   the fused attention kernel (Swin's window-bias table, Swin v2's logit scale), unless it derives from a
   rule-1 output (already cut).
Each cut whose tensor derives from a parameter is one all-gather of that tensor's gradient in backward,
once per micro-batch. Most are built from parameters and constants only, whatever the micro-batch
(fixed bytes); one met after a mask of the scores' batch axis was added (Swin's shifted windows: the
table plus the shift mask, one per window and sample) scales with the micro-batch (batched bytes).
Tensors from constants alone (T5's zero bias of cross-attention, a buffer) have no gradient and cost
nothing. Where a rank holds one head, codegen takes a mask's single-head axis for the rank's heads and
cuts the table before the mask is added: the batched price is then an upper bound.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from autopar.capture.tensors import storage_key

__all__ = ["BIAS_OPS", "HeadTables"]

# the ATen packets of codegen.head_bias's element-wise ops (the fused kernel is matched as SDPA_OPS)
BIAS_OPS = frozenset({"add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "where", "masked_fill",
                      "masked_fill_"})
_PARAM = ""  # the lineage mark of a tensor derived from a parameter that trains


def _is_param(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) and base.requires_grad or isinstance(t, nn.Parameter) and t.requires_grad


class HeadTables:
    """Follows tensors not computed from the call (what they derive from: a parameter that trains, the
    linears over constants on the way) and records where per-head ones meet attention scores."""

    def __init__(self) -> None:
        self.lineage: dict[int, frozenset[str]] = {}  # storage → {_PARAM?, linears over constants it went through}
        self.tables: dict[str, tuple[int, int, frozenset[str]]] = {}  # linear → (output bytes, width, lineage)
        # (scores' sources, bytes, lineage, whether it has the scores' batch axis)
        self.meets: list[tuple[frozenset[str], int, frozenset[str], bool]] = []

    def _of(self, t: torch.Tensor) -> frozenset[str]:
        if storage_key(t) in self.lineage:
            return self.lineage[storage_key(t)]
        return frozenset({_PARAM}) if _is_param(t) else frozenset()

    def on_op(self, name: str, fused: bool, ins: list[torch.Tensor], outs: list[torch.Tensor],
              in_tags: list[tuple[frozenset[str] | None, bool]], from_call: list[bool]) -> None:
        """One ATen op (`name`: its packet; `fused`: the fused attention kernel) of a call."""
        if not any(from_call):
            lineage = frozenset().union(*(self._of(t) for t in ins))
            if lineage:
                for t in outs:
                    self.lineage[storage_key(t)] = lineage
            return
        if fused:
            scores = ins[:1]  # the queries: (batch, heads, tokens, head dim)
        elif name in BIAS_OPS:
            scores = [t for t, (_, core) in zip(ins, in_tags, strict=True) if core and t.dim() >= 3]
        else:
            return
        # by identity: list.index compares tensors with ==, which is elementwise (MiniMax's lightning attention)
        if not scores or not (sources := in_tags[next(i for i, t in enumerate(ins) if t is scores[0])][0]):
            return
        ref = scores[0]
        for t, call in zip(ins, from_call, strict=True):
            if not call and t.dim() >= 3 and t.shape[-3] == ref.shape[-3] and _PARAM in (lineage := self._of(t)):
                # a broadcast (stride-0) axis holds one copy: the fused kernel sees its mask expanded
                held = [n for n, stride in zip(t.shape, t.stride(), strict=True) if stride]
                batched = t.dim() == ref.dim() and t.shape[0] == ref.shape[0] > 1 and t.stride(0) != 0
                self.meets.append((sources, math.prod(held) * t.element_size(), lineage, batched))

    def on_table(self, name: str, out: Any) -> None:
        """A linear or embedding whose input is not from the call gave `out`."""
        if isinstance(out, torch.Tensor) and out.dim():
            lineage = self._of(out) | {name}
            self.lineage[storage_key(out)] = lineage
            self.tables[name] = (out.numel() * out.element_size(), out.shape[-1], lineage)

    def gathered_bytes(self, owner: str, columns: frozenset[str], heads: int) -> tuple[int, int]:
        """(fixed, batched) bytes all-gathered in backward for the attention whose module is `owner` (relative
        name, "" for the call's module) and whose projections are `columns`; batched: for the call's batch."""
        prefix = f"{owner}." if owner else ""
        cut = {name for name, (_, width, lineage) in self.tables.items()
               if name.startswith(prefix) and name not in columns and width == heads and _PARAM in lineage}
        met = [(n, batched) for sources, n, lineage, batched in self.meets if sources <= columns and not lineage & cut]
        return (sum(self.tables[name][0] for name in cut) + sum(n for n, batched in met if not batched),
                sum(n for n, batched in met if batched))
