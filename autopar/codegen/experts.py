"""Expert parallelism: each MoE layer's expert bank split over the EP ranks, tokens moved by all-to-all.

The experts fold over a stage's ranks (docs/design.md §8; Megatron-Core's Parallel Folding, Liu et al. 2025,
arXiv:2504.14960, at ETP = 1: the experts are not tensor-parallel). The dense mesh ("pp", "dp", "cp", "tp")
is viewed as ("pp", "edp", "ep_dp", "cp", "tp"), dp = edp · ep_dp with ep_dp innermost of the dp axis, and
the EP group is

- folded (autopar.config.ep_folds: tp divides ep): the tp ranks of ep_dp = ep / tp consecutive data-parallel
  ranks, flattened ("ep_dp", "tp"), edp = dp · tp / ep. Without sequence parallelism the tp ranks hold the
  same tokens: each takes its 1/tp share of the bank call's rows (`take_share`, whose backward all-gathers
  the rows' gradients) and dispatches them; after the combine the tp ranks all-gather the outputs
  (`gather_shares`, whose backward keeps the rank's own rows). Under sequence parallelism each tp rank's
  MoE block already runs on its own sequence shard;
- otherwise ep_dp = ep consecutive data-parallel ranks, the bank replicated over tp, edp = dp / ep.

EP rank r holds experts [r·E/ep, (r+1)·E/ep) of every bank of its stage, as a DTensor sharded on dim 0 over
the EP group's mesh (state dicts, full gathers and DCP see global tensors). With the experts tensor-parallel
(config.etp = tp, never folded; ep may be 1) each tp rank holds its slice of every local expert's FFN, a
DTensor over ("ep_dp", "tp"), and the bank call is wrapped in the tp collectives of
autopar.codegen.expert_tp; every tp index dispatches the same tokens over its own EP group.

The bank is found by capture (`MoESpec.experts`, from the data flow and the module structure), and the
model's own bank code still computes the experts: a bank is called with the tokens [T, H], the expert
each token's k slots chose [T, k] (integers) and their weights [T, k]; its output is, per token, the sum
over its slots of weight × expert(token) (checked on the real weights at `parallelize`). Under EP the bank
call becomes (Lepikhin et al. 2021, GShard §2.2; dropless, as Gale et al. 2023, MegaBlocks):

1. dispatch: every (token, slot) pair goes to the rank holding its expert, sorted by that rank, by one
   all-to-all of the token copies and one of their weights (uneven splits; the counts exchanged first);
2. the bank's own forward runs on the received rows, each a one-slot token routed to a local expert
   (attributes that count the experts — `num_experts` — read E / ep while it runs);
3. combine: the outputs return by the reverse all-to-all and each token sums its slots.

The all-to-all is an autograd function whose backward is the reverse all-to-all, so gradients of the
tokens, the routing weights and the experts flow as in one process. An expert's gradient sums what every
rank of its EP group routed to it; the ranks holding the same experts (the edp · cp group, and tp under
sequence parallelism when not folded: those tp ranks hold other tokens) sum theirs, and the sum is divided
by dp · cp, the replicas the loss is averaged over (`ExpertParallel.sync_gradients`; FSDP's divide factor
under ZeRO-2/3). Every token reaches its experts exactly once per data-parallel replica in both layouts
(once per tp slice of them at etp = tp, whose ranks all run every token: no sum over tp).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from autopar.capture.graph import LayerSpec
from autopar.capture.moe import bank_width
from autopar.capture.moe_spec import MoESpec
from autopar.codegen.data_parallel import grad_of, reduce_gradients
from autopar.codegen.expert_tp import (
    FFNSplit,
    copy_to_tp,
    ffn_splits,
    gather_rows,
    once_over_tp,
    reduce_from_tp,
    scatter_rows,
    tp_placement,
    tp_slice,
)
from autopar.config import ParallelConfig
from autopar.errors import PlanMismatchError

__all__ = ["EXPERT_AXES", "ExpertParallel", "expert_mesh", "expert_grad_axes", "all_to_all", "check_bank",
           "sequence_sharded_moe_params", "TokenShardGradients", "take_share", "gather_shares"]

EXPERT_AXES = ("pp", "edp", "ep_dp", "cp", "tp")
EXPERT_GRAD_AXIS = "edp_cp"  # the ranks holding the same experts (sequence parallelism adds tp when not folded)
EP_AXIS = "ep"  # the EP group: ("ep_dp", "tp") flattened when folded, else "ep_dp"


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split `send` ways to the group's ranks, rows from each received; backward sends the
    gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (recv, send), group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv, send = ctx.splits
        back = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), send, recv, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, recv: Sequence[int], send: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all of rows with uneven splits (gloo and NCCL both run all_to_all_single)."""
    return _AllToAll.apply(x, list(recv), list(send), group)


def expert_mesh(mesh: DeviceMesh, config: ParallelConfig) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """The experts' view of the dense mesh, ("pp", "edp", "ep_dp", "cp", "tp"); the EP group's 1-D mesh
    (("ep_dp", "tp") flattened when folded, else "ep_dp"); and the flattened group of the ranks that hold
    the same experts (`expert_grad_axes`; at etp = tp, the same slice of them)."""
    edp_dp = config.dp // config.ep_dp  # the data-parallel part of edp (all of it unless folded)
    view = mesh._unflatten("dp", (edp_dp, config.ep_dp), ("edp", "ep_dp"))
    ep = view["ep_dp", "tp"]._flatten(EP_AXIS) if config.ep_folded else view["ep_dp"]
    return view, ep, view[expert_grad_axes(config)]._flatten(EXPERT_GRAD_AXIS)


def expert_grad_axes(config: ParallelConfig) -> tuple[str, ...]:
    """The axes of the ranks holding the same experts: edp and cp, and tp under sequence parallelism when the
    EP group does not fold over tp (each tp rank's MoE block then runs on its own sequence shard)."""
    if config.sequence_parallel and config.tp > 1 and not config.ep_folded and config.etp == 1:
        return ("edp", "cp", "tp")
    return ("edp", "cp")


def _share_rows(total: int, parts: int) -> list[int]:
    """Rows of each of `parts` ranks when `total` rows are split as evenly as possible (the first get one more)."""
    return [total // parts + (r < total % parts) for r in range(parts)]


def _share(total: int, parts: int, rank: int) -> slice:
    """Rank `rank`'s rows of `total` split `parts` ways (`_share_rows`)."""
    sizes = _share_rows(total, parts)
    lo = sum(sizes[:rank])
    return slice(lo, lo + sizes[rank])


def _all_gather_rows(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's rows (sizes[r] of them on rank r) concatenated in rank order; padded to one size, as
    gloo's all_gather needs equal tensors."""
    width = max(sizes)
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


class _TakeShare(torch.autograd.Function):
    """This tp rank's rows of a tensor every tp rank holds alike; backward all-gathers the rows' gradients (every
    tp rank then holds the whole, equal gradient, as for the replicated tensor)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rank: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.sizes, ctx.group = _share_rows(x.shape[0], dist.get_world_size(group)), group
        return x[_share(x.shape[0], dist.get_world_size(group), rank)]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_rows(grad.contiguous(), ctx.sizes, ctx.group), None, None


class _GatherShares(torch.autograd.Function):
    """Every tp rank's rows, concatenated; backward keeps this rank's rows of the gradient (the tp ranks compute
    the same loss from the gathered rows, so their gradients of it are equal and each is the whole)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, total: int, rank: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rows = _share(total, dist.get_world_size(group), rank)
        return _all_gather_rows(x.contiguous(), _share_rows(total, dist.get_world_size(group)), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rows], None, None, None


def take_share(x: torch.Tensor, rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable: rank `rank`'s share of the rows of `x`, which every rank of `group` holds alike."""
    return _TakeShare.apply(x, rank, group)


def gather_shares(x: torch.Tensor, total: int, rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable: the `total` rows whose shares (`take_share`) the ranks of `group` hold, in rank order."""
    return _GatherShares.apply(x, total, rank, group)


@dataclass(frozen=True, kw_only=True)
class _Call:
    """Which of a bank call's tensors are the tokens, the chosen experts and their weights."""

    hidden: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor


def _routing_call(name: str, args: tuple, kwargs: dict) -> _Call:
    """Find the tokens [T, H], the expert indices [T, k] (the one integer tensor) and their weights [T, k]."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    ints = [t for t in tensors if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]
    floats = [t for t in tensors if t.is_floating_point()]
    index = ints[0] if len(ints) == 1 and ints[0].dim() == 2 else None
    weights = [t for t in floats if index is not None and t.shape == index.shape]
    hidden = [t for t in floats if index is not None and t.dim() == 2 and t.shape[0] == index.shape[0]
              and all(t is not w for w in weights)]
    if index is None or len(weights) != 1 or len(hidden) != 1:
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)
        raise PlanMismatchError(
            f"expert bank {name!r} is called with tensors {shapes}; expert parallelism needs the bank called with "
            "the tokens [T, hidden], the chosen experts [T, k] (one integer tensor) and their weights [T, k], to "
            "send each (token, expert) pair to the rank holding the expert. Re-plan with ep=1 for this model")
    return _Call(hidden=hidden[0], index=index, weights=weights[0])


def _expert_params(bank: nn.Module, experts: int) -> list[str]:
    """Names of the bank's own parameters stacked per expert (leading dim E)."""
    return [n for n, p in bank.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == experts]


@torch.no_grad()
def check_bank(bank: nn.Module, spec: MoESpec, ep: int) -> None:
    """Refuse a bank expert parallelism cannot split, before anything is sharded: a list of expert modules
    (a block that loops over them itself), parameters not all stacked per expert, E not divisible by ep, or a
    call whose output is not the sum of its slots' (token, expert) outputs (tried on the real weights)."""
    name, experts = spec.experts, spec.num_experts
    if experts % ep:
        raise PlanMismatchError(f"expert bank {name!r} holds {experts} experts, which ep={ep} does not divide; "
                                "re-plan with an ep that divides the expert count")
    stacked = _expert_params(bank, experts)
    others = [n for n, _ in bank.named_parameters() if n not in stacked]
    if not stacked or others:
        what = "a list of expert modules" if not stacked else f"parameters {others} not stacked per expert"
        raise PlanMismatchError(
            f"expert bank {name!r} ({type(bank).__name__}) holds {what}; expert parallelism splits a bank whose "
            "own parameters stack the E experts (leading dim E) and that is called with the routing. Re-plan with "
            "ep=1 for this model")
    p = getattr(bank, stacked[0])
    hidden = bank_width([getattr(bank, n) for n in stacked], experts)
    tokens, k = 4, spec.top_k
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(p.device, p.dtype)
    index = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]).to(p.device)
    w = torch.rand(tokens, k, generator=gen).to(p.device, p.dtype)
    try:
        whole = bank(x, index, w)
        parts = sum(bank(x, index[:, j:j + 1], w[:, j:j + 1]) for j in range(k))
    except Exception as e:
        raise PlanMismatchError(
            f"expert bank {name!r} ({type(bank).__name__}) cannot be called as bank(tokens [T, H], experts [T, k], "
            f"weights [T, k]) ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); expert "
            "parallelism calls it so on each rank's received tokens. Re-plan with ep=1 for this model") from e
    # rounding of the dtype the bank runs in (a bf16 bank sums its slots in bf16): far below a real mismatch
    ok = isinstance(whole, torch.Tensor) and whole.shape == parts.shape
    tol = max(1e-4, 16 * torch.finfo(p.dtype).eps) * (float(whole.abs().max()) if ok else 1.0)
    if not ok or float((whole - parts).abs().max()) > tol:
        raise PlanMismatchError(
            f"expert bank {name!r}: its output for k experts per token is not the sum of the one-expert outputs, "
            "so its tokens cannot be split between the ranks holding their experts. Re-plan with ep=1")


class ExpertParallel:
    """The expert banks of this rank's stages, split over the EP group, and their gradient reduction."""

    def __init__(self, config: ParallelConfig, mesh: DeviceMesh) -> None:
        self.config = config
        self.mesh, self.ep_mesh, self.grad_mesh = expert_mesh(mesh, config)
        self.group = self.ep_mesh.get_group()
        # folded without sequence parallelism: the tp ranks split the tokens they hold alike (module docstring)
        self.split = config.ep_folded and not config.sequence_parallel
        self.tp_group = mesh["tp"].get_group() if self.split else None
        self.tp_rank = mesh["tp"].get_local_rank() if self.split else 0
        self.rank = self.ep_mesh.get_local_rank()
        # experts tensor-parallel (etp = tp): the tp group their FFN slices sum over, the parameters' 2-D mesh
        self.etp_group = mesh["tp"].get_group() if config.etp > 1 else None
        self.etp_rank = mesh["tp"].get_local_rank() if config.etp > 1 else 0
        self.param_mesh = self.mesh["ep_dp", "tp"] if config.etp > 1 else self.ep_mesh
        self.banks: dict[str, nn.Module] = {}
        self.local_experts: dict[str, int] = {}  # experts of each bank this rank holds (E / ep)
        self.fsdp = False  # the banks' gradients reduced by FSDP (shard_states)

    @property
    def divisor(self) -> int:
        """The loss's data-parallel replicas: what an expert's summed gradient is divided by."""
        return self.config.dp * self.config.cp

    def apply(self, part: nn.Module, layers: Iterable[LayerSpec]) -> None:
        """Split the experts of every MoE layer of `layers` held by `part` (a model or one pipeline stage)."""
        for layer in layers:
            if layer.moe is None:
                continue
            try:
                bank = part.get_submodule(layer.moe.experts)
            except AttributeError:
                continue
            check_bank(bank, layer.moe, self.config.ep)
            names = _expert_params(bank, layer.moe.num_experts)
            splits = (ffn_splits(bank, layer.moe, names, self.config.etp,
                                 bank_width([getattr(bank, n) for n in names], layer.moe.num_experts))
                      if self.config.etp > 1 else {})
            self._shard(layer.moe.experts, bank, layer.moe.num_experts, splits)

    def _shard(self, name: str, bank: nn.Module, experts: int, splits: dict[str, FFNSplit]) -> None:
        local = experts // self.config.ep
        lo = self.rank * local
        names = _expert_params(bank, experts)
        for n in names:
            p = bank._parameters[n]
            shard = p.detach()[lo:lo + local]
            if n in splits:  # this tp rank's slice of the FFN (expert_tp)
                shard = tp_slice(shard, splits[n], self.etp_rank, self.config.etp)
                placements = [Shard(0), tp_placement(splits[n])]
            else:
                shard, placements = shard.clone(), [Shard(0)]
            bank._parameters[n] = nn.Parameter(DTensor.from_local(shard, self.param_mesh, placements, run_check=False),
                                               requires_grad=p.requires_grad)
        counts = [a for a, v in vars(bank).items() if type(v) is int and v == experts]
        once = [n for n, sp in splits.items() if sp.dim is None]  # output biases: added once over tp
        bank.forward = self._dispatching(name, bank, bank.forward, names, counts, local, lo, once)
        self.banks[name] = bank
        self.local_experts[name] = local

    def _dispatching(self, name: str, bank: nn.Module, forward, names: list[str], counts: list[str], local: int,
                     lo: int, once: list[str]):
        ep, etp = self.config.ep, self.config.etp
        sp = self.config.sequence_parallel

        def local_params() -> dict[str, torch.Tensor]:
            out = {}
            for n in names:  # the bank's code sees its local experts (its tp slice of them) as plain tensors
                p = bank._parameters[n]
                p = p.to_local() if isinstance(p, DTensor) else p
                out[n] = once_over_tp(p, etp) if n in once else p
            return out

        @functools.wraps(forward)
        def run(*args, **kwargs):
            call = _routing_call(name, args, kwargs)
            x, index, weights = call.hidden, call.index, call.weights
            rows = None
            if etp > 1 and sp:  # every tp rank runs its tp group's tokens through its slice of the FFN
                x, rows = gather_rows(x, self.etp_rank, self.etp_group)
                weights, _ = gather_rows(weights, self.etp_rank, self.etp_group)
                index, _ = gather_rows(index, self.etp_rank, self.etp_group)
            elif etp > 1:
                x, weights = copy_to_tp(x, self.etp_group), copy_to_tp(weights, self.etp_group)
            out = self._dispatched(forward, bank, names, counts, local, local_params, x, index, weights) if ep > 1 \
                else self._run_local(forward, bank, names, local_params, x, index, weights)
            if etp > 1:
                out = scatter_rows(out, rows, self.etp_rank, self.etp_group) if sp else \
                    reduce_from_tp(out, self.etp_group)
            return out

        return run

    def _run_local(self, forward, bank: nn.Module, names: list[str], local_params, x: torch.Tensor,
                   index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """ep = 1 (etp = tp): the bank's own forward on every token, with its tp slice of each expert."""
        held = {n: bank._parameters[n] for n in names}
        try:
            bank._parameters.update(local_params())
            return forward(x, index, weights)
        finally:
            bank._parameters.update(held)

    def _dispatched(self, forward, bank: nn.Module, names: list[str], counts: list[str], local: int, local_params,
                 x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The EP path: dispatch each (token, slot) to its expert's rank, run the bank there, combine."""
        group, ep = self.group, self.config.ep
        whole = index.shape[0]
        if self.split:  # folded: this tp rank's share of the tokens all tp ranks hold
            x = take_share(x, self.tp_rank, self.tp_group)
            weights = take_share(weights, self.tp_rank, self.tp_group)
            index = index[_share(whole, self.config.tp, self.tp_rank)]
        tokens, k = index.shape
        expert = index.reshape(-1)
        dest = torch.div(expert, local, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_n, recv_n = send.tolist(), recv.tolist()
        token = torch.div(order, k, rounding_mode="floor")
        rows = all_to_all(x[token], recv_n, send_n, group)
        row_w = all_to_all(weights.reshape(-1)[order].unsqueeze(1), recv_n, send_n, group)
        with torch.no_grad():
            row_e = all_to_all((expert[order] % local).unsqueeze(1), recv_n, send_n, group)
        held = {n: bank._parameters[n] for n in names}
        saved = {a: getattr(bank, a) for a in counts}
        try:
            bank._parameters.update(local_params())
            for a in counts:
                setattr(bank, a, local)
            out = forward(rows, row_e.to(index.dtype), row_w)
            # every rank runs every all-to-all's backward, and every expert gets a gradient, even with no rows
            anchor = rows.sum() + row_w.sum() + sum(bank._parameters[n].reshape(-1)[:1].sum() for n in held)
            out = out + anchor.to(out.dtype) * 0
        finally:
            bank._parameters.update(held)
            for a, v in saved.items():
                setattr(bank, a, v)
        back = all_to_all(out, send_n, recv_n, group)
        # each token sums its slots: the returned rows put back in slot order (`slot`, the inverse of `order`), then
        # summed over k. index_add would save its source for backward (torch's derivatives.yaml: expand_as(source)),
        # a second copy of every returned row beside what the bank keeps; indexing saves only the int64 order
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.numel(), device=order.device)
        out = back[slot].reshape(tokens, k, *back.shape[1:]).sum(1).to(x.dtype)
        return gather_shares(out, whole, self.tp_rank, self.tp_group) if self.split else out

    def shard_states(self, *, zero_stage: int, offload_params: bool = False,
                     mp_policy: MixedPrecisionPolicy | None = None) -> set[nn.Parameter]:
        """ZeRO-2/3 for the experts: each bank `fully_shard`ed over the ranks holding its experts (edp · cp),
        its reduce-scatter dividing by dp · cp; done before the dense layers are, which then skip these
        parameters. With no other rank holding them, returns them for the dense FSDP groups to ignore (their
        gradients are then divided by `sync_gradients`)."""
        if self.grad_mesh.size() == 1:
            return set(self.parameters())
        policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_params else OffloadPolicy()
        for bank in self.banks.values():
            fully_shard(bank, mesh=self.grad_mesh, reshard_after_forward=zero_stage == 3, offload_policy=policy,
                        mp_policy=mp_policy or MixedPrecisionPolicy())
            bank.set_gradient_divide_factor(float(self.divisor))
            if dist.get_backend(self.grad_mesh.get_group()) == "gloo":  # gloo has no PREMUL_SUM: sum, then divide
                bank.set_force_sum_reduction_for_comms(True)
        self.fsdp = True
        return set()

    def parameters(self) -> list[nn.Parameter]:
        """The expert parameters of this rank's banks (their local shards under FSDP)."""
        return list({id(p): p for bank in self.banks.values() for p in bank.parameters()}.values())

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """After backward (ZeRO-0/1, or experts no other rank holds): each expert's gradient summed over the
        ranks holding it, divided by dp · cp. Nothing to do when FSDP reduced them."""
        if self.fsdp:
            return
        params = self.parameters()
        for p in params:  # an expert bank that received no token this step still takes part
            if grad_of(p) is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        reduce_gradients(params, self.grad_mesh, divisor=self.divisor)


def sequence_sharded_moe_params(part: nn.Module, layers: Iterable[LayerSpec], span_layers: Iterable[str]) -> list[str]:
    """Names (in `part`) of the plain parameters of MoE blocks that run on sequence shards under sequence
    parallelism: the router, a shared expert's gate, the experts when not split. Each tp rank's gradient of
    them covers its own tokens only (the block is no TP pattern: its input is not gathered), so they are
    summed over tp after backward (`TokenShardGradients`). DTensor parameters (TP-sharded shared experts,
    norms made sequence-parallel, expert-parallel banks) are reduced by their own placements."""
    sharded = set(span_layers)
    names: list[str] = []
    for layer in layers:
        if layer.moe is None or layer.name not in sharded:
            continue
        try:
            block = part.get_submodule(layer.moe.block)
        except AttributeError:
            continue
        names += [f"{layer.moe.block}.{n}" for n, p in block.named_parameters()
                  if not isinstance(p, DTensor) and p.requires_grad]
    return names


class TokenShardGradients:
    """Sums, over the tp group, the gradients of parameters each tp rank computed on its own sequence shard."""

    def __init__(self, params: Sequence[nn.Parameter], tp_mesh: DeviceMesh) -> None:
        self.params = list(params)
        self.tp_mesh = tp_mesh

    @torch.no_grad()
    def sync(self) -> None:
        for p in self.params:
            if grad_of(p) is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        reduce_gradients(self.params, self.tp_mesh, divisor=1)
