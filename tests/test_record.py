"""RunRecord: JSON round trip, the breakdown it reports, and refusal of another plan or machine."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

import autopar
from autopar.cluster import Cluster
from autopar.config import PlannerOptions
from autopar.errors import PlanMismatchError, ProfileMismatchError
from autopar.plan import BREAKDOWN_KEYS
from autopar.record import RankTiming, RunRecord, build_record, plan_fingerprint


@pytest.fixture(scope="module")
def graph():
    import torch

    model, x = autopar.zoo.build("gpt-tiny", seq_len=64, device="meta", dtype=torch.float32, dropout=0.0)
    return autopar.capture(model, x)


@pytest.fixture(scope="module")
def plans(graph):
    cluster = Cluster.local(nproc=2)
    dp = autopar.plan(graph, cluster, global_batch_size=4, options=PlannerOptions(dp=2, zero_stage=0, top_k=0))
    pp = autopar.plan(graph, cluster, global_batch_size=4,
                      options=PlannerOptions(pp=2, schedule="1f1b", num_microbatches=2, top_k=0))
    return dp, pp


def timing(rank: int, pp_rank: int, steps: list[dict[str, float]]) -> RankTiming:
    """A rank whose step time is the sum of its components (bubble included)."""
    comps = {k: tuple(s.get(k, 0.0) for s in steps) for k in BREAKDOWN_KEYS}
    return RankTiming(rank=rank, pp_rank=pp_rank, dp_rank=0, tp_rank=0,
                      step_s=tuple(sum(s.values()) for s in steps), components_s=comps)


def record_of(plan, ranks, **kw) -> RunRecord:
    fields = dict(hostname="host-a", device_name="cpu", torch_version="2.13.0", backend="gloo",
                  threads_per_process=1, created="2026-01-01T00:00:00+00:00", warmup_steps=2)
    fields.update(kw)
    return build_record(plan, ranks, **fields)


def test_round_trip(plans, tmp_path):
    _, pp = plans
    steps0 = [{"compute": 0.10, "pipeline_bubble": 0.05, "optimizer": 0.01}, {"compute": 0.12, "optimizer": 0.01,
                                                                             "pipeline_bubble": 0.04}]
    steps1 = [{"compute": 0.14, "pp_comm": 0.002, "optimizer": 0.01}, {"compute": 0.15, "optimizer": 0.01}]
    rec = record_of(pp, [timing(1, 1, steps1), timing(0, 0, steps0)], model_spec="gpt-tiny seq_len=64")
    path = tmp_path / "run.json"
    rec.save(path)
    back = RunRecord.load(path)
    assert back == rec
    assert back.plan_fingerprint == plan_fingerprint(pp)
    assert [r.rank for r in back.ranks] == [0, 1]


def test_breakdown_is_the_bottleneck_rank_and_sums_to_the_median_step(plans):
    _, pp = plans
    # rank 1 is busier (compute 0.30 vs 0.20); step times per step are max over ranks.
    r0 = timing(0, 0, [{"compute": 0.20, "optimizer": 0.01, "pipeline_bubble": 0.12},
                       {"compute": 0.20, "optimizer": 0.01, "pipeline_bubble": 0.10},
                       {"compute": 0.20, "optimizer": 0.01, "pipeline_bubble": 0.14}])
    r1 = timing(1, 1, [{"compute": 0.30, "optimizer": 0.02, "pp_comm": 0.001},
                       {"compute": 0.28, "optimizer": 0.02, "pp_comm": 0.001},
                       {"compute": 0.32, "optimizer": 0.02, "pp_comm": 0.001}])
    rec = record_of(pp, [r0, r1])
    per_step = [max(a, b) for a, b in zip(r0.step_s, r1.step_s, strict=True)]
    assert rec.measured_step_time_s == pytest.approx(statistics.median(per_step))
    assert rec.bottleneck.rank == 1
    b = rec.breakdown()
    assert b["compute"] == pytest.approx(0.30)
    assert b["optimizer"] == pytest.approx(0.02)
    assert sum(b.values()) == pytest.approx(rec.measured_step_time_s)
    stages = rec.stage_breakdowns()
    assert stages[0]["compute"] == pytest.approx(0.20) and stages[1]["compute"] == pytest.approx(0.30)


def test_refuses_another_plan(plans):
    dp, pp = plans
    rec = record_of(dp, [timing(0, 0, [{"compute": 0.1}]), timing(1, 0, [{"compute": 0.1}])])
    rec.check_plan(dp)
    with pytest.raises(PlanMismatchError, match="pass the plan.json the run was launched with"):
        rec.check_plan(pp)


def test_refuses_another_machine(plans):
    dp, _ = plans
    rec = record_of(dp, [timing(0, 0, [{"compute": 0.1}]), timing(1, 0, [{"compute": 0.1}])])
    rec.check_machine(hostname="host-a", device_name="cpu", torch_version="2.13.0")
    with pytest.raises(ProfileMismatchError, match="machine 'host-a' \\(here: 'host-b'\\)"):
        rec.check_machine(hostname="host-b", device_name="cpu", torch_version="2.13.0")


def test_invalid_records_are_refused(plans, tmp_path):
    dp, _ = plans
    with pytest.raises(ValueError, match="has 1 ranks"):
        record_of(dp, [timing(0, 0, [{"compute": 0.1}])])
    rec = record_of(dp, [timing(0, 0, [{"compute": 0.1}]), timing(1, 0, [{"compute": 0.1}])])
    bad = tmp_path / "bad.json"
    bad.write_text(__import__("json").dumps({**rec.to_dict(), "schema_version": 99}))
    with pytest.raises(ProfileMismatchError, match="schema version 99"):
        RunRecord.load(bad)
    with pytest.raises(ValueError, match="no measured steps"):
        dataclasses.replace(rec.ranks[0], step_s=(), components_s={k: () for k in BREAKDOWN_KEYS})


def test_waiting_in_data_parallel_collectives_does_not_make_a_rank_the_bottleneck(plans):
    _, pp = plans
    # rank 0 finishes its stage early and waits 0.2 s in the loss all-reduce (dp_comm); rank 1 works longer.
    r0 = timing(0, 0, [{"compute": 0.20, "dp_comm": 0.20}] * 3)
    r1 = timing(1, 1, [{"compute": 0.30, "dp_comm": 0.01, "pp_comm": 0.01}] * 3)
    rec = record_of(pp, [r0, r1])
    assert r0.median_busy_s > r1.median_busy_s and rec.bottleneck.rank == 1
    assert rec.breakdown()["compute"] == pytest.approx(0.30)


def test_step_sample_components_and_call_counts():
    from autopar.codegen.timing import AXES, PHASES, StepSample

    s = StepSample(step_s=1.0)
    s.phase_s.update(forward_backward=0.6, grad_sync=0.1, optimizer=0.15, loss=0.05)
    s.waits_s["forward_backward"].update(tp=0.1, pp_send=0.02, pp_recv=0.08)
    s.waits_s["optimizer"].update(dp=0.03)
    c = s.components()
    assert c["compute"] == pytest.approx(0.6 - 0.2)
    assert c["tp_comm"] == pytest.approx(0.1) and c["pp_comm"] == pytest.approx(0.02)
    # gradient sync, the loss all-reduce and the ZeRO-1 broadcasts inside the optimizer are data-parallel
    assert c["dp_comm"] == pytest.approx(0.1 + 0.05 + 0.03)
    assert c["optimizer"] == pytest.approx(0.15 - 0.03)
    assert sum(c.values()) == pytest.approx(1.0)
    assert set(s.calls) == set(AXES) and set(s.waits_s) == set(PHASES)


def test_calls_per_step_round_trip(plans, tmp_path):
    dp, _ = plans
    ranks = [dataclasses.replace(timing(r, 0, [{"compute": 0.1}]), calls_per_step={"dp": 3.0, "other": 1.0})
             for r in (0, 1)]
    rec = record_of(dp, ranks)
    rec.save(tmp_path / "run.json")
    assert RunRecord.load(tmp_path / "run.json").ranks[1].calls_per_step == {"dp": 3.0, "other": 1.0}
