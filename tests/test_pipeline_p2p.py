"""Pipeline sends as the runtime issues them (cost_models.comm.PIPELINE_P2P), against a replay of the schedule.

The reference is a discrete-event replay of DeepSpeed's PipelineEngine TrainSchedule (deepspeed/runtime/pipe/
schedule.py, 2021): 2·(m + p − 1) steps; on step k stage s runs a forward when k and s have the same parity,
else a backward, micro-batch ids as the schedule derives them; a forward step first receives its activation
and sends the previous step's input gradient, a backward step first sends the previous step's activation and
receives its output gradient. Every transfer is blocking and completes only when both ends have reached it
(dist.send / dist.recv on one CUDA stream), taking c. What the replay adds over the same schedule with free
transfers is the communication on the critical path, compared with what the planner charges per micro-batch.
"""

from __future__ import annotations

import pytest

import autopar
from autopar import Cluster, PlannerOptions
from autopar.errors import ConfigError
from autopar.planner.costs import CostModel
from cost_models.comm import PIPELINE_P2P
from cost_models.pipeline import PIPELINE_RUNTIMES


def _step(stage: int, stages: int, k: int) -> tuple[int, bool]:
    """(micro-batch, is_forward) of stage `stage` on step `k` of TrainSchedule."""
    if k % 2 == stage % 2:  # forward steps
        return (k - k % 2) // 2 - stage // 2, True
    if k % 2 == 0:  # even step, odd stage: backward
        return k // 2 - stages + (stage + 1) // 2, False
    return (k - 1) // 2 - stages + 1 + stage // 2, False


def _program(stage: int, stages: int, m: int) -> list[tuple[str, tuple]]:
    """The stage's instructions: ("compute", (is_forward,)) or ("xfer", (kind, sender, receiver, micro-batch))."""
    prog: list[tuple[str, tuple]] = []
    prev = -1
    for k in range(2 * (m + stages - 1)):
        mb, fwd = _step(stage, stages, k)
        if fwd and stage > 0:
            if 0 <= mb < m:
                prog.append(("xfer", ("act", stage - 1, stage, mb)))
            if 0 <= prev < m:
                prog.append(("xfer", ("grad", stage, stage - 1, prev)))
        if not fwd and stage < stages - 1:
            if 0 <= prev < m:
                prog.append(("xfer", ("act", stage, stage + 1, prev)))
            if 0 <= mb < m:
                prog.append(("xfer", ("grad", stage + 1, stage, mb)))
        if 0 <= mb < m:
            prog.append(("compute", (fwd,)))
        prev = mb
    return prog


def replay_s(stages: int, m: int, forward_s: list[float], backward_s: list[float], transfer_s: float) -> float:
    """Makespan of TrainSchedule with rendezvous transfers (module docstring)."""
    progs = [_program(s, stages, m) for s in range(stages)]
    pc, clock = [0] * stages, [0.0] * stages
    waiting: dict[tuple, tuple[int, float]] = {}
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            while pc[s] < len(progs[s]):
                op, arg = progs[s][pc[s]]
                if op == "compute":
                    clock[s] += forward_s[s] if arg[0] else backward_s[s]
                    pc[s] += 1
                    moved = True
                    continue
                peer = waiting.get(arg)
                if peer is None or peer[0] == s:
                    waiting[arg] = (s, clock[s])
                    break
                del waiting[arg]
                done = max(peer[1], clock[s]) + transfer_s
                clock[s] = clock[peer[0]] = done
                pc[s] += 1
                pc[peer[0]] += 1
                moved = True
    assert pc == [len(p) for p in progs] and not waiting, "the replay deadlocked"
    return max(clock)


def _comm_per_microbatch(stages: int, m: int, fwd: list[float], bwd: list[float], c: float) -> float:
    """Transfer times per micro-batch slot that the blocking transfers put on the critical path."""
    return (replay_s(stages, m, fwd, bwd, c) - replay_s(stages, m, fwd, bwd, 0.0)) / (m + stages - 1) / c


def test_trainschedule_without_transfers_is_the_1f1b_makespan():
    # with free transfers DeepSpeed's step order reaches the ideal (m + p − 1)·(F + B) of 1F1B
    p, m = 6, 16
    assert replay_s(p, m, [1.0] * p, [3.0] * p, 0.0) == pytest.approx((m + p - 1) * 4.0)


def test_blocking_transfers_cost_two_per_boundary_as_the_planner_charges():
    per_boundary = PIPELINE_P2P["blocking"][0]
    p, m, c = 35, 240, 0.0037  # MT-NLG's pipeline: 35 stages, 240 micro-batches; ~84 MB over HDR per transfer
    fwd, bwd = [0.044] * p, [0.136] * p
    # equal stages: a middle stage has two boundaries, 2 × 2 transfer times (batched issue: 2 × 1)
    assert _comm_per_microbatch(p, m, fwd, bwd, c) == pytest.approx(2 * per_boundary, rel=0.10)
    # a heavier last stage (the LM head) is the bottleneck: its one boundary, 2 transfer times
    fwd[-1], bwd[-1] = fwd[-1] + 0.006, bwd[-1] + 0.012
    assert _comm_per_microbatch(p, m, fwd, bwd, c) == pytest.approx(per_boundary, rel=0.05)


@pytest.fixture(scope="module")
def gpt_graph():
    model, x = autopar.zoo.build("gpt-tiny", seq_len=128)
    return autopar.capture(model, x)


def test_send_prices_each_runtime(gpt_graph):
    cluster = Cluster.preset("dgx-a100-80gb", nodes=2)
    costs = {name: CostModel.for_cluster(gpt_graph, cluster, pipeline_runtime=name) for name in PIPELINE_RUNTIMES}
    assert {n: c.comm.pipeline_p2p for n, c in costs.items()} == {
        "autopar": "batched", "torch": "batched", "megatron": "scatter_gather", "deepspeed": "blocking_scatter_gather"}
    tp, mbs = 4, 2
    n_bytes = costs["torch"].memory.act_scale * costs["torch"].memory.runs[0][0].boundary_bytes * mbs
    comm = costs["torch"].comm
    whole = comm.p2p_s(n_bytes, True)
    sliced = comm.p2p_s(n_bytes / tp, True) + comm.collective_s("all_gather", n_bytes, tp, tp)
    assert costs["torch"].comm.send_s(0, tp, False, mbs)[1] == pytest.approx(whole)
    assert costs["megatron"].comm.send_s(0, tp, False, mbs)[1] == pytest.approx(sliced)
    assert costs["deepspeed"].comm.send_s(0, tp, False, mbs)[1] == pytest.approx(2 * sliced)
    # blocking alone: every transfer its own call, twice the batched time
    costs["torch"].comm.pipeline_p2p = "blocking"
    assert costs["torch"].comm.send_s(0, tp, False, mbs)[1] == pytest.approx(2 * whole)
    costs["torch"].comm.pipeline_p2p = "batched"
    # Narayanan et al. §4.1: for a 530B-model activation (1 × 2048 × 20480 bf16, 84 MB) over TP 8, each rank
    # moves 1/8 across nodes and the NVLink all-gather costs less than the InfiniBand bytes it saves
    big = 2048 * 20480 * 2.0
    assert comm.p2p_s(big / 8, True) + comm.collective_s("all_gather", big, 8, 8) < 0.5 * comm.p2p_s(big, True)
    # under sequence parallelism the boundary is already sharded: slicing changes nothing
    sp = [costs[n].comm.send_s(0, tp, True, mbs) for n in ("torch", "megatron")]
    assert sp[0] == pytest.approx(sp[1])


def test_unknown_pipeline_runtime_is_refused():
    with pytest.raises(ConfigError, match="pipeline_runtime"):
        PlannerOptions(pipeline_runtime="nonblocking")
