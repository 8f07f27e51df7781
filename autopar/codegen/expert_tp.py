"""Expert tensor parallelism (ParallelConfig.etp = tp): each expert's FFN split over the tensor-parallel ranks.

Megatron-Core's ETP = TP layout (Shoeybi et al. 2019 §3 applied to every expert): the weights that widen a
token to the FFN width F (gate and up) are split column-wise over the F dimension, the one that narrows it
back (down) row-wise, so tp rank r computes units [r·F/tp, (r+1)·F/tp) of every expert and its output is a
partial sum, summed over tp. The bank's own code still runs, on its tp rank's slice of each parameter.

Which dimension of each stacked parameter is F, and how a gate|up fusion lays its two halves out, is found
from the data flow (`ffn_splits`): the candidates are the dimensions of the captured FFN width F
(MoESpec.ffn_hidden_size) or 2·F, split as one block per rank or, for 2·F, as two halves each split apart
(the bank chunks [gate; up] in two: Mixtral, Qwen3-MoE, DeepSeek-V3) or as pairs ([g0, u0, g1, u1, ...],
GPT-OSS: a block per rank); a parameter without such a dimension is an output bias ([E, H]), which every tp
rank holds whole and adds 1/tp of. A candidate is kept only if the bank's outputs on its tp slices sum to
its whole output on the real weights; a bank none fits is refused by name.

Around the bank call (autograd-correct, Megatron's f and g operators):
- without sequence parallelism every tp rank holds the same tokens: the tokens and routing weights enter
  through `copy_to_tp` (identity; backward all-reduces their gradients, each rank's being its FFN slice's
  part) and the combined output leaves through `reduce_from_tp` (all-reduce; backward identity);
- under sequence parallelism each tp rank holds its own rows: tokens, routing weights and expert choices
  are all-gathered over tp (`gather_rows`, backward reduce-scatter) and the output reduce-scattered back to
  the rank's rows (`scatter_rows`, backward all-gather). gloo has no reduce-scatter: an all-reduce and the
  rank's rows there.
An output bias enters as `once_over_tp`: b / tp forward (the tp sums add it once), its gradient unscaled
(each rank's is already the whole one). The sliced weights' gradients are each rank's slice's whole gradient
(every tp rank runs every token), so the experts' gradients reduce over the edp ranks only.

Parameters are DTensors over ("ep_dp", "tp"): Shard(0) over the EP ranks, over tp Shard(F dim), a strided
shard of the two halves (`_StridedShard`, split factor 2: full tensors and checkpoints see [gate; up]), or
Replicate for an output bias.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from autopar.capture.moe_spec import MoESpec
from autopar.errors import PlanMismatchError

__all__ = ["FFNSplit", "ffn_splits", "tp_slice", "tp_placement", "copy_to_tp", "reduce_from_tp", "gather_rows",
           "scatter_rows", "once_over_tp"]


@dataclass(frozen=True)
class FFNSplit:
    """How one stacked expert parameter splits over tp: `dim` its FFN dimension (None: an output bias every tp
    rank holds whole and adds 1/tp of), `halves` whether that dimension holds two F-wide halves the bank
    chunks apart (each split over tp on its own)."""

    dim: int | None
    halves: bool = False


def tp_slice(t: torch.Tensor, split: FFNSplit, rank: int, tp: int) -> torch.Tensor:
    """Tp rank `rank`'s slice of `t` (a copy): its block of the FFN dimension, or of each half."""
    if split.dim is None:
        return t.detach().clone()
    parts = t.detach().chunk(2, dim=split.dim) if split.halves else (t.detach(),)
    return torch.cat([p.chunk(tp, dim=split.dim)[rank] for p in parts], dim=split.dim).contiguous()


def tp_placement(split: FFNSplit) -> Placement:
    """The DTensor placement over tp of a parameter split so (module docstring)."""
    if split.dim is None:
        return Replicate()
    return _StridedShard(split.dim, split_factor=2) if split.halves else Shard(split.dim)


def _options(p: torch.Tensor, ffn: int, tp: int) -> list[FFNSplit]:
    """The splits of a stacked parameter [E, ...] consistent with FFN width `ffn` over tp ranks, likeliest
    first; a vector per expert ([E, n]) may also be an output bias, held whole."""
    out: list[FFNSplit] = []
    for d in range(1, p.dim()):
        if p.shape[d] == 2 * ffn and ffn % tp == 0:
            out += [FFNSplit(d, halves=True), FFNSplit(d)]
        elif p.shape[d] == ffn and ffn % tp == 0:
            out.append(FFNSplit(d))
    return out + ([FFNSplit(None)] if p.dim() == 2 else [])  # [E, n]: perhaps an output bias (n may be 2·F)


@torch.no_grad()
def ffn_splits(bank: nn.Module, spec: MoESpec, names: Sequence[str], tp: int, hidden: int) -> dict[str, FFNSplit]:
    """Each stacked parameter's split over tp (module docstring), checked on random weights of the bank's
    shapes (real ones may be degenerate: biases initialised to zero fit any split): the bank's outputs on the
    tp slices sum to its whole output. Refuses, naming the bank, what no split fits."""
    name, ffn = spec.experts, spec.ffn_hidden_size
    options = {n: _options(getattr(bank, n), ffn, tp) for n in names}
    if ffn <= 0 or ffn % tp or any(not o for o in options.values()):
        raise PlanMismatchError(
            f"expert bank {name!r} ({type(bank).__name__}): its FFN width {ffn} cannot be split over tp={tp} "
            f"(parameters {', '.join(f'{n} {tuple(getattr(bank, n).shape)}' for n in names)}); re-plan with etp=1")
    p = getattr(bank, names[0])
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens, k = 4, spec.top_k
    x = torch.randn(tokens, hidden, generator=gen).to(p.device, p.dtype)
    index = torch.stack([torch.randperm(spec.num_experts, generator=gen)[:k] for _ in range(tokens)]).to(p.device)
    w = torch.rand(tokens, k, generator=gen).to(p.device, p.dtype)
    held = {n: bank._parameters[n] for n in names}
    probe = {n: torch.randn(held[n].shape, generator=gen).to(p.device, p.dtype) for n in names}
    tried = 0
    try:
        bank._parameters.update({n: nn.Parameter(t) for n, t in probe.items()})
        whole = bank(x, index, w)
        tol = max(1e-4, 16 * torch.finfo(p.dtype).eps) * float(whole.abs().max())
        for choice in itertools.product(*(options[n] for n in names)):
            tried += 1
            splits = dict(zip(names, choice, strict=True))
            total = torch.zeros_like(whole)
            try:
                for r in range(tp):
                    for n, s in splits.items():
                        part = tp_slice(probe[n], s, r, tp)
                        bank._parameters[n] = nn.Parameter(part / tp if s.dim is None else part)
                    total += bank(x, index, w)
            except (RuntimeError, ValueError, IndexError):  # shapes that do not chain: not this split
                continue
            finally:
                bank._parameters.update(held)
            if float((total - whole).abs().max()) <= tol:
                return splits
    finally:
        bank._parameters.update(held)
    raise PlanMismatchError(
        f"expert bank {name!r} ({type(bank).__name__}): none of {tried} ways of splitting its FFN width {ffn} over "
        f"tp={tp} gives outputs that sum to its own (parameters "
        f"{', '.join(f'{n} {tuple(held[n].shape)}' for n in names)}); re-plan with etp=1 for this model")


class _CopyToTP(torch.autograd.Function):
    """Identity; backward sums the gradient over tp (each rank's is its FFN slice's part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Sum of the tp ranks' partial outputs; backward identity (every rank's gradient of it is the whole)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _row_counts(rows: int, group: dist.ProcessGroup) -> list[int]:
    """Every tp rank's row count (sequence shards may differ by one)."""
    mine = torch.tensor([rows], dtype=torch.long)
    counts = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, mine, group=group)
    return [int(c) for c in counts]


def _gather(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's rows concatenated in rank order (padded to one size: gloo gathers equal tensors)."""
    padded = x.new_zeros((max(counts), *x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])


def _reduce_scatter(x: torch.Tensor, counts: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's rows of the sum over the group of `x` (every rank's rows, in rank order)."""
    if dist.get_backend(group) != "gloo" and len(set(counts)) == 1:
        out = x.new_empty((counts[rank], *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out
    total = x.contiguous().clone()  # gloo has no reduce-scatter
    dist.all_reduce(total, group=group)
    lo = sum(counts[:rank])
    return total[lo:lo + counts[rank]].clone()


class _GatherRows(torch.autograd.Function):
    """All tp ranks' rows; backward: this rank's rows of the summed gradient (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        return _gather(x, counts, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.counts, ctx.rank, ctx.group), None, None, None


class _ScatterRows(torch.autograd.Function):
    """This rank's rows of the sum of the tp ranks' partial outputs; backward all-gathers the rows' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.counts, ctx.group = counts, group
        return _reduce_scatter(x, counts, rank, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad.contiguous(), ctx.counts, ctx.group), None, None, None


class _OnceOverTP(torch.autograd.Function):
    """b / tp (the tp ranks' partial outputs then add b once); backward unscaled (each rank's is whole)."""

    @staticmethod
    def forward(ctx, b: torch.Tensor, tp: int) -> torch.Tensor:
        return b / tp

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_rows(x: torch.Tensor, rank: int, group: dist.ProcessGroup) -> tuple[torch.Tensor, list[int]]:
    """(all tp ranks' rows of `x`, each rank's count); differentiable for floating tensors."""
    counts = _row_counts(x.shape[0], group)
    if not x.is_floating_point():
        return _gather(x, counts, group), counts
    return _GatherRows.apply(x, counts, rank, group), counts


def scatter_rows(x: torch.Tensor, counts: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    return _ScatterRows.apply(x, counts, rank, group)


def once_over_tp(b: torch.Tensor, tp: int) -> torch.Tensor:
    return _OnceOverTP.apply(b, tp)
