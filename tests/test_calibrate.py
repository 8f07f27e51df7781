"""Calibration: scaling a profile scales predictions exactly; the fitted factors are the ratio of sums;
runs from another machine or priced on another profile are refused."""

from __future__ import annotations

import dataclasses
import json

import pytest

import autopar
from autopar.calibrate import calibrate, fit_calibration
from autopar.cluster import Cluster, cpu_slowdown
from autopar.config import ParallelConfig
from autopar.errors import ProfileMismatchError
from autopar.plan import BREAKDOWN_KEYS
from autopar.record import RankTiming, build_record
from cost_models.profile import CollectiveSample, ElementwiseSample, GemmSample, Profile, scale_profile
from cost_models.profiler import machine_info


def _profile() -> Profile:

    import torch

    gemm = tuple(GemmSample(m=n, n=n, k=n, dtype=dt, time_s=2.0 * n**3 / 5e10, layout="nn")
                 for n in (64, 256, 1024) for dt in ("float32", "bfloat16"))
    elem = tuple(ElementwiseSample(op=op, dtype=dt, n_bytes=b, time_s=2e-6 + b / 1e10)
                 for op in ("add", "sum") for dt in ("float32", "bfloat16") for b in (2**12, 2**20, 2**26))
    colls = tuple(CollectiveSample(op=op, group_size=k, n_bytes=b, time_s=5e-5 * k + b / 1e9)
                  for op in ("all_reduce", "all_gather", "reduce_scatter") for k in (2, 4)
                  for b in (2**10, 2**20, 2**25))
    colls += tuple(CollectiveSample(op="p2p", group_size=2, n_bytes=b, time_s=2e-5 + b / 2e9) for b in (2**10, 2**24))
    return Profile(machine=machine_info(),  # this machine: the profile describes it
                   device_name="cpu", device_kind="cpu", device_count=4, torch_version=torch.__version__,
                   created="2026-01-01T00:00:00+00:00", backend="gloo", threads_per_process=2,
                   launch_overhead_s=5e-6, gemm=gemm, elementwise=elem, collectives=colls)


@pytest.fixture(scope="module")
def graph():
    import torch

    model, x = autopar.zoo.build("gpt-tiny", seq_len=64, device="meta", dtype=torch.float32, dropout=0.0)
    return autopar.capture(model, x)


def test_cpu_slowdown_is_cores_per_process():
    # profiled with 2 threads on 2 cores; torchrun runs 1 thread per process
    assert cpu_slowdown(nproc=1, cpu_count=2, profiled_threads=2, run_threads=2) == 1.0
    assert cpu_slowdown(nproc=2, cpu_count=2, profiled_threads=2, run_threads=1) == 2.0
    assert cpu_slowdown(nproc=8, cpu_count=2, profiled_threads=2, run_threads=1) == 8.0
    assert cpu_slowdown(nproc=4, cpu_count=16, profiled_threads=16, run_threads=4) == 4.0


def test_scaled_profile_scales_every_prediction(graph):
    prof = _profile()
    cfg = ParallelConfig(tp=2, dp=2, micro_batch_size=2, num_microbatches=1)
    base = autopar.estimate(graph, Cluster.local(nproc=4, profile=prof), cfg, global_batch_size=4)
    k_c, k_2 = 1.7, 0.6
    scaled = scale_profile(prof, compute=k_c, comm={2: k_2})
    est = autopar.estimate(graph, Cluster.local(nproc=4, profile=scaled), cfg, global_batch_size=4)
    b0, b1 = base.breakdown, est.breakdown
    # kernels scale by k_c; the DTensor host overhead (priced from the host floor) does not
    assert base.host_s > 0 and est.host_s == pytest.approx(base.host_s, rel=1e-12)
    kernels = b0["compute"] + b0["optimizer"] - base.host_s
    assert b1["compute"] + b1["optimizer"] == pytest.approx(k_c * kernels + base.host_s, rel=1e-9)
    hosted = autopar.estimate(graph, Cluster.local(nproc=4, profile=scale_profile(prof, host=3.0)), cfg,
                              global_batch_size=4)
    assert hosted.host_s == pytest.approx(3.0 * base.host_s, rel=1e-9)
    assert hosted.breakdown["compute"] + hosted.breakdown["optimizer"] == pytest.approx(kernels + 3 * base.host_s,
                                                                                         rel=1e-9)
    assert b0["tp_comm"] > 0 and b1["tp_comm"] == pytest.approx(k_2 * b0["tp_comm"], rel=1e-9)
    # nothing but times changed
    assert [(g.m, g.n, g.k) for g in scaled.gemm] == [(g.m, g.n, g.k) for g in prof.gemm]
    assert [c.time_s for c in scaled.collectives if c.group_size == 4] == \
        [c.time_s for c in prof.collectives if c.group_size == 4]


def _record(plan, measured: dict[str, float], hostname: str | None = None):
    import socket

    import torch

    ranks = [RankTiming(rank=r, pp_rank=0, dp_rank=r % plan.config.dp, tp_rank=0,
                        step_s=(sum(measured.values()),) * 3,
                        components_s={k: (measured.get(k, 0.0),) * 3 for k in BREAKDOWN_KEYS})
             for r in range(plan.world_size)]
    return build_record(plan, ranks, hostname=hostname or socket.gethostname(), device_name="cpu",
                        torch_version=torch.__version__, backend="gloo", threads_per_process=1,
                        created="2026-01-01T00:00:00+00:00", warmup_steps=1)


def test_fit_is_ratio_of_sums_and_refits_to_the_measurement(graph):
    prof = _profile()
    plans = [autopar.plan(graph, Cluster.local(nproc=2, profile=prof), global_batch_size=4,
                          options=autopar.PlannerOptions(tp=tp, dp=dp, zero_stage=0, sequence_parallel=False, top_k=0))
             for tp, dp in ((2, 1), (1, 2))]
    measured = [{"compute": c, "optimizer": 0.01, "tp_comm": t, "dp_comm": 0.0} for c, t in ((0.30, 0.02), (0.20, 0.0))]
    records = [_record(p, m) for p, m in zip(plans, measured, strict=True)]
    cal = fit_calibration(records)
    # the dp run (no host overhead) sets the kernel factor; the tp run's remainder sets the host factor
    tp_plan, dp_plan = plans
    assert dp_plan.estimate.host_s == 0 and tp_plan.estimate.host_s > 0
    pred = {id(p): sum(p.estimate.breakdown[k] for k in ("compute", "recompute", "optimizer")) for p in plans}
    a = (0.20 + 0.01) / pred[id(dp_plan)]
    assert cal.compute_factor == pytest.approx(a)
    kernels = pred[id(tp_plan)] - tp_plan.estimate.host_s
    h = max(0.30 + 0.01 - a * kernels, 0.1 * tp_plan.estimate.host_s) / tp_plan.estimate.host_s
    assert cal.host_factor == pytest.approx(h)
    # Both runs talk over groups of 2 (tp=2, then dp=2): one factor, the ratio of their summed comm times.
    comm_pred = plans[0].estimate.breakdown["tp_comm"] + plans[1].estimate.breakdown["dp_comm"]
    assert cal.comm_factors == {2: pytest.approx((0.02 + 0.0) / comm_pred)}
    new_prof, _ = calibrate(records, prof)
    est = autopar.estimate(graph, Cluster.local(nproc=2, profile=new_prof), plans[0].config, global_batch_size=4)
    assert est.breakdown["tp_comm"] == pytest.approx(cal.comm_factors[2] * plans[0].estimate.breakdown["tp_comm"],
                                                     rel=1e-6)
    total = est.breakdown["compute"] + est.breakdown["optimizer"]
    assert total == pytest.approx(a * kernels + h * tp_plan.estimate.host_s, rel=1e-6)


def test_refuses_runs_of_another_machine_or_profile(graph):
    prof = _profile()
    plan = autopar.plan(graph, Cluster.local(nproc=2, profile=prof), global_batch_size=4,
                        options=autopar.PlannerOptions(dp=2, zero_stage=0, top_k=0))
    with pytest.raises(ProfileMismatchError, match="machine 'elsewhere'"):
        calibrate([_record(plan, {"compute": 0.1}, hostname="elsewhere")], prof)
    other = dataclasses.replace(prof, launch_overhead_s=9e-6)
    with pytest.raises(ProfileMismatchError, match="made with another profile"):
        calibrate([_record(plan, {"compute": 0.1})], other)


def test_from_three_runs_one_disturbed_run_does_not_set_the_factor(graph):
    prof = _profile()
    plan = autopar.plan(graph, Cluster.local(nproc=2, profile=prof), global_batch_size=4,
                        options=autopar.PlannerOptions(dp=2, zero_stage=0, top_k=0))
    pred = sum(plan.estimate.breakdown[k] for k in ("compute", "recompute", "optimizer"))
    # three runs measured 2×, 2.2× and (disturbed by other work) 9× the predicted compute
    records = [_record(plan, {"compute": f * pred - 0.01, "optimizer": 0.01}) for f in (2.0, 2.2, 9.0)]
    assert fit_calibration(records).compute_factor == pytest.approx(2.2)
    assert fit_calibration(records[:2]).compute_factor == pytest.approx(2.1)  # two runs: ratio of the sums


def test_kernels_and_host_overhead_are_fitted_apart(graph):
    """A data-parallel run (no host overhead) measured 2.4× its predicted kernels; a tensor-parallel run
    measured 2.4× its kernels plus 1.3× its predicted DTensor host overhead. The fit recovers both
    factors, and the calibrated profile predicts each run's measured compute."""
    prof = _profile()
    opts = {"zero_stage": 0, "sequence_parallel": False, "top_k": 0}
    plans = [autopar.plan(graph, Cluster.local(nproc=2, profile=prof), global_batch_size=4,
                          options=autopar.PlannerOptions(tp=tp, dp=2 // tp, **opts)) for tp in (1, 2)]
    assert plans[0].estimate.host_s == 0.0 and plans[1].estimate.host_s > 0.1 * plans[1].estimate.breakdown["compute"]
    records, want = [], []
    for p in plans:
        pred = p.estimate.breakdown["compute"] + p.estimate.breakdown["optimizer"]
        want.append(2.4 * (pred - p.estimate.host_s) + 1.3 * p.estimate.host_s)
        records.append(_record(p, {"compute": want[-1] - 0.001, "optimizer": 0.001}))
    new_prof, cal = calibrate(records, prof)
    assert cal.compute_factor == pytest.approx(2.4, rel=1e-9) and cal.host_factor == pytest.approx(1.3, rel=1e-9)
    for p, w in zip(plans, want, strict=True):
        est = autopar.estimate(graph, Cluster.local(nproc=2, profile=new_prof), p.config, global_batch_size=4)
        assert est.breakdown["compute"] + est.breakdown["optimizer"] == pytest.approx(w, rel=1e-6)
        assert est.host_s == pytest.approx(1.3 * p.estimate.host_s, rel=1e-9)
    assert Profile.from_dict(json.loads(new_prof.to_json())).host_floor_s == new_prof.host_floor_s


def test_one_kind_of_run_gives_one_factor(graph):
    prof = _profile()
    plan = autopar.plan(graph, Cluster.local(nproc=2, profile=prof), global_batch_size=4,
                        options=autopar.PlannerOptions(tp=2, dp=1, sequence_parallel=False, top_k=0))
    pred = plan.estimate.breakdown["compute"] + plan.estimate.breakdown["optimizer"]
    cal = fit_calibration([_record(plan, {"compute": 2.0 * pred})])
    assert cal.compute_factor == cal.host_factor == pytest.approx(2.0)


def test_fsdp_host_overheads_are_in_compute_and_host_s(graph):
    """On CPU, ZeRO-3's estimate carries the FSDP2 hooks in compute (one per layer with parameters and
    micro-batch) and its DTensor optimizer in the optimizer step, and reports both in host_s."""
    from autopar.planner.dp_costs import DTENSOR_OPTIMIZER_FLOORS, FSDP_HOOKS_FLOORS

    cluster = Cluster.local(nproc=2, profile=_profile())
    units = sum(1 for la in graph.layers if la.num_params > 0)
    floor = cluster.profile.host_overhead_floor_s
    m = 2
    est = {z: autopar.estimate(graph, cluster, ParallelConfig(dp=2, zero_stage=z, micro_batch_size=1,
                                                               num_microbatches=m), global_batch_size=2 * m)
           for z in (0, 3)}
    assert est[0].host_s == 0.0
    assert est[3].host_s == pytest.approx(units * floor * (m * FSDP_HOOKS_FLOORS[3] + DTENSOR_OPTIMIZER_FLOORS))
    assert est[3].breakdown["compute"] - est[0].breakdown["compute"] == \
        pytest.approx(units * floor * m * FSDP_HOOKS_FLOORS[3])


def test_pipeline_sends_are_calibrated_on_pp_comm(graph):
    """A pipelined run whose sends took 10× the profiled point-to-point time: the p2p table is scaled by
    10, so the calibrated plan predicts 10× the pp_comm, and collectives are untouched."""
    prof = _profile()
    plan = autopar.plan(graph, Cluster.local(nproc=2, profile=prof), global_batch_size=4,
                        options=autopar.PlannerOptions(pp=2, dp=1, tp=1, schedule="1f1b", num_microbatches=2,
                                                       top_k=0))
    pred = plan.estimate.breakdown
    assert pred["pp_comm"] > 0
    rec = _record(plan, {"compute": pred["compute"], "optimizer": pred["optimizer"], "pp_comm": 10 * pred["pp_comm"]})
    new_prof, cal = calibrate([rec], prof)
    assert cal.p2p_factor == pytest.approx(10.0)
    est = autopar.estimate(graph, Cluster.local(nproc=2, profile=new_prof), plan.config, global_batch_size=4,
                           stages=plan.stages)
    assert est.breakdown["pp_comm"] == pytest.approx(10 * pred["pp_comm"], rel=1e-6)
    assert [c.time_s for c in new_prof.collectives if c.op != "p2p"] == \
        [c.time_s for c in prof.collectives if c.op != "p2p"]
