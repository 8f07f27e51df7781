"""The public verbs, each a short composition of typed stages (docs/design.md §1):

    plan:      model ─capture→ ModelGraph ─CostModel→ numbers ─search (ILP)→ SearchResult ─build_plan→ Plan
    estimate:  model ─capture→ ModelGraph ─CostModel→ numbers ─price (ILP, one layout; or its given stages)→ Estimate
    parallelize: model ─capture→ ModelGraph ─(plan on rank 0, broadcast)→ Plan ─codegen→ ParallelModel
"""

from __future__ import annotations

from typing import Any

from autopar import errors
from autopar.capture.graph import ModelGraph
from autopar.checks import MAX_GLOBAL_BATCH, check_positive_int
from autopar.config import ParallelConfig, PlannerOptions, check_options
from autopar.errors import AutoparError, ConfigError, PlanMismatchError
from autopar.plan import Estimate, Plan, StagePlan
from autopar.planner.assemble import build_estimate, build_plan
from autopar.planner.costs import CostModel
from autopar.planner.plan_fit import check_stages_for_graph
from autopar.planner.search import price, search

__all__ = ["plan", "estimate", "parallelize"]


def _graph(model: Any, example_inputs: tuple | None, example_kwargs: dict[str, Any] | None = None, *,
           loss_fn: Any = None, target_arg: str | None = None) -> ModelGraph:
    """The model's graph as `parallelize(..., loss_fn=, target_arg=)` trains it, so that plan, estimate and
    parallelize price and check the same program (a model's own loss is captured with its targets)."""
    if isinstance(model, ModelGraph):
        return model
    if isinstance(model, str):  # MODEL as the CLI takes it (autopar.models): zoo name, transformers config, Hub name
        from autopar.models import resolve_model

        if example_inputs is not None or example_kwargs:
            raise AutoparError(f"model {model!r} is a name, which brings its own example inputs; drop example_inputs "
                               "(for another sequence length: autopar.models.resolve_model(name, seq_len=N))")
        model, example_inputs, example_kwargs = resolve_model(model)
    from torch import nn

    if not isinstance(model, nn.Module):
        raise AutoparError(f"model is a {type(model).__name__}; pass an nn.Module with example_inputs=(x,), or a "
                           "ModelGraph from autopar.capture(model, x) (zoo models: autopar.zoo.build(name))")
    if example_inputs is None and not example_kwargs:
        raise AutoparError("plan/estimate got an nn.Module without example_inputs; pass example_inputs=(x,) "
                           "(and example_kwargs={...} for keyword inputs) or a ModelGraph from "
                           "autopar.capture(model, x)")
    from autopar.capture import capture  # torch-heavy; only needed for modules

    if loss_fn is not None and target_arg is not None:
        raise PlanMismatchError(f"pass loss_fn or target_arg={target_arg!r}, not both: target_arg trains on the "
                                "model's own loss, loss_fn on a loss of its logits")
    return capture(model, example_inputs, example_kwargs, own_loss=loss_fn is None, target_arg=target_arg)


def _cluster(cluster: Any, *, or_plan: bool = False) -> Any:
    from autopar.cluster import Cluster

    if not isinstance(cluster, Cluster):
        plan_hint = ", or a Plan: autopar.Plan.load(path)" if or_plan else ""
        raise AutoparError(f"cluster is a {type(cluster).__name__} ({cluster!r:.60}); pass a Cluster: "
                           f"Cluster.preset(name, nodes=N), Cluster.from_file(path) or Cluster.local(){plan_hint}")
    return cluster


def _priced(graph: ModelGraph, options: PlannerOptions) -> ModelGraph:
    """The graph as the cost model prices it: its MoE layers at `options.router_skew` when set."""
    if options.router_skew is None:
        return graph
    try:
        return graph.with_moe_load_imbalance(options.router_skew)
    except ValueError as e:
        raise ConfigError(f"PlannerOptions.router_skew={options.router_skew:g}: {e}") from None


def _check_stages(stages: Any, config: ParallelConfig, graph: ModelGraph) -> list[StagePlan]:
    """A plan's stages, in index order, that fit `config` and hold `graph`'s layers exactly once, in order."""
    if not all(isinstance(st, StagePlan) for st in stages):
        raise AutoparError("stages must be StagePlans, e.g. plan.stages of a plan made for this model")
    ordered = sorted(stages, key=lambda st: st.index)
    want = config.pp * config.virtual_stages
    if [st.index for st in ordered] != list(range(want)):
        raise PlanMismatchError(f"stages have indices {[st.index for st in ordered]}; layout {config} has pp × "
                                f"virtual_stages = {want} stages, 0..{want - 1}; pass the stages of a plan with "
                                "this layout")
    check_stages_for_graph(ordered, graph, where="stages")
    return ordered


def plan(model: Any, cluster: Any, *, example_inputs: tuple | None = None, example_kwargs: dict[str, Any] | None = None,
         global_batch_size: int, profile: Any = None, options: PlannerOptions | None = None, loss_fn: Any = None,
         target_arg: str | None = None) -> Plan:
    """The fastest layout of `model` (an nn.Module with example_inputs and/or example_kwargs, as its forward
    takes them, or a ModelGraph) on `cluster` that fits memory: the exact optimum of the modelled step
    time, with runner-ups and solver status. loss_fn / target_arg: as `parallelize` will get them (a model
    whose forward takes its targets is planned training on its own loss unless a loss_fn is given)."""
    check_positive_int("global_batch_size", global_batch_size, bound=MAX_GLOBAL_BATCH, error=AutoparError)
    options = check_options(options)
    cluster = _cluster(cluster)
    graph = _graph(model, example_inputs, example_kwargs, loss_fn=loss_fn, target_arg=target_arg)
    costs = CostModel.for_cluster(_priced(graph, options), cluster, profile, options.memory_reserve_fraction,
                                  options.loss_kernel, precision=options.precision,
                                  pipeline_runtime=options.pipeline_runtime,
                                  ep_dispatcher=options.ep_dispatcher, fp8_runtime=options.fp8_runtime)
    cluster.check_precision(costs.precision.name)
    result = search(costs, global_batch_size=global_batch_size, options=options)
    return build_plan(result, costs, cluster_name=cluster.name, cluster_fingerprint=cluster.fingerprint,
                      global_batch_size=global_batch_size, graph_fingerprint=graph.fingerprint,
                      router_skew=options.router_skew)


def estimate(model: Any, cluster: Any, config: ParallelConfig, *, example_inputs: tuple | None = None,
             example_kwargs: dict[str, Any] | None = None, global_batch_size: int | None = None, profile: Any = None,
             options: PlannerOptions | None = None, stages: tuple[StagePlan, ...] | None = None,
             loss_fn: Any = None, target_arg: str | None = None) -> Estimate:
    """Price one given layout with exactly the planner's objective (loss_fn / target_arg: as for `plan`).

    Without `stages`: the layout's best stage cuts (an ILP) with `config.recompute` on every stage.
    With `stages` (a plan's own `plan.stages`): exactly those cuts and per-layer recompute modes, so
    `estimate(graph, cluster, plan.config, stages=plan.stages)` reproduces `plan.estimate` even when the
    plan mixes recompute modes across layers. A layout over memory is priced all the same (its best cuts
    cannot fit, so its even ones): `Estimate.fits` is False, `violated` names the broken constraint and
    `memory_breakdown` says where the bytes go. Raises InfeasiblePlanError for a layout that cannot run at
    all (degrees that do not match the cluster or the model)."""
    if not isinstance(config, ParallelConfig):
        raise AutoparError(f"config is a {type(config).__name__}; pass a ParallelConfig, e.g. "
                           "ParallelConfig(tp=2, dp=4) or ParallelConfig.parse('tp=2,dp=4')")
    if global_batch_size is not None:
        check_positive_int("global_batch_size", global_batch_size, bound=MAX_GLOBAL_BATCH, error=AutoparError)
    if global_batch_size is not None and global_batch_size != config.global_batch_size:
        raise AutoparError(f"config {config} has dp·mbs·m = {config.global_batch_size}, not the global batch "
                           f"{global_batch_size}; adjust micro_batch_size or num_microbatches")
    options = check_options(options)
    cluster = _cluster(cluster)
    graph = _graph(model, example_inputs, example_kwargs, loss_fn=loss_fn, target_arg=target_arg)
    cluster.check_precision(config.precision)
    costs = CostModel.for_cluster(_priced(graph, options), cluster, profile, options.memory_reserve_fraction,
                                  options.loss_kernel, precision=config.precision,
                                  pipeline_runtime=options.pipeline_runtime,
                                  ep_dispatcher=options.ep_dispatcher, fp8_runtime=options.fp8_runtime)
    if stages is None:
        return build_estimate(price(costs, config, options), costs)
    ordered = _check_stages(stages, config, costs.graph)
    return build_estimate(price(costs, config, options, layer_modes=tuple(k for st in ordered for k in st.layer_modes),
                                layers_per_stage=tuple(len(st.layers) for st in ordered)), costs)


def _plan_everywhere(graph: ModelGraph, cluster: Any, global_batch_size: int | None, profile: Any,
                     options: PlannerOptions | None) -> Plan:
    """Plan once on rank 0 and send the plan's JSON to every rank, so all ranks run the same layout; a plan
    rank 0 cannot make (a pinned option the model refuses) is raised on every rank, not left to a peer's
    broken connection."""
    import torch.distributed as dist

    if global_batch_size is None:
        raise AutoparError("parallelize(model, cluster, ...) plans first and needs global_batch_size=; "
                           "or pass a Plan from autopar.plan(...)")
    shared = dist.is_initialized() and dist.get_world_size() > 1
    payload: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            payload = [plan(graph, cluster, global_batch_size=global_batch_size, profile=profile,
                            options=options).to_dict()]
        except AutoparError as e:
            if not shared:
                raise
            payload = [(type(e).__name__, str(e))]
    if shared:
        dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], tuple):
        kind, message = payload[0]
        raise getattr(errors, kind, AutoparError)(message)
    return Plan.from_dict(payload[0])


def parallelize(model: Any, plan_or_cluster: Any, *, example_inputs: tuple | None = None,
                example_kwargs: dict[str, Any] | None = None, optimizer: Any, loss_fn: Any = None,
                target_arg: str | None = None, global_batch_size: int | None = None, profile: Any = None,
                options: PlannerOptions | None = None, device: Any = None,
                max_grad_norm: float | None = None) -> Any:
    """Shard `model` on this rank as a plan says and return its `ParallelModel` (call on every rank).

    plan_or_cluster: a `Plan` (e.g. `Plan.load("plan.json")`), or a `Cluster` to plan for first
    (rank 0 plans with `global_batch_size`, `profile` and `options`; every rank gets the same plan).
    example_inputs / example_kwargs: the model's inputs as its forward takes them (a tuple, None allowed,
    and a dict), nested. optimizer: a factory `params -> torch.optim.Optimizer`; loss_fn:
    `(logits, targets) -> mean loss`, targets as `train_step` gets them (default: language-model cross
    entropy, vocab-parallel under tensor parallelism). Without loss_fn, a model whose forward takes its
    targets (`targets`, `labels`, or the argument named by `target_arg`) trains on the loss it returns,
    averaged over the global batch's tokens as one process averages it. max_grad_norm: clip the global
    gradient norm (over every rank) to this before each step.
    """
    from autopar import codegen
    from autopar.codegen.device import resolve_device
    from autopar.codegen.mesh import init_distributed

    if isinstance(model, (str, ModelGraph)):
        raise AutoparError(f"parallelize trains the model itself and got a {type(model).__name__} ({model!r:.60}); "
                           "pass the nn.Module with its weights (e.g. transformers.AutoModelForCausalLM."
                           "from_pretrained(name), or autopar.zoo.build(name, device='cpu')); names and graphs are "
                           "for plan and estimate")
    graph = _graph(model, example_inputs, example_kwargs, loss_fn=loss_fn, target_arg=target_arg)
    if isinstance(plan_or_cluster, Plan):
        the_plan = plan_or_cluster
    else:
        cluster = _cluster(plan_or_cluster, or_plan=True)
        probe = ParallelConfig(dp=cluster.world_size)  # only its world size matters for the launch check
        init_distributed(probe, resolve_device(device))
        opts = check_options(options)
        the_plan = _plan_everywhere(graph, cluster, global_batch_size, profile, opts)
    return codegen.parallelize(model, the_plan, graph=graph, example_inputs=example_inputs,
                               example_kwargs=example_kwargs or None, optimizer=optimizer, device=device,
                               loss_fn=loss_fn, target_arg=target_arg, max_grad_norm=max_grad_norm)
