"""The search's level −1 floor (`search._floor_s`, from `CostModel.floor`) never exceeds a candidate's cheap
bound (`bound.lower_bound`, itself checked below the optimum by tests/test_planner_bound.py), and where
`CostModel.over_memory` says a layout cannot fit, that bound is +inf: on every layout of small dense and
MoE models, with FP8, offload, context parallelism and ep/etp in the space. And the search returns the
same plans with the floors as without them (every candidate priced first)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.cluster import Cluster
from autopar.config import PlannerOptions
from autopar.planner.bound import lower_bound
from autopar.planner.costs import CostModel
from autopar.planner.problem import MODES
from autopar.planner.search import _floor_s, _fp8_choices, _offload_choices, search
from autopar.planner.space import enumerate_candidates

sys.path.insert(0, str(Path(__file__).parent))
from hf_families import build_family  # noqa: E402
from test_planner import fake_cluster, gpt_graph  # noqa: E402


@pytest.fixture(scope="module")
def moe():
    model = build_family("mixtral")
    return autopar.capture(model.to(torch.bfloat16), (torch.zeros(1, 16, dtype=torch.long),))


def _cases(moe):
    h100 = Cluster.preset("dgx-h100", nodes=1)
    return [
        (moe, h100, 8, PlannerOptions(fp8=None)),  # ep, etp, fp8 and offload in the space
        (moe, fake_cluster(nodes=2, per_node=4, inter_GBps=2.5), 8, PlannerOptions(offload="none")),
        (gpt_graph(layers=4, hidden=512, heads=8, seq=16384, vocab=8192), h100, 8, PlannerOptions()),  # cp
        (gpt_graph(layers=6, hidden=1024, heads=16, seq=1024), fake_cluster(nodes=2, memory_gib=2), 32,
         PlannerOptions(objective="pessimistic")),
    ]


def test_floor_is_below_the_cheap_bound_of_every_layout(moe) -> None:
    overs = []
    for graph, cluster, batch, opts in _cases(moe):
        costs = CostModel.for_cluster(graph, cluster)
        cands = enumerate_candidates(graph, world_size=costs.world_size, devices_per_node=costs.devices_per_node,
                                     global_batch_size=batch, options=opts, fp8s=_fp8_choices(costs, opts),
                                     offloads=_offload_choices(costs, opts), precision=costs.precision.name)
        ratios, over = [], 0
        for c in cands:
            floor, lb = _floor_s(costs, c), lower_bound(costs.problem(c))
            assert 0.0 < floor <= lb, c
            if lb < float("inf"):
                ratios.append(floor / lb)
            for modes in (MODES, ("none",)):
                if costs.over_memory(c, modes):
                    over += 1
                    assert lower_bound(costs.problem(c, modes)) == float("inf"), c
        assert len(cands) > 100 and sorted(ratios)[len(ratios) // 2] > 0.3  # and the floor is not vacuous
        overs.append(over)
    assert max(overs) > 100  # nor the memory check


def test_search_with_floors_returns_the_same_plans(moe) -> None:
    for graph, cluster, batch, opts in _cases(moe):
        costs = CostModel.for_cluster(graph, cluster)
        a = search(costs, global_batch_size=batch, options=opts)
        b = search(costs, global_batch_size=batch, options=opts, floors=False)
        assert a.best.config == b.best.config and a.best.objective_s == b.best.objective_s
        assert [s.config for s in a.alternatives] == [s.config for s in b.alternatives]
        assert [s.objective_s for s in a.alternatives] == [s.objective_s for s in b.alternatives]
