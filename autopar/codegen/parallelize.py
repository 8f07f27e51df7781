"""`parallelize`: a `Plan` applied to a model, on every rank of a torchrun job.

The order is fixed (docs/design.md, as torchtitan composes it): mesh → fp32 master weights → FP8 linears
(torchao, before any sharding) → what crosses each pipeline cut (a dry run of the model's forward in the
compute dtype) → pipeline stages (each dry-run on its own) → batch norms synchronised over dp → tensor
parallelism (tied weights tied again) → activation recompute → ZeRO/data parallelism (FSDP2 gathering in
the compute dtype; parameters on the host under offload="params") → autocast around each stage's forward →
the user's optimizer (on the host under offload="optimizer"; under ZeRO-1 with a 16-bit policy over the
owned fp32 masters, the parameters then in 16 bits: codegen/dist_optimizer.py) → schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from autopar.capture.graph import ModelGraph
from autopar.capture.loss_mode import own_loss_target
from autopar.capture.targets import example_targets, target_parameter, targets_in_batch
from autopar.capture.vocab_split import vocab_parallel_head
from autopar.codegen.batch import MicroBatches, batch_size_of, resize_batch
from autopar.codegen.batch_norm import apply_sync_batch_norm
from autopar.codegen.compile import apply_compile
from autopar.codegen.context_parallel import ContextParallel, SequenceShard, check_context_parallel, padded_length
from autopar.codegen.data_parallel import Zero1Partition, apply_fsdp, split_mixed_groups
from autopar.codegen.dataflow import DataFlow, forward_kwargs, trace_dataflow
from autopar.codegen.device import resolve_device
from autopar.codegen.dist_optimizer import DistributedOptimizer
from autopar.codegen.experts import ExpertParallel, TokenShardGradients, sequence_sharded_moe_params
from autopar.codegen.float8 import convert_float8, float8_linear_names
from autopar.codegen.loss import lm_cross_entropy, resolve_loss
from autopar.codegen.mesh import build_mesh, init_distributed
from autopar.codegen.model_loss import check_model_loss
from autopar.codegen.offload import HostOptimizer
from autopar.codegen.pipeline import (
    build_schedule,
    build_stage,
    check_stage_placement,
    dry_run_stage,
    layer_modules,
    stage_of_units,
)
from autopar.codegen.precision import (
    LossScaler,
    apply_autocast,
    compute_context,
    fsdp_mixed_precision,
    policy,
    to_masters,
)
from autopar.codegen.recompute import apply_recompute
from autopar.codegen.runtime import ParallelModel
from autopar.codegen.shared import SharedGradients, alias_groups, retie, stages_holding
from autopar.codegen.tensor_parallel import apply_tensor_parallel, sequence_span
from autopar.errors import PlanMismatchError
from autopar.plan import Plan
from autopar.planner.plan_fit import check_plan_for_graph, loss_switch_note

__all__ = ["parallelize"]


def _graph_of(model: nn.Module, example_inputs: Sequence[Any] | None,
              example_kwargs: Mapping[str, Any] | None, own_loss: bool, target_arg: str | None) -> ModelGraph:
    try:
        from autopar.capture import capture  # owned by the capture module; imported late on purpose
    except ImportError as e:
        raise PlanMismatchError("parallelize needs the model's graph: pass graph=autopar.capture(model, x)") from e
    if example_inputs is None and not example_kwargs:
        raise PlanMismatchError("parallelize needs example_inputs or example_kwargs (or graph=) to check the plan "
                                "against the model")
    # captured as it trains: a model's own loss with its targets, and its loss's kernels
    return capture(model, tuple(example_inputs or ()), dict(example_kwargs or {}), own_loss=own_loss,
                   target_arg=target_arg)


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module) -> None:
    """Same initial weights on every rank, whatever each rank's seed was."""
    if dist.get_world_size() > 1:
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


def _microbatch_inputs(graph: ModelGraph, example_inputs: Sequence[Any] | None,
                       example_kwargs: Mapping[str, Any] | None, micro_batch_size: int,
                       targets: Any = None) -> tuple[tuple[tuple, dict], Any]:
    """Inputs (and the example's own targets, if any) shaped like one micro-batch (for the dry run that finds
    what crosses each pipeline cut, and the check of the model's own loss)."""
    if example_inputs is None and not example_kwargs:
        if not graph.seq_len:
            raise PlanMismatchError("parallelize needs example_inputs for a model whose graph has no sequence length")
        return ((torch.zeros(micro_batch_size, graph.seq_len, dtype=torch.long),), {}), None
    inputs = (tuple(example_inputs or ()), dict(example_kwargs or {}))
    size = batch_size_of(inputs)
    return resize_batch((inputs, targets), size, micro_batch_size) if size is not None else (inputs, targets)


def _context_parallel(model: nn.Module, graph: ModelGraph, plan: Plan, mesh) -> ContextParallel | None:
    """The cp runtime of this rank (None when cp = 1), after refusing what cannot run sequence-sharded."""
    cfg = plan.config
    if cfg.cp == 1:
        return None
    multiple = 2 * cfg.cp * (cfg.tp if cfg.sequence_parallel else 1)
    check_context_parallel(model, graph, padded_length(graph.seq_len or multiple, multiple))
    return ContextParallel(mesh["cp"], SequenceShard(cp=cfg.cp, rank=mesh["cp"].get_local_rank(), multiple=multiple))


def _fsdp_paths(part: nn.Module, paths: Sequence[str]) -> list[str]:
    """Unit paths to shard as their own FSDP groups: not those holding a weight another unit shares
    (one parameter belongs to one group; those stay in the stage's root group)."""
    owner_of: dict[int, set[str]] = {}
    for path in paths:
        for p in part.get_submodule(path).parameters():
            owner_of.setdefault(id(p), set()).add(path)
    tied = {path for owners in owner_of.values() if len(owners) > 1 for path in owners}
    return [p for p in paths if p not in tied]


def _agree(failure: BaseException | None) -> None:
    """Every rank learns whether any rank failed to build its stages, and all raise together.

    Building a stage can fail on some ranks only (a construct on one pipeline stage that tensor
    parallelism cannot shard); its peers would otherwise block in the next collective until the
    process-group timeout. The failing rank re-raises its own error; the others name it.
    """
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    reports: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, mine)
    if failure is not None:
        raise failure
    failed = [(rank, msg) for rank, msg in enumerate(reports) if msg is not None]
    if failed:
        rank, msg = failed[0]
        raise PlanMismatchError(f"rank {rank} could not build its part of the plan ({msg}); every rank stops")


def parallelize(model: nn.Module, plan: Plan, *, graph: ModelGraph | None = None,
                example_inputs: Sequence[Any] | None = None, example_kwargs: Mapping[str, Any] | None = None,
                optimizer: Callable[[list], torch.optim.Optimizer],
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                target_arg: str | None = None, device: str | torch.device | None = None,
                max_grad_norm: float | None = None) -> ParallelModel:
    """Shard `model` as `plan` says and return the `ParallelModel` that trains it (call on every rank).

    The model's own forward runs on every stage (`pipeline.py`); with pp = 1 it is the model itself,
    sharded in place. optimizer: a factory `named_params -> torch.optim.Optimizer`; it receives this
    rank's parameters as `(name, parameter)` pairs under the model's own names (torch optimizers take
    them as they are, or build parameter groups by name from them), and the optimizer it returns is
    `ParallelModel.optimizer`, which LR schedulers drive unchanged. loss_fn: `(logits, targets) -> mean
    loss`; `lm_cross_entropy` runs vocab-parallel under TP. max_grad_norm: clip the global gradient norm
    (over every rank) to this before each step.
    Without loss_fn, a model whose forward takes its targets (`targets`, `labels`, or `target_arg`) trains on
    the loss it returns (`model_loss.py`); any other on `lm_cross_entropy` of the logits it returns.
    The model's parameters are modified in place (sharded, fp32 masters; in the compute dtype under ZeRO-1
    with a 16-bit policy, the masters then on their owners); its weights are taken from rank 0.
    """
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise PlanMismatchError(f"max_grad_norm={max_grad_norm!r}; give a positive number (e.g. 1.0) or None")
    if loss_fn is not None and target_arg is not None:
        raise PlanMismatchError(f"pass loss_fn or target_arg={target_arg!r}, not both: target_arg trains on the "
                                "model's own loss, loss_fn on a loss of its logits")
    target_name = target_parameter(model, target_arg) if loss_fn is None else None
    loss_fn = loss_fn or lm_cross_entropy
    graph = graph if graph is not None else _graph_of(model, example_inputs, example_kwargs, target_name is not None,
                                                      target_arg)

    def recapture(mode: str, inputs=example_inputs, kwargs=example_kwargs) -> ModelGraph | None:
        """The model as the plan priced it, when it trains another loss (the example as given)."""
        if inputs is None and not kwargs:
            return None
        target = own_loss_target(mode)
        return _graph_of(model, inputs or (), kwargs, target is not None, target or None)

    # stages cover the layers once, in order; tp splits them; numbers sane; a plan priced under another loss runs
    priced = check_plan_for_graph(plan, graph, recapture=recapture)
    # targets in the example's dict (a data collator's `labels`): captured with the rest above, passed apart below
    example_kwargs, example_target = targets_in_batch(example_kwargs, None, target_name, where="parallelize")
    cfg = plan.config
    dev = resolve_device(device)
    init_distributed(cfg, dev)
    if (note := loss_switch_note(plan, priced, graph, cfg.micro_batch_size)) and dist.get_rank() == 0:
        print(note, flush=True)
    check_stage_placement(plan)
    mesh, grad_mesh = build_mesh(cfg, dev)
    pol = policy(cfg.precision)
    model.to(dev)
    to_masters(model, pol)
    _broadcast_from_rank0(model)
    fsdp = cfg.zero_stage >= 2 and (cfg.dp * cfg.cp > 1 or cfg.offload == "params")
    float8_gather = fsdp and cfg.fp8 == "tensorwise"
    if cfg.fp8 == "tensorwise" and cfg.sequence_parallel and dist.get_backend() == "gloo":
        raise PlanMismatchError("fp8='tensorwise' with sequence parallelism all-gathers float8 activations, which gloo "
                                "cannot (no float8 type); run it on NCCL, or re-plan with --fp8 rowwise or without "
                                "sequence parallelism")
    if cfg.fp8 != "none":
        convert_float8(model, float8_linear_names(model, graph, cfg.tp), cfg.fp8, device=dev,
                       fsdp_float8_all_gather=float8_gather)

    units = stage_of_units(graph, plan)
    context = _context_parallel(model, graph, plan, mesh)
    stage_kwargs: dict[str, Any] = {}
    needs_micro_batch = len(plan.stages) > 1 or target_name is not None
    micro, micro_target = (_microbatch_inputs(graph, example_inputs, example_kwargs, cfg.micro_batch_size,
                                              example_target) if needs_micro_batch else (None, None))
    if micro is not None and context is not None:  # every stage runs at the shard's length, with its positions
        micro, micro_target = context.split(micro, micro_target)
        stage_kwargs = context.forward_kwargs(model, tree_map_only(torch.Tensor, lambda t: t.to(dev), micro))
    one_micro_batch = micro if len(plan.stages) > 1 else None
    flow_kwargs = {**micro[1], **stage_kwargs} if micro else {}
    if target_name is not None:
        check_model_loss(model, target_name, micro[0], {**forward_kwargs(model), **micro[1]}, micro_target)
        micro_target = micro_target if micro_target is not None else example_targets(micro)
        flow_kwargs = {**micro[1], **stage_kwargs, target_name: micro_target}
    with compute_context(dev, pol):  # cut tensors in the dtypes the stages will send
        flow = (trace_dataflow(model, list(units), one_micro_batch[0], flow_kwargs, own_loss=target_name is not None)
                if one_micro_batch else DataFlow.single_stage())
    feed = MicroBatches()
    ios = flow.stages(units, len(plan.stages))
    ties = alias_groups(model)
    shared = SharedGradients(model, stages_holding(model, units, flow.replicated, len(plan.stages)),
                             mesh.mesh.reshape(cfg.pp, cfg.dp * cfg.cp, cfg.tp), cfg.pp)
    pp_rank = mesh["pp"].get_local_rank()
    span = sequence_span(graph, cfg.tp) if cfg.sequence_parallel else None
    experts = ExpertParallel(cfg, mesh) if cfg.ep > 1 or cfg.etp > 1 else None
    parts: list[tuple[int, nn.Module]] = []
    token_shard: list[nn.Parameter] = []  # MoE blocks' parameters whose tp ranks saw other tokens (SP)
    failure: BaseException | None = None
    try:
        for stage in (s for s in plan.stages if s.pp_rank == pp_rank):
            part = build_stage(model, flow, ios, units, stage.index, device=dev, feed=feed, target_name=target_name,
                               kwargs=stage_kwargs)
            if one_micro_batch:
                dry_run_stage(part, flow, ios[stage.index], feed, one_micro_batch, micro_target)
            apply_sync_batch_norm(part, mesh["dp"].get_group() if cfg.dp > 1 else None, cfg.dp)
            layers = [graph.layer(name) for name in stage.layers]
            if cfg.tp > 1:
                apply_tensor_parallel(part, layers, mesh["tp"], sequence_parallel=span,
                                      logits_as_dtensor=target_name is not None)
                retie(part, ties, {m for la in graph.layers for p in la.tp_patterns if p.splits(cfg.tp)
                                   for m in (*p.column, *p.row)})
            if experts is not None:
                experts.apply(part, layers)
            moe_sp = sequence_sharded_moe_params(part, layers, span.sharded_layers) if span and cfg.tp > 1 else []
            if context is not None:  # before recompute, which re-runs the units' forwards in backward
                if len(plan.stages) == 1:
                    part.forward = context.with_positions(model, part.forward)
                context.apply(part, [p for la in layers if la.kind == "block" for p in layer_modules(graph, la.name)])
            for layer in layers:
                if layer.kind == "block":
                    for path in layer_modules(graph, layer.name):
                        apply_recompute(part.get_submodule(path), stage.recompute_of(layer.name))
                        if cfg.compile:
                            apply_compile(part.get_submodule(path), enters_modes=context is not None)
            if fsdp:
                ignored = (experts.shard_states(zero_stage=cfg.zero_stage, offload_params=cfg.offload == "params",
                                                mp_policy=fsdp_mixed_precision(pol))
                           if experts is not None else None)
                paths = [p for la in layers for p in layer_modules(graph, la.name) if p not in flow.replicated]
                apply_fsdp(part, _fsdp_paths(part, paths), grad_mesh, zero_stage=cfg.zero_stage,
                           offload_params=cfg.offload == "params", ignored_params=ignored,
                           mp_policy=fsdp_mixed_precision(pol))
            token_shard += [part.get_parameter(n) for n in moe_sp]  # after FSDP: its sharded parameters
            apply_autocast(part, dev, pol)
            parts.append((stage.index, part))
    except Exception as e:  # held until every rank has reported, so no rank waits for a failed peer
        failure = e
    _agree(failure)

    named = list({id(p): (n, p) for _, part in parts for n, p in part.named_parameters() if p.requires_grad
                  }.values())
    zero1 = (Zero1Partition([p for _, p in named], grad_mesh,
                            expert_params=experts.parameters() if experts is not None else (),
                            expert_mesh=experts.grad_mesh if experts is not None else None)
             if cfg.zero_stage == 1 and cfg.dp * cfg.cp > 1 else None)
    opt: torch.optim.Optimizer | HostOptimizer | DistributedOptimizer
    if cfg.offload == "optimizer":  # host masters for the parameters this rank steps (ZeRO-1: those it owns)
        stepped = [(n, p) for n, p in named if zero1 is None or zero1.owns(p)]
        opt = HostOptimizer(stepped, lambda masters: _make_optimizer(optimizer, masters))
    elif zero1 is not None and pol.mixed:  # 16-bit parameters, fp32 main gradients, masters on their owners
        opt = DistributedOptimizer(named, zero1, pol, lambda masters: _make_optimizer(optimizer, masters))
    else:
        opt = _make_optimizer(optimizer, named)
    vocab_parallel = vocab_parallel_head(graph, cfg.tp)  # false where tp keeps the head whole: full logits
    loss = resolve_loss(loss_fn, mesh["tp"] if cfg.tp > 1 else None, vocab_parallel)
    if context is not None:
        loss = context.loss(loss)
    scaler = LossScaler() if pol.loss_scaling else None
    own: list[ParallelModel] = []  # on the model's own loss, the schedule's loss is the ParallelModel's (below)
    unscaled = (lambda out, target: own[0].own_loss(out)) if target_name else loss
    schedule_loss = unscaled if scaler is None else (lambda out, target: unscaled(out, target) * scaler.scale)
    schedule = (build_schedule(plan, parts, mesh["pp"], dev, schedule_loss, feed,
                               per_microbatch_mean=target_name is None) if cfg.pp > 1 else None)
    pm = ParallelModel(config=cfg, mesh=mesh, parts=parts, num_stages=len(plan.stages), schedule=schedule,
                       loss_fn=loss, optimizer=opt, vocab_parallel=vocab_parallel, device=dev, feed=feed,
                       shared_gradients=shared, float8_fsdp_scales=float8_gather, target_name=target_name,
                       context=context, grad_mesh=grad_mesh, experts=experts,
                       token_shard_gradients=TokenShardGradients(token_shard, mesh["tp"]) if token_shard else None,
                       zero1=zero1, max_grad_norm=max_grad_norm, loss_scaler=scaler)
    own.append(pm)
    return pm


def _make_optimizer(factory: Callable[[list], torch.optim.Optimizer],
                    named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """The user's optimizer over this rank's named parameters, its mixed DTensor/plain groups split."""
    opt = factory(named)
    if not isinstance(opt, torch.optim.Optimizer):
        raise PlanMismatchError(f"the optimizer factory returned a {type(opt).__name__}; it must return a "
                                "torch.optim.Optimizer built from the parameters it is given, e.g. "
                                "optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)")
    given = {id(p) for _, p in named}
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    if held - given:
        raise PlanMismatchError("the optimizer holds parameters it was not given (the model's own, before "
                                "sharding?); build it from the factory's argument only")
    split_mixed_groups(opt)
    return opt
