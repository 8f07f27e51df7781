"""`parallelize`: a `Plan` applied to a model, on every rank of a torchrun job.

The order is fixed (design.md §7, as torchtitan composes it): mesh → pipeline stage cut →
tensor parallelism → activation recompute → ZeRO/data parallelism → optimizer → schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autopar.capture.graph import ModelGraph
from autopar.codegen.data_parallel import ShardedOptimizer, apply_fsdp, param_groups_by_kind
from autopar.codegen.loss import lm_cross_entropy, resolve_loss
from autopar.codegen.mesh import build_mesh, init_distributed, resolve_device
from autopar.codegen.pipeline import build_schedule, build_stage_module, check_stage_placement, layer_modules
from autopar.codegen.recompute import apply_recompute
from autopar.codegen.runtime import ParallelModel
from autopar.codegen.tensor_parallel import apply_tensor_parallel, sequence_span
from autopar.errors import PlanMismatchError
from autopar.plan import Plan

__all__ = ["parallelize"]


def _graph_of(model: nn.Module, example_inputs: Sequence[torch.Tensor] | None) -> ModelGraph:
    try:
        from autopar.capture import capture  # owned by the capture module; imported late on purpose
    except ImportError as e:
        raise PlanMismatchError("parallelize needs the model's graph: pass graph=autopar.capture(model, x)") from e
    if example_inputs is None:
        raise PlanMismatchError("parallelize needs example_inputs (or graph=) to check the plan against the model")
    return capture(model, tuple(example_inputs))


def check_plan(plan: Plan, graph: ModelGraph) -> None:
    """The plan must have been made for this model graph, and its tp must split every TP pattern."""
    if plan.graph_fingerprint != graph.fingerprint:
        raise PlanMismatchError(
            f"the plan was made for model {plan.model_name!r} (graph fingerprint {plan.graph_fingerprint}) but this "
            f"model is {graph.model_name!r} (fingerprint {graph.fingerprint}); make a plan for this model with "
            "autopar.plan(model, cluster, ...)"
        )
    tp = plan.config.tp
    for layer in graph.layers:
        for pattern in layer.tp_patterns:
            if not pattern.max_degree_ok(tp):
                raise PlanMismatchError(
                    f"layer {layer.name}: tp={tp} does not divide its {pattern.kind} pattern (heads="
                    f"{pattern.num_heads}, kv heads={pattern.num_kv_heads}, vocab={pattern.vocab_size}); "
                    "re-plan with a tp that divides them"
                )


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module) -> None:
    """Same initial weights on every rank, whatever each rank's seed was."""
    if dist.get_world_size() > 1:
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


def parallelize(model: nn.Module, plan: Plan, *, graph: ModelGraph | None = None,
                example_inputs: Sequence[torch.Tensor] | None = None,
                optimizer: Callable[[list], torch.optim.Optimizer],
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_cross_entropy,
                device: str | torch.device | None = None) -> ParallelModel:
    """Shard `model` as `plan` says and return the `ParallelModel` that trains it (call on every rank).

    optimizer: a factory `params -> torch.optim.Optimizer` (it receives parameter groups).
    loss_fn: `(logits, targets) -> mean loss`; `lm_cross_entropy` runs vocab-parallel under TP.
    The model's parameters are modified in place (sharded); its weights are taken from rank 0.
    """
    graph = graph if graph is not None else _graph_of(model, example_inputs)
    check_plan(plan, graph)
    cfg = plan.config
    dev = resolve_device(device)
    init_distributed(cfg, dev)
    check_stage_placement(plan)
    mesh = build_mesh(cfg, dev)
    model.to(dev)
    _broadcast_from_rank0(model)

    pp_rank = mesh["pp"].get_local_rank()
    sp = cfg.sequence_parallel
    span = sequence_span(graph) if sp else None
    parts: list[tuple[int, nn.Module]] = []
    for stage in (s for s in plan.stages if s.pp_rank == pp_rank):
        part = build_stage_module(model, graph, stage, sequence_shards=cfg.tp if sp else 1)
        layers = [graph.layer(name) for name in part.layer_names]
        if cfg.tp > 1:
            apply_tensor_parallel(part, layers, mesh["tp"], sequence_parallel=span)
        for layer in layers:
            if layer.kind == "block":
                for path in layer_modules(graph, layer.name):
                    apply_recompute(part.get_submodule(path), stage.recompute)
        if cfg.zero_stage >= 2 and cfg.dp > 1:
            paths = [p for la in layers for p in layer_modules(graph, la.name)]
            apply_fsdp(part, paths, mesh["dp"], zero_stage=cfg.zero_stage)
        parts.append((stage.index, part))

    params = [p for _, part in parts for p in part.parameters()]
    if cfg.zero_stage == 1 and cfg.dp > 1:
        opt: torch.optim.Optimizer | ShardedOptimizer = ShardedOptimizer(params, optimizer, mesh["dp"])
    else:
        opt = optimizer(param_groups_by_kind(params))
    vocab_parallel = cfg.tp > 1 and any(p.kind == "lm_head" for la in graph.layers for p in la.tp_patterns)
    loss = resolve_loss(loss_fn, mesh["tp"] if cfg.tp > 1 else None, vocab_parallel)
    schedule = build_schedule(plan, parts, mesh["pp"], dev, loss) if cfg.pp > 1 else None
    return ParallelModel(config=cfg, mesh=mesh, parts=parts, num_stages=len(plan.stages), schedule=schedule,
                         loss_fn=loss, optimizer=opt, vocab_parallel=vocab_parallel, device=dev)
