"""The data-parallel tail: its formulas against sums written out by hand, and its collective count
against what the runtime really issues (counted by autopar.codegen.timing in a 2-process run)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_harness import free_port

import autopar
from autopar.cluster import Cluster
from autopar.config import PlannerOptions
from autopar.planner.costs import CostModel
from autopar.planner.dp_costs import BUCKET_BYTES, DPTail
from autopar.planner.space import Candidate
from autopar.record import RunRecord

ROOT = Path(__file__).resolve().parents[1]
ALPHA, BETA, MEM = 1e-4, 1e9, 1e10  # s per collective, bytes/s on the wire, bytes/s of memory traffic


def coll(op: str, n: float, k: int) -> float:
    """A synthetic ring: all-reduce 2(k−1)α + 2(k−1)/k·n/β, the others half of it (Thakur et al. 2005)."""
    ar = 2 * (k - 1) * ALPHA + 2 * (k - 1) / k * n / BETA
    return ar if op == "all_reduce" else ar / 2


def norm_s(world: int, local_grad: float) -> float:
    """The global gradient norm: a pass reading the local gradients and an 8-byte all-reduce over all ranks."""
    return (coll("all_reduce", 8, world) if world > 1 else 0.0) + local_grad / MEM


def tail(zero: int, *, dp: int = 4, world: int = 8, m: int = 3, grad: float = 64e6, pipelined: bool = False
         ) -> DPTail:
    return DPTail(zero_stage=zero, dp=dp, world=world, microbatches=m, rank_grad_bytes=grad, collective_s=coll,
                  memory_s=lambda n: n / MEM, pipelined=pipelined)


@pytest.mark.parametrize("g", [64e6, 256e6], ids=["one-bucket-per-owner", "three-buckets-per-owner"])
@pytest.mark.parametrize("zero", [0, 1])
def test_flat_reduction_is_buckets_of_all_reduces_plus_owner_broadcasts(zero, g):
    dp, world = 4, 8
    t = tail(zero, dp=dp, world=world, grad=g)
    buckets = math.ceil(g / BUCKET_BYTES)  # 3 (10) buckets of ≤ 25 MiB
    # the buckets' all-reduces, the loss all-reduce over all ranks, and the memory passes, by hand
    expected = (buckets * coll("all_reduce", g / buckets, dp) + coll("all_reduce", 4, world) + 6 * g / MEM
                + norm_s(world, g))
    count = buckets + 2
    if zero == 1:  # each owner's g/dp share in buckets of its own, one broadcast each (autopar.codegen.param_prefetch)
        broadcasts = dp * math.ceil(g / dp / BUCKET_BYTES)  # 4 (12), not 3·4 (10·4) of buckets across owners
        assert broadcasts <= buckets + dp
        expected += broadcasts * coll("broadcast", g / broadcasts, dp) + 2 * g / MEM
        count += broadcasts
    # ZeRO-0/1 price the rank's gradient as γ per byte plus γ0: exact here, the collectives are affine in n
    assert t.layer_s(g) + t.fixed_s == pytest.approx(expected, rel=1e-9)
    assert t.layer_s(g / 2) + t.layer_s(g / 2) == pytest.approx(t.layer_s(g), rel=1e-12)
    assert t.collectives_per_step(layers_with_params=5) == count


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp_gathers_every_micro_batch_and_reduce_scatters_every_one_or_once_in_a_pipeline(zero, pipelined):
    """Without a pipeline each micro-batch's backward reduce-scatters (the shards summed, as the runtime keeps
    FSDP's gradient sync on); a pipeline stage's FSDP reduce-scatters once, after the last micro-batch."""
    m, dp, p = 3, 4, 5e6
    t = tail(zero, m=m, dp=dp, pipelined=pipelined)
    gathers = m * (2 if zero == 3 else 1)
    scatters = 1 if pipelined else m
    expected = (gathers * coll("all_gather", p, dp) + scatters * coll("reduce_scatter", p, dp)
                + (gathers + scatters) * 2 * p / MEM)
    assert t.layer_s(p) == pytest.approx(expected, rel=1e-9)
    assert t.layer_s(0.0) == 0.0
    assert t.fixed_s == pytest.approx(coll("all_reduce", 4, 8) + norm_s(8, 64e6 / dp))
    assert t.collectives_per_step(layers_with_params=5) == 5 * (gathers + scatters) + 2


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp_passes_hide_each_micro_batchs_gathers_up_to_their_own_length(zero, pipelined):
    m, dp, p = 3, 4, 5e6
    t = tail(zero, m=m, dp=dp, pipelined=pipelined)
    ag, rs = coll("all_gather", p, dp), coll("reduce_scatter", p, dp)
    ag_b = ag if zero == 3 else 0.0
    scatters = 1 if pipelined else m
    # passes longer than their collectives hide all of them (the copy passes stay exposed)
    assert t.hidden_s(p, forward_s=1.0, backward_s=1.0) == pytest.approx(m * ag + m * ag_b + scatters * rs,
                                                                         rel=1e-12)
    # a forward shorter than its gather hides only its own length, in each of the m micro-batches
    short = ag / 2
    assert t.hidden_s(p, forward_s=short, backward_s=1.0) == pytest.approx(m * short + m * ag_b + scatters * rs,
                                                                           rel=1e-12)
    # a backward shorter than its gathers and reduce-scatter hides only its own length, in each backward
    # that runs a reduce-scatter, and the backward gather alone in the others
    b = (ag_b + rs) / 2
    assert t.hidden_s(p, forward_s=1.0, backward_s=b) == pytest.approx(
        m * ag + (m - scatters) * min(ag_b, b) + scatters * b, rel=1e-12)
    # never more than the layer's collectives, and nothing without FSDP
    assert t.hidden_s(p, forward_s=1.0, backward_s=1.0) < t.layer_s(p)
    assert tail(1).hidden_s(p, forward_s=1.0, backward_s=1.0) == 0.0


def test_one_rank_has_only_the_loss_and_norm_reductions_of_its_job():
    t = tail(0, dp=1, world=4)
    assert t.layer_s(1e6) == 0.0 and t.fixed_s == pytest.approx(coll("all_reduce", 4, 4) + norm_s(4, 64e6))
    assert tail(0, dp=1, world=1).fixed_s == pytest.approx(norm_s(1, 64e6))  # the norm's read, no collective


def test_gloo_collectives_slow_down_when_processes_outnumber_cores():
    """A g-rank collective measured with g busy processes runs max(1, N/C) / max(1, g/C) slower among N."""
    import dataclasses

    from test_calibrate import _profile

    prof = _profile()
    prof = dataclasses.replace(prof, machine=dataclasses.replace(prof.machine, cpu_count=2))
    model, x = autopar.zoo.build("gpt-tiny", seq_len=32, n_layers=2)
    graph = autopar.capture(model, x)
    costs = CostModel.for_cluster(graph, Cluster.local(nproc=8, profile=prof))
    assert costs.comm.cpu_cores == 2
    assert [costs.comm.sharing_factor(g) for g in (2, 4, 8)] == [4.0, 2.0, 1.0]
    # a table the profile has (all_gather x2) is used as measured, then slowed down 4×
    table_s = costs.comm.model.all_gather_time_s(2**20, 2)
    assert costs.comm.collective_s("all_gather", 2**20, 2) == pytest.approx(4 * table_s)
    # two processes on two cores: as measured
    two = CostModel.for_cluster(graph, Cluster.local(nproc=2, profile=prof))
    assert two.comm.collective_s("all_reduce", 2**20, 2) == pytest.approx(two.comm.model.all_reduce_time_s(2**20, 2))
    # broadcast x2 was not measured: half the measured all-reduce of the same size
    half = 0.5 * two.comm.model.all_reduce_time_s(2**20, 2)
    assert two.comm.collective_s("broadcast", 2**20, 2) == pytest.approx(half)


def _run(tmp_path: Path, options: dict) -> tuple[RunRecord, autopar.Plan, object]:
    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import build_model

    model, x = build_model("gpt-tiny", 32, "meta", n_layers=2)
    graph = autopar.capture(model, x)
    plan = autopar.plan(graph, Cluster.local(nproc=2), global_batch_size=4, options=PlannerOptions(**options, top_k=0))
    plan.save(tmp_path / "plan.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "examples" / "train_gpt.py"), "--seq-len", "32", "--override", "n_layers=2",
           "--global-batch-size", "4", "--steps", "3", "--warmup", "1", "--plan", str(tmp_path / "plan.json"),
           "--record", str(tmp_path / "run.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return RunRecord.load(tmp_path / "run.json"), plan, graph


@pytest.mark.parametrize("options", [dict(dp=2, zero_stage=1), dict(dp=2, zero_stage=3, num_microbatches=2)],
                         ids=["zero1", "zero3-m2"])
def test_predicted_collective_count_is_what_the_runtime_issues(tmp_path, options):
    rec, plan, graph = _run(tmp_path, options)
    costs = CostModel.for_cluster(graph, Cluster.local(nproc=2))
    t = costs.comm.dp_tail(Candidate.of(plan.config))
    units = sum(1 for la in graph.layers if la.num_params > 0)
    for r in rec.ranks:  # the loss and grad-norm all-reduces run on the world group ("other"), the rest on "dp"
        assert r.calls_per_step.get("dp", 0) + r.calls_per_step.get("other", 0) == t.collectives_per_step(units)


def test_fsdp_host_overheads_are_charged_on_cpu_per_unit_outside_the_tail():
    from autopar.planner.dp_costs import DTENSOR_OPTIMIZER_FLOORS, FSDP_HOOKS_FLOORS

    kw = dict(dp=4, world=8, microbatches=3, rank_grad_bytes=64e6, collective_s=coll, memory_s=lambda n: n / MEM)
    for zero in (2, 3):
        gpu = DPTail(zero_stage=zero, **kw)
        cpu = DPTail(zero_stage=zero, host_floor_s=2e-6, **kw)
        assert cpu.hooks_s == pytest.approx(2e-6 * FSDP_HOOKS_FLOORS[zero])  # per layer, per micro-batch
        assert cpu.optimizer_host_s == pytest.approx(2e-6 * DTENSOR_OPTIMIZER_FLOORS)  # per layer, per step
        assert gpu.hooks_s == gpu.optimizer_host_s == 0.0
        assert cpu.layer_s(5e6) == gpu.layer_s(5e6)  # the tail holds communication only
    plain = DPTail(zero_stage=0, host_floor_s=2e-6, **kw)
    assert plain.hooks_s == plain.optimizer_host_s == 0.0


@pytest.mark.parametrize("zero", [0, 1])
def test_zero01_all_reduce_hides_behind_the_last_micro_batchs_backward(zero):
    """The dense tail's all-reduce runs in the last micro-batch's backward (autopar.codegen.grad_overlap): a layer
    hides its bytes' share of it behind its backward, less NCCL's interference — all but the last bucket's
    (the first layers' gradients, complete only as backward ends); the per-bucket latency, the packing passes
    and ZeRO-1's broadcast stay exposed, and a tail reduced after backward hides nothing."""
    m, dp, p, f, g = 3, 4, 5e6, 0.2, 64e6
    t = DPTail(zero_stage=zero, dp=dp, world=8, microbatches=m, rank_grad_bytes=g, collective_s=coll,
               memory_s=lambda n: n / MEM, interference=f, reduce_in_backward=True)
    # the ring all-reduce's time per byte, times the layer's bytes, less the last bucket's share of them
    share = 2 * (dp - 1) / dp * p / BETA * (1 - BUCKET_BYTES / g)
    assert t.overlapped_s(p) == (0.0, 0.0, pytest.approx(share, rel=1e-9))
    assert t.hidden_s(p, forward_s=1.0, backward_s=1.0) == pytest.approx((1 - f) * share, rel=1e-9)  # once, not m
    assert t.hidden_s(p, forward_s=1.0, backward_s=share / 3) == pytest.approx(share / 3, rel=1e-12)
    assert t.hidden_s(p, forward_s=1.0, backward_s=1.0) < t.layer_s(p) - 6 * p / MEM
    assert tail(zero).hidden_s(p, forward_s=1.0, backward_s=1.0) == 0.0  # the experts': after backward
    # a gradient within one bucket completes as backward ends: nothing hides
    one = DPTail(zero_stage=zero, dp=dp, world=8, microbatches=m, rank_grad_bytes=BUCKET_BYTES / 2,
                 collective_s=coll, memory_s=lambda n: n / MEM, interference=f, reduce_in_backward=True)
    assert one.overlapped_s(p) == (0.0, 0.0, 0.0)


def test_nccl_zero1_exposed_data_parallel_time_drops_by_what_each_layers_backward_hides():
    """A ZeRO-1 layout on an NCCL cluster against the same layout with nothing overlapped (the cluster on gloo:
    its collectives priced alike on GPUs): every run's exposed data-parallel time (grad_sync_s − backward_s) is
    lower by hidden_beside_s(its dense all-reduce share, its backward of one micro-batch, the interference) plus
    hidden_beside_s(its parameter broadcast share, its forward of one micro-batch, the interference)."""
    import dataclasses

    from cost_models.fleet import hidden_beside_s, overlap_interference

    nccl = Cluster.preset("dgx-h100", nodes=1)
    c = Candidate(tp=1, pp=1, dp=8, zero_stage=1, micro_batch_size=2, num_microbatches=2, schedule="1f1b",
                  virtual_stages=1, sequence_parallel=False)
    # a tiny model's broadcast is all first wave (each owner's share within one bucket) and its gradient one
    # bucket: nothing hides
    tiny = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=32, n_layers=2, device="meta"))
    assert CostModel.for_cluster(tiny, nccl).comm.dp_tail(c).overlapped_s(1e6) == (0.0, 0.0, 0.0)
    # 2 blocks of gpt3-1.3b: 0.6 GB of fp32 gradients a rank, 77 MB an owner, three buckets each
    graph = autopar.capture(*autopar.zoo.build("gpt3-1.3b", seq_len=32, n_layers=2, device="meta"))
    on = CostModel.for_cluster(graph, nccl)
    off = CostModel.for_cluster(graph, dataclasses.replace(nccl, backend="gloo"))
    tail, f = on.comm.dp_tail(c), overlap_interference(nccl.device)
    assert tail.overlapped_s(1e6)[0] > 0  # ZeRO-1's broadcast runs into the next forward (param_prefetch)
    checked = 0
    for ri, (a, b) in enumerate(zip(on.problem(c).runs, off.problem(c).runs, strict=True)):
        assert a.grad_sync_s == pytest.approx(b.grad_sync_s, rel=1e-12) and b.backward_s == 0.0
        grad_bytes = on.memory.grad_bytes(on.memory.run_local_params(ri, 1, 1, 1))
        passes = on._passes(ri, 1, False, 2, 1, False, 1, 1, "none", False, 1)[0]
        bcast, _, reduce = tail.overlapped_s(grad_bytes)
        want = hidden_beside_s(bcast, passes.forward_s, f) + hidden_beside_s(reduce, passes.backward_s, f)
        assert (b.grad_sync_s - b.backward_s) - (a.grad_sync_s - a.backward_s) == pytest.approx(want, rel=1e-9)
        checked += want > 0
    assert checked >= 2


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_zero1_broadcast_hides_behind_the_next_forward_but_its_first_buckets_latency(ratio):
    """ZeRO-1's parameter broadcast, issued after the step and waited for bucket by bucket in the next forward
    (autopar.codegen.param_prefetch), against a hand computation: B = ratio·G bytes, each owner's B/dp share in
    ⌈B / (dp·25 MiB)⌉ buckets of its own, one broadcast each. The owners' parameters are spread over the model,
    so the first layer waits for every owner's first bucket: that wave (dp buckets, dp latencies) stays exposed;
    a layer's share of the rest (its bytes at the broadcast's per-byte time, less the wave's share, plus its
    bytes' share of the later buckets' latencies) hides behind one micro-batch's forward, less NCCL's
    interference; the packing passes stay exposed; gloo (no interference priced, nothing hidden by
    costs.CostModel) leaves it all exposed. The all-reduce hides all but its last bucket's share."""
    g, dp, m, p, f = 256e6, 4, 3, 5e6, 0.2
    t = DPTail(zero_stage=1, dp=dp, world=8, microbatches=m, rank_grad_bytes=g, collective_s=coll,
               memory_s=lambda n: n / MEM, interference=f, reduce_in_backward=True, broadcast_in_forward=True,
               broadcast_ratio=ratio)
    broadcasts = dp * math.ceil(ratio * g / dp / BUCKET_BYTES)  # 4·3 of fp32 parameters, 4·2 of 16-bit ones
    assert broadcasts == {1.0: 12, 0.5: 8}[ratio]
    lat, per_byte = (dp - 1) * ALPHA, (dp - 1) / dp / BETA  # the synthetic ring broadcast: lat + n·per_byte
    wave = dp * BUCKET_BYTES  # every owner's first bucket, in broadcast bytes (each share exceeds a bucket)
    share = ratio * p * per_byte * (1 - wave / (ratio * g)) + p / g * (broadcasts - dp) * lat
    full_share = ratio * p * per_byte + p / g * (broadcasts - dp) * lat  # in γ, hidden or not
    reduce_all = 2 * (dp - 1) / dp * p / BETA
    reduce = reduce_all * (1 - BUCKET_BYTES / g)
    assert t.overlapped_s(p) == (pytest.approx(share, rel=1e-9), 0.0, pytest.approx(reduce, rel=1e-9))
    # long passes: the broadcast share behind the forward, the all-reduce share behind the backward, once each
    assert t.hidden_s(p, forward_s=1.0, backward_s=1.0) == pytest.approx((1 - f) * (share + reduce), rel=1e-9)
    # a forward shorter than the share hides its own length
    assert t.hidden_s(p, forward_s=share / 4, backward_s=1.0) == pytest.approx(share / 4 + (1 - f) * reduce,
                                                                               rel=1e-9)
    # exposed whatever the passes: the first wave's latencies (in γ0), its bytes, the all-reduce's last bucket
    # and the packing passes (in γ)
    ar_lat = 2 * (dp - 1) * ALPHA
    buckets_ar = math.ceil(g / BUCKET_BYTES)
    assert t.fixed_s == pytest.approx(buckets_ar * ar_lat + dp * lat + coll("all_reduce", 4, 8) + norm_s(8, g),
                                      rel=1e-9)
    assert t.layer_s(p) - t.hidden_s(p, forward_s=1.0, backward_s=1.0) == pytest.approx(
        f * (share + reduce) + (full_share - share) + (reduce_all - reduce) + 6 * p / MEM + 2 * ratio * p / MEM,
        rel=1e-9)
    assert t.collectives_per_step(layers_with_params=5) == buckets_ar + broadcasts + 2
    # without the overlap (the experts' tail before param_prefetch, or a gloo cluster: CostModel passes no β)
    # the same bytes are all in γ and none hides
    off = DPTail(zero_stage=1, dp=dp, world=8, microbatches=m, rank_grad_bytes=g, collective_s=coll,
                 memory_s=lambda n: n / MEM, broadcast_ratio=ratio)
    assert off.layer_s(p) == pytest.approx(t.layer_s(p), rel=1e-12) and off.fixed_s == pytest.approx(t.fixed_s)
    assert off.hidden_s(p, forward_s=1.0, backward_s=1.0) == 0.0


def test_gloo_prices_zero1_broadcast_fully_exposed():
    """On gloo the collectives share the cores: no run of a ZeRO-1 layout hides anything (β = 0), its broadcast
    included, though the tail prices the broadcast as running in the next forward."""
    # 2 blocks of gpt3-1.3b: each owner's share spans several buckets, so the tail has a broadcast to hide
    graph = autopar.capture(*autopar.zoo.build("gpt3-1.3b", seq_len=32, n_layers=2, device="meta"))
    costs = CostModel.for_cluster(graph, Cluster.local(nproc=2))
    c = Candidate(tp=1, pp=1, dp=2, zero_stage=1, micro_batch_size=2, num_microbatches=2, schedule="1f1b",
                  virtual_stages=1, sequence_parallel=False)
    assert costs.comm.dp_tail(c).overlapped_s(1e6)[0] > 0
    assert all(r.backward_s == 0.0 for r in costs.problem(c).runs)
