"""The interleaved 1F1B order with a tunable group N (cost_models.pipeline_order) against independent references:
torch's own ScheduleInterleaved1F1B order at torch's N, torch's own schedule validation and send/recv lowering
(which rejects an order that would hang), Narayanan et al.'s (m·v + p − 1) chunk slots, and the planner's
objective priced on it (autopar.planner.problem.evaluate) against the replay of the same order."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _add_send_recv, _validate_schedule

import autopar
from autopar import Cluster, ParallelConfig, PlannerOptions
from autopar.codegen.grouped_schedule import torch_actions
from autopar.errors import ConfigError
from autopar.planner.problem import InnerProblem, Run, evaluate
from cost_models import memory
from cost_models.pipeline_order import (
    Action,
    bottleneck_slots,
    group_peaks,
    interleaved_order,
    replay,
    torch_group,
    uniform_slots,
)

CASES = [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 6), (3, 2, 7)]


def _torch_order(p: int, v: int, m: int, rank: int) -> list:
    """ScheduleInterleaved1F1B's own order for `rank`, built without process groups, Nones dropped."""
    sched = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    return [a for a in sched._calculate_single_rank_operations(rank) if a is not None]


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 4)])
def test_torch_group_gives_torch_order(p, v, m):
    ours = torch_actions(interleaved_order(p, v, m, torch_group(p, m)))
    for r in range(p):
        assert ours[r] == _torch_order(p, v, m, r)


@pytest.mark.parametrize("p,v,m", CASES)
def test_every_group_runs_and_torch_lowers_it(p, v, m):
    S = p * v
    for n in range(1, m + 1):
        order = interleaved_order(p, v, m, n)
        res = replay(order, (1.0,) * S, (2.0,) * S, send_s=0.1)  # raises on a deadlock or a missing action
        for r, acts in enumerate(order):
            assert sorted((a.kind, a.stage, a.microbatch) for a in acts) == sorted(
                (k, j * p + r, x) for k in "FB" for j in range(v) for x in range(m))
        assert res.peak_inflight == group_peaks(p, v, m, n)
        actions = torch_actions(order)
        assert _validate_schedule(actions, p, S, m) == {s: s % p for s in range(S)}
        _add_send_recv({r: list(a) for r, a in actions.items()}, stage_to_rank=lambda s: s % p, num_stages=S)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 12), (8, 2, 16)])
def test_group_of_p_takes_narayanan_slots_and_smaller_groups_trade_time_for_memory(p, v, m):
    # alike chunks, forward 1 and backward 2: m·v + p − 1 chunk slots of 3 (Narayanan et al. 2021, §2.2)
    S = p * v
    assert replay(interleaved_order(p, v, m, p), (1.0,) * S, (2.0,) * S).makespan_s == pytest.approx(
        3 * (m * v + p - 1))
    assert uniform_slots(p, v, m, p) == pytest.approx(m - 1 / v) == bottleneck_slots(p, v, m, None)
    for n in range(1, p):
        assert uniform_slots(p, v, m, n) > m - 1 / v
        assert max(group_peaks(p, v, m, n)) < max(group_peaks(p, v, m, p))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8)])
def test_memory_at_torch_group_is_the_warmup_formula(p, v, m):
    for q in range(p):
        assert memory.inflight_microbatches("interleaved_1f1b", p, m, q, v, microbatch_group=torch_group(p, m)) \
            == pytest.approx(memory.inflight_microbatches("interleaved_1f1b", p, m, q, v))


def _problem(p: int, v: int, m: int, n: int | None, layer_s: float) -> InnerProblem:
    run = Run(name="block", count=p * v, layer_names=tuple(f"l{i}" for i in range(p * v)),
              time_s=(layer_s,) * 4, compute_s=(layer_s,) * 4, recompute_s=(0.0,) * 4, tp_comm_s=(0.0,) * 4,
              act_bytes=(1.0,) * 4, state_bytes=1.0, backward_s=0.0, grad_sync_s=0.0, optimizer_s=0.0,
              send_s=(0.0, 0.0))
    return InnerProblem(runs=(run,), num_ranks=p, virtual_stages=v, num_microbatches=m,
                        inflight=(1.0,) * p, capacity_bytes=(1e18,) * p, inter_node=(False,) * (p * v - 1),
                        slots=None if n is None else bottleneck_slots(p, v, m, n))


@pytest.mark.parametrize("p,v,m,n", [(4, 2, 8, 2), (4, 2, 8, 3), (4, 3, 12, 5), (4, 2, 8, None)])
def test_planner_objective_is_the_replayed_makespan(p, v, m, n):
    layer_s = 0.3  # one layer per chunk: forward 0.1, backward 0.2
    sol = evaluate(_problem(p, v, m, n, layer_s), (1,) * (p * v), ("none",) * (p * v))
    S = p * v
    ref = replay(interleaved_order(p, v, m, n or p), (layer_s / 3,) * S, (2 * layer_s / 3,) * S).makespan_s
    assert sol.pipeline_s == pytest.approx(ref)


def test_config_checks_the_group():
    base = dict(pp=2, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=2)
    assert ParallelConfig(**base, microbatch_group=3).microbatch_group == 3
    assert "microbatch_group=3" in str(ParallelConfig(**base, microbatch_group=3))
    assert ParallelConfig.parse(str(ParallelConfig(**base, microbatch_group=3))).microbatch_group == 3
    for bad in (0, 5, 2.5, True):
        with pytest.raises(ConfigError, match="microbatch_group"):
            ParallelConfig(**base, microbatch_group=bad)
    with pytest.raises(ConfigError, match="needs schedule='interleaved_1f1b'"):
        ParallelConfig(pp=2, num_microbatches=4, schedule="1f1b", microbatch_group=2)
    with pytest.raises(ValueError, match="exceeds num_microbatches"):
        interleaved_order(2, 2, 4, 5)
    with pytest.raises(ValueError, match="deadlocks"):
        replay(((Action("B", 0, 0), Action("F", 0, 0)),), (1.0,), (1.0,))


@pytest.mark.multiproc
def test_parity_of_grouped_interleaving_on_two_ranks():
    """pp2 × v2 with N = 3 (a group that does not divide m = 4) and N = 1, not torch's N = 2, run by
    ScheduleGroupedInterleaved1F1B: 3 AdamW steps against one process (tests/test_parity.py's definition)."""
    from dist_harness import run_distributed
    from parity_models import ATOL, RTOL, parity_cases

    cases = [("gpt", dict(pp=2, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=2,
                          microbatch_group=n)) for n in (3, 1)]
    per_rank = run_distributed(parity_cases, 2, cases, 3)
    for r in per_rank[0]:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=RTOL, abs=ATOL), r["case"]
        assert r["weight_excess"] <= ATOL and r["grad_excess"] <= ATOL, r
        assert not r["missing"] and not r["extra"], r
    assert [r["losses"] for r in per_rank[1]] == [r["losses"] for r in per_rank[0]]


def test_planner_takes_the_fastest_group_that_fits_where_torchs_does_not():
    """Llama 3 405B as Meta ran it on 8,192 H100 (Dubey et al. 2024 Table 4: TP8·PP16·DP64, interleaved v = 8,
    32 micro-batches, no recompute), priced on Megatron-LM's pipeline memory: torch's N = 16 holds too much;
    the planner's N is, among all N that fit, the one of least step time (checked against each N's estimate)."""
    net, x = autopar.zoo.build("llama3-405b", seq_len=8192)
    graph = autopar.capture(net, x)
    cluster = Cluster.preset("dgx-h100", nodes=1024)
    layout = dict(tp=8, pp=16, dp=64, zero_stage=2, micro_batch_size=1, num_microbatches=32,
                  schedule="interleaved_1f1b", virtual_stages=8, recompute="none", sequence_parallel=True)
    opts = PlannerOptions(**layout, top_k=0, max_virtual_stages=8, pipeline_runtime="megatron")
    torch_n = autopar.estimate(graph, cluster, ParallelConfig(**layout), options=opts)
    assert not torch_n.fits
    plan = autopar.plan(graph, cluster, global_batch_size=2048, options=opts)
    n = plan.config.microbatch_group
    assert n is not None and n < 16 and plan.estimate.fits
    assert plan.estimate.step_time_s > torch_n.step_time_s  # a smaller group stalls
    each = {k: autopar.estimate(graph, cluster, ParallelConfig(**layout, microbatch_group=k), options=opts)
            for k in range(8, 16)}
    fits = {k: e.step_time_s for k, e in each.items() if e.fits}
    assert min(fits, key=fits.get) == n and fits[n] == pytest.approx(plan.estimate.step_time_s, rel=1e-9)
