"""The whole planner against brute force: on small random graphs and fake clusters, every layout (tp, pp,
dp, ZeRO stage, micro-batch size and count, schedule, virtual stages, sequence parallelism), every cut
vector and every per-layer recompute assignment is priced with the same cost functions, and
`autopar.plan` must return the minimum step time. The enumeration below is written from docs/design.md §5,
independently of `autopar.planner.space`; the objective is test_ilp's independent re-statement."""

from __future__ import annotations

import dataclasses
import random

import pytest
from test_ilp import brute_force
from test_planner import fake_cluster, gpt_graph

import autopar
from autopar.capture.graph import ModelGraph
from autopar.config import PlannerOptions
from autopar.planner.costs import CostModel
from autopar.planner.space import Candidate

GiB = 1 << 30


def random_graph(rng: random.Random) -> ModelGraph:
    """A small GPT whose embedding, blocks and head get random FLOPs, bytes and activations (identical
    blocks stay identical); sometimes a second kind of block follows the first."""
    n = rng.randint(2, 4)
    g = gpt_graph(layers=n, hidden=rng.choice([512, 1024, 2048]), heads=8, seq=rng.choice([256, 512, 1024]),
                  vocab=rng.choice([8192, 32768]))
    scale: dict[str, tuple[float, float, float]] = {}

    def perturb(layer):
        sig = layer.signature
        if sig not in scale:
            scale[sig] = (rng.uniform(0.3, 3.0), rng.uniform(0.3, 3.0), rng.uniform(0.3, 3.0))
        f, pm, act = scale[sig]
        return dataclasses.replace(
            layer, forward_flops=layer.forward_flops * f, backward_flops=layer.backward_flops * f,
            forward_flops_tp_sharded=layer.forward_flops_tp_sharded * f, num_params=int(layer.num_params * pm),
            param_bytes=int(layer.param_bytes * pm), saved_activation_bytes=int(layer.saved_activation_bytes * act),
            saved_activation_bytes_tp_sharded=int(layer.saved_activation_bytes_tp_sharded * act),
            saved_activation_bytes_attention_core=int(layer.saved_activation_bytes_attention_core * act))

    layers = [perturb(la) for la in g.layers]
    if n >= 3 and rng.random() < 0.5:  # the last block becomes a different, heavier kind
        last = layers[-2]
        layers[-2] = dataclasses.replace(last, signature="wide", forward_flops=last.forward_flops * 2.5,
                                         backward_flops=last.backward_flops * 2.5,
                                         forward_flops_tp_sharded=last.forward_flops_tp_sharded * 2.5)
    params = sum(la.num_params for la in layers)
    return dataclasses.replace(g, layers=tuple(layers), num_params=params, model_name=f"random-{n}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def every_layout(graph: ModelGraph, world: int, per_node: int, batch: int, max_v: int):
    """docs/design.md §5: tp inside a node dividing every TP pattern, tp·pp·dp = world, pp ≤ layers,
    dp·mbs·m = batch, ZeRO 0–3, GPipe / 1F1B / interleaved with v ≥ 2 chunks (m divisible by pp),
    sequence parallelism with tp > 1."""
    L = graph.num_layers
    pats = [p for la in graph.layers for p in la.tp_patterns]
    for tp in (t for t in _divisors(per_node) if all(p.max_degree_ok(t) for p in pats)):
        for pp in (p for p in _divisors(world // tp) if p <= L):
            dp = world // (tp * pp)
            if batch % dp:
                continue
            for mbs in _divisors(batch // dp):
                m = batch // (dp * mbs)
                scheds = [("gpipe", 1), ("1f1b", 1)]
                if pp > 1 and m % pp == 0:
                    scheds += [("interleaved_1f1b", v) for v in range(2, max_v + 1) if pp * v <= L]
                for zero in range(4):
                    for sched, v in scheds:
                        for sp in ([False, True] if tp > 1 else [False]):
                            yield Candidate(tp=tp, pp=pp, dp=dp, zero_stage=zero, micro_batch_size=mbs,
                                            num_microbatches=m, schedule=sched, virtual_stages=v,
                                            sequence_parallel=sp)


def case(seed: int):
    rng = random.Random(seed)
    graph = random_graph(rng)
    nodes, per_node = rng.choice([(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (3, 1)])
    states_gib = graph.num_params * 16 / GiB
    memory_gib = states_gib * rng.uniform(0.35, 1.6) + rng.uniform(0.2, 1.0)
    cluster = fake_cluster(nodes=nodes, per_node=per_node, memory_gib=memory_gib,
                           inter_GBps=rng.choice([2.5, 25.0]), intra_GBps=rng.choice([50.0, 300.0]))
    batch = rng.choice([2, 4, 8]) if nodes * per_node <= 2 else rng.choice([4, 8])
    return graph, cluster, batch


def brute_minimum(graph: ModelGraph, cluster, batch: int) -> tuple[float | None, int]:
    costs = CostModel.for_cluster(graph, cluster)
    best, n = None, 0
    for cand in every_layout(graph, cluster.nodes * cluster.devices_per_node, cluster.devices_per_node, batch,
                             PlannerOptions().max_virtual_stages):
        n += 1
        val = brute_force(costs.problem(cand))
        if val is not None and (best is None or val < best):
            best = val
    return best, n


@pytest.mark.parametrize("seed", range(24))
def test_plan_is_the_brute_force_minimum(seed: int) -> None:
    graph, cluster, batch = case(seed)
    best, layouts = brute_minimum(graph, cluster, batch)
    assert layouts > 0
    if best is None:
        with pytest.raises(autopar.InfeasiblePlanError):
            autopar.plan(graph, cluster, global_batch_size=batch, options=PlannerOptions(top_k=0))
        return
    plan = autopar.plan(graph, cluster, global_batch_size=batch, options=PlannerOptions(top_k=2))
    assert plan.solver.status == "optimal" and plan.solver.gap == 0.0
    assert plan.estimate.step_time_s == pytest.approx(best, rel=1e-7)
    for _, alt in plan.alternatives:  # runner-ups are real layouts, no better than the optimum
        assert alt.step_time_s >= best * (1 - 1e-9)


@pytest.fixture(scope="module")
def plans():
    """(graph, cluster, plan) of every feasible case, planned once for the tests below."""
    out = []
    for seed in range(24):
        graph, cluster, batch = case(seed)
        try:
            out.append((graph, cluster, autopar.plan(graph, cluster, global_batch_size=batch,
                                                     options=PlannerOptions(top_k=0))))
        except autopar.InfeasiblePlanError:
            continue
    return out


def test_the_cases_include_uneven_cuts(plans) -> None:
    """The brute-force cases above are not all trivial: some optima cut unevenly. (Their memory rarely binds
    hard enough for recompute to pay; per-layer mixes are covered where it does: test_ilp, test_planner_bound.)"""
    uneven = sum(max(len(s.layers) for s in plan.stages) - min(len(s.layers) for s in plan.stages) > 1
                 for _, _, plan in plans)
    assert uneven >= 2


def test_estimate_of_a_plans_own_stages_reproduces_its_step_time(plans) -> None:
    """`estimate(..., stages=plan.stages)` prices the plan's cuts and per-stage recompute exactly, also when
    the plan mixes modes; without stages it re-optimises the cuts under one mode, which can only be slower."""
    checked = 0
    for graph, cluster, plan in plans:
        est = autopar.estimate(graph, cluster, plan.config, stages=plan.stages)
        assert est.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-12)
        assert est.peak_memory_bytes == plan.estimate.peak_memory_bytes
        assert est.breakdown == pytest.approx(plan.estimate.breakdown, rel=1e-12, abs=1e-15)
        if len({s.recompute for s in plan.stages}) > 1:
            checked += 1
            uniform = autopar.estimate(graph, cluster, plan.config)
            if not uniform.fits:  # priced, but over memory: not a layout the planner could choose
                continue
            assert uniform.step_time_s >= plan.estimate.step_time_s * (1 - 1e-12)
    assert checked >= 1


def test_estimate_rejects_stages_of_another_model() -> None:
    graph, cluster, batch = case(2)
    plan = autopar.plan(graph, cluster, global_batch_size=batch, options=PlannerOptions(top_k=0))
    other = gpt_graph(layers=7)
    with pytest.raises(autopar.AutoparError, match="in no stage"):
        autopar.estimate(other, cluster, plan.config, stages=plan.stages)
