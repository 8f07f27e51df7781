"""The public verbs, each a short composition of typed stages (design.md §1):

    plan:      model ─capture→ ModelGraph ─CostModel→ numbers ─search (ILP)→ SearchResult ─build_plan→ Plan
    estimate:  model ─capture→ ModelGraph ─CostModel→ numbers ─price (ILP, one layout)→ Estimate
"""

from __future__ import annotations

from typing import Any

from autopar.capture.graph import ModelGraph
from autopar.config import ParallelConfig, PlannerOptions
from autopar.errors import AutoparError
from autopar.plan import Estimate, Plan
from autopar.planner.assemble import build_estimate, build_plan
from autopar.planner.costs import CostModel
from autopar.planner.search import price, search

__all__ = ["plan", "estimate"]


def _graph(model: Any, example_inputs: tuple | None) -> ModelGraph:
    if isinstance(model, ModelGraph):
        return model
    if example_inputs is None:
        raise AutoparError("plan/estimate got an nn.Module without example_inputs; pass example_inputs=(x,) "
                           "or a ModelGraph from autopar.capture(model, x)")
    from autopar.capture import capture  # torch-heavy; only needed for modules

    return capture(model, example_inputs)


def plan(model: Any, cluster: Any, *, example_inputs: tuple | None = None, global_batch_size: int,
         profile: Any = None, options: PlannerOptions | None = None) -> Plan:
    """The fastest layout of `model` (an nn.Module with example_inputs, or a ModelGraph) on `cluster`
    that fits memory: the exact optimum of the modelled step time, with runner-ups and solver status."""
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise AutoparError(f"global_batch_size={global_batch_size!r}; it must be a positive integer")
    options = options or PlannerOptions()
    costs = CostModel.for_cluster(_graph(model, example_inputs), cluster, profile, options.memory_reserve_fraction)
    result = search(costs, global_batch_size=global_batch_size, options=options)
    return build_plan(result, costs, cluster_name=cluster.name, cluster_fingerprint=cluster.fingerprint,
                      global_batch_size=global_batch_size)


def estimate(model: Any, cluster: Any, config: ParallelConfig, *, example_inputs: tuple | None = None,
             global_batch_size: int | None = None, profile: Any = None,
             options: PlannerOptions | None = None) -> Estimate:
    """Price one given layout with exactly the planner's objective (its best stage cuts, `config.recompute`
    on every stage). Raises InfeasiblePlanError naming the constraint the layout violates."""
    if global_batch_size is not None and global_batch_size != config.global_batch_size:
        raise AutoparError(f"config {config} has dp·mbs·m = {config.global_batch_size}, not the global batch "
                           f"{global_batch_size}; adjust micro_batch_size or num_microbatches")
    options = options or PlannerOptions()
    costs = CostModel.for_cluster(_graph(model, example_inputs), cluster, profile, options.memory_reserve_fraction)
    return build_estimate(price(costs, config, options), costs)
