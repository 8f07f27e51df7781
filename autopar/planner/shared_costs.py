"""What weights several layers share cost the planner (ModelGraph.shared_params; codegen/shared.py).

Capture charges a shared weight (a head tied to the token embedding) to every layer holding it, as
each pipeline stage holding one keeps a replica. Two corrections follow:
- with pp > 1 the replicas' gradients are summed over the holding stages after the data-parallel
  reduction: one all-reduce per step, charged to each holding layer (`shared_sync_s`);
- with one stage the weight is held once, so the duplicate's model states are given back
  (`shared_duplicate_states`, added to the rank's capacity and taken off its memory breakdown).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.planner.space import Candidate
from cost_models.memory import ModelStateBytes

if TYPE_CHECKING:
    from autopar.planner.costs import CostModel

__all__ = ["shared_sync_s", "shared_duplicate_states"]


def shared_sync_s(costs: CostModel, ri: int, c: Candidate) -> float:
    """The cross-stage all-reduce of shared weights held by run `ri`'s layer, per step.

    With pp > 1 contiguous cuts put a tied embedding and head on different stages; a weight only
    top-level code reads is on every stage (charged to the first layer). Gradients are this rank's:
    divided by tp where the vocabulary is split, by dp under ZeRO-2/3."""
    graph = costs.graph
    if c.pp == 1 or not graph.shared_params:
        return 0.0
    layer = costs.runs[ri][0]
    first = graph.layers[0].name
    total = 0.0
    for sp in graph.shared_params:
        holders = len(sp.layers) if sp.layers else c.pp
        if holders < 2 or layer.name not in (sp.layers or (first,)):
            continue
        n = sp.num_params * costs.elem / (c.tp if costs.tp_param_fraction(layer) > 0 else 1)
        n /= c.dp if c.zero_stage >= 2 else 1
        k = min(holders, c.pp)
        total += costs.collective_s("all_reduce", n, k, k if c.tp * c.dp * c.pp <= costs.devices_per_node else 1)
    return total


def shared_duplicate_states(costs: CostModel, tp: int, zero_stage: int, dp: int) -> ModelStateBytes:
    """Model states of the extra copies the layers' sums count of weights several layers share."""
    n = 0.0
    for sp in costs.graph.shared_params:
        if len(sp.layers) > 1:
            split = costs.tp_param_fraction(costs.graph.layer(sp.layers[0])) > 0
            n += (len(sp.layers) - 1) * sp.num_params / (tp if split else 1)
    return costs.model_states(n, zero_stage, dp)
