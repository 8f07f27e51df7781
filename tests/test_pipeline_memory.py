"""Memory of pipeline-parallel layouts as torch.distributed.pipelining runs them, against hand formulas and
against the buffers torch itself allocates (a 2-rank gloo pipeline on CPU)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from test_planner import fake_cluster, gpt_graph

import autopar
from autopar.config import ParallelConfig, PlannerOptions
from autopar.errors import ConfigError
from cost_models import memory
from cost_models.pipeline import PIPELINE_RUNTIMES


def _rank_params(est_stages, graph, q: int) -> float:
    return sum(graph.layer(n).num_params for st in est_stages if st.pp_rank == q for n in st.layers)


@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp_under_a_pipeline_keeps_gathered_weights_and_accumulates_unsharded_fp32_gradients(zero: int) -> None:
    # torch.distributed.pipelining runs every backward of an FSDP stage without gradient sync or resharding and
    # reduce-scatters after the last (stage.py), accumulating unsharded gradients in the reduce dtype (fp32):
    # bf16 weights 2 B + fp32 gradients 4 B whole, fp32 masters 4 B and Adam moments 8 B over dp = 4.
    graph, cluster = gpt_graph(layers=8, hidden=1024), fake_cluster()
    cfg = ParallelConfig(tp=1, pp=2, dp=4, zero_stage=zero, micro_batch_size=1, num_microbatches=4)
    plan_stages = autopar.plan(graph, cluster, global_batch_size=16,
                               options=PlannerOptions(tp=1, pp=2, dp=4, zero_stage=zero, micro_batch_size=1,
                                                      schedule="1f1b", recompute="none")).stages
    est = autopar.estimate(graph, cluster, cfg, stages=plan_stages)
    for q in range(2):
        n = _rank_params(plan_stages, graph, q)
        mb = next(st.memory_breakdown for st in plan_stages if st.pp_rank == q)
        assert mb["grads"] == pytest.approx(4 * n, rel=1e-6)
        assert mb["compute_copies"] == pytest.approx(2 * n, rel=1e-6)
        assert mb["weights"] == pytest.approx(4 * n / 4, rel=1e-6)
        assert mb["optimizer"] == pytest.approx(8 * n / 4, rel=1e-6)
    # Megatron-LM's runtime keeps ZeRO's states (Rajbhandari et al. 2020): ZeRO-2 gradients over dp
    meg = autopar.estimate(graph, cluster, cfg, stages=plan_stages,
                           options=PlannerOptions(pipeline_runtime="megatron"))
    assert meg.peak_memory_bytes < est.peak_memory_bytes
    meg_stage0 = autopar.plan(graph, cluster, global_batch_size=16,
                              options=PlannerOptions(tp=1, pp=2, dp=4, zero_stage=zero, micro_batch_size=1,
                                                     schedule="1f1b", recompute="none",
                                                     pipeline_runtime="megatron")).stages
    mb0 = next(st.memory_breakdown for st in meg_stage0 if st.pp_rank == 0)
    n0 = _rank_params(meg_stage0, graph, 0)
    assert mb0["grads"] == pytest.approx(4 * n0 / 4, rel=1e-6)
    assert mb0["pipeline_buffers"] == 0


def test_megatron_distributed_optimizer_shards_the_fp32_main_params() -> None:
    # Megatron-LM docs/source/api-guide/dist_optimizer.md, its table: bf16 parameters with fp32 gradients take
    # 18 bytes a parameter without the distributed optimizer and 6 + 12/d with it (the fp32 main parameters and
    # Adam's two moments sharded over the d data-parallel ranks); autopar's own ZeRO-1 runs the same layout
    # (autopar.codegen.dist_optimizer; it sharded only the moments, 10 + 8/d, before)
    graph, cluster = gpt_graph(layers=8, hidden=1024), fake_cluster()
    dp = 4
    for zero, per_param in ((0, 18.0), (1, 6.0 + 12.0 / dp)):
        opts = PlannerOptions(tp=1, pp=2, dp=dp, zero_stage=zero, micro_batch_size=1, schedule="1f1b",
                              recompute="none", pipeline_runtime="megatron")
        stages = autopar.plan(graph, cluster, global_batch_size=16, options=opts).stages
        for q in range(2):
            n = _rank_params(stages, graph, q)
            mb = next(st.memory_breakdown for st in stages if st.pp_rank == q)
            states = mb["weights"] + mb["grads"] + mb["optimizer"] + mb["compute_copies"]
            assert states == pytest.approx(per_param * n, rel=1e-6)
    torch_opts = PlannerOptions(tp=1, pp=2, dp=dp, zero_stage=1, micro_batch_size=1, schedule="1f1b",
                                recompute="none")
    stages = autopar.plan(graph, cluster, global_batch_size=16, options=torch_opts).stages
    mb, n = stages[0].memory_breakdown, _rank_params(stages, graph, stages[0].pp_rank)
    assert mb["weights"] + mb["grads"] + mb["optimizer"] + mb["compute_copies"] == pytest.approx(
        (6.0 + 12.0 / dp) * n, rel=1e-6)
    assert mb["compute_copies"] == pytest.approx(2.0 * n, rel=1e-6)  # the 16-bit parameters themselves


def test_pipeline_buffers_hand_formula() -> None:
    # pp = 2, 1F1B, m = 8, micro-batch 2: a boundary tensor is B = 2 samples × s·h bf16. Rank 0 (first stage)
    # receives nothing; it holds the gradient buffer of its running backward and the two outputs torch's 1F1B
    # still holds in sends (inflight_stage.py): 3·B. Rank 1 (last) sends nothing; its input buffers are its
    # in-flight micro-batches' inputs, counted with its activations: 0. (torch's own stages: 10·B and 7·B.)
    graph, cluster = gpt_graph(layers=8, hidden=1024, seq=1024), fake_cluster()
    cfg = ParallelConfig(tp=1, pp=2, dp=4, zero_stage=0, micro_batch_size=2, num_microbatches=8, recompute="full")
    est = autopar.estimate(graph, cluster, cfg)
    B = 2 * (2 * 1024 * 1024)
    plan = autopar.plan(graph, cluster, global_batch_size=64,
                        options=PlannerOptions(tp=1, pp=2, dp=4, zero_stage=0, micro_batch_size=2, schedule="1f1b",
                                               recompute="full"))
    by_rank = {st.pp_rank: st.memory_breakdown["pipeline_buffers"] for st in plan.stages}
    assert by_rank == {0: 3 * B, 1: 0}
    assert est.memory_breakdown["pipeline_buffers"] in (3 * B, 0)
    # torch's own stages (pipeline_runtime="torch", torchtitan): rank 0 a gradient buffer per micro-batch (8)
    # and its 2 in-flight outputs; rank 1 an input buffer per micro-batch beyond its 1 in flight (7)
    torch_plan = autopar.plan(graph, cluster, global_batch_size=64,
                              options=PlannerOptions(tp=1, pp=2, dp=4, zero_stage=0, micro_batch_size=2,
                                                     schedule="1f1b", recompute="full", pipeline_runtime="torch"))
    assert {st.pp_rank: st.memory_breakdown["pipeline_buffers"] for st in torch_plan.stages} == {0: 10 * B, 1: 7 * B}


def test_pipeline_runtime_is_checked() -> None:
    with pytest.raises(ConfigError, match="pipeline_runtime"):
        PlannerOptions(pipeline_runtime="gpipe")
    assert memory.PIPELINE_MEMORY == ("autopar", "torch", "megatron")
    assert {n: r.memory for n, r in PIPELINE_RUNTIMES.items()} == {"autopar": "autopar", "torch": "torch",
                                                                    "megatron": "megatron",
                                                                  "deepspeed": "megatron"}


def _pipeline_held(runtime: str, schedule: str, m: int, width: int, v: int) -> dict:
    """On a 2-rank gloo pipeline of Linear+Tanh stages (Tanh saves its output for backward, so a freed output
    must not be that tensor), two steps of `schedule` over m micro-batches of [1, width]. At every backward's
    start (where a rank's activations peak): the live input receive buffers, the chunks in flight on receiving
    stages, and the bytes of gradient buffers and of sent outputs still alive. Also the receive buffers alive
    after the step, and the gradients."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from autopar.codegen.grouped_schedule import ScheduleGroupedInterleaved1F1B
    from autopar.codegen.inflight_stage import InflightStage

    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), 2
    cls = InflightStage if runtime == "autopar" else PipelineStage
    torch.manual_seed(0)
    mods = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(pp * v)]
    stages = [cls(mods[i], i, pp * v, torch.device("cpu")) for i in range(rank, pp * v, pp)]
    loss = lambda y, t: ((y - t) ** 2).mean()  # noqa: E731
    if schedule == "interleaved_1f1b":
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=loss)
    elif schedule.startswith("grouped"):
        sched = ScheduleGroupedInterleaved1F1B(stages, m, microbatch_group=int(schedule[7:]), loss_fn=loss)
    else:
        sched = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(stages[0], m, loss_fn=loss)
    peaks = {"inputs": 0, "inflight_receiving": 0, "bytes": 0}
    elem = width * 4  # one fp32 [1, width] boundary tensor

    def live(kind: str) -> int:
        return sum(1 for s in stages for k, _, ref in getattr(s, "recv_buffers", []) if k == kind and ref() is not None)

    def at_backward() -> None:
        sent = sum(ref().untyped_storage().nbytes() for s in stages for refs in s._sent.values() for ref in refs
                   if ref() is not None)
        peaks["inputs"] = max(peaks["inputs"], live("input"))
        peaks["inflight_receiving"] = max(peaks["inflight_receiving"],
                                          sum(len(s.fwd_cache) for s in stages if not s.is_first))
        peaks["bytes"] = max(peaks["bytes"], live("grad") * elem + sent)

    if runtime == "autopar":
        for s in stages:
            def backward(*a, _f=s.backward_one_chunk, **k):
                at_backward()
                return _f(*a, **k)
            s.backward_one_chunk = backward
    x, target = torch.randn(m, width), torch.randn(m, width)
    for _ in range(2):
        for mod in mods:
            mod.zero_grad()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=target, losses=[])

    def size(infos) -> int:  # distinct storages of the receive buffers the stages still hold
        seen = {info.buffer.untyped_storage().data_ptr(): info.buffer.untyped_storage().nbytes()
                for s in infos for t in s.values() for info in t if isinstance(info.buffer, torch.Tensor)}
        return sum(seen.values())

    return {"rank": rank, **peaks, "after_inputs": size(s.args_recv_info for s in stages),
            "after_grads": size(s.grad_recv_info for s in stages),
            "grads": {s.stage_index: [p.grad.clone() for p in s.submod.parameters()] for s in stages}}


def test_torch_pipelining_allocates_a_receive_buffer_per_microbatch_and_autopar_does_not() -> None:
    # torch's PipelineStage keeps an input and a gradient receive buffer for every micro-batch index after the
    # step (what pipeline_buffer_bytes charged before); autopar's InflightStage keeps none, trains the same
    m, width = 4, 256
    one = width * 4  # one fp32 [1, width] micro-batch
    torch_runs = run_distributed(_pipeline_held, 2, "torch", "1f1b", m, width, 1)
    ours = run_distributed(_pipeline_held, 2, "autopar", "1f1b", m, width, 1)
    assert [(r["after_inputs"], r["after_grads"]) for r in torch_runs] == [(0, m * one), (m * one, 0)]
    assert [(r["after_inputs"], r["after_grads"]) for r in ours] == [(0, 0), (0, 0)]
    for a, b in zip(torch_runs, ours, strict=True):
        for index, grads in a["grads"].items():
            for g, h in zip(grads, b["grads"][index], strict=True):
                torch.testing.assert_close(h, g, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("grouped2", 2)])
def test_inflight_stage_holds_buffers_of_microbatches_in_flight_as_priced(schedule: str, v: int) -> None:
    from types import SimpleNamespace

    from autopar.planner.memory_costs import MemoryCosts

    m, width, pp = 8, 64, 2  # m >= 4·pp
    runs = run_distributed(_pipeline_held, pp, "autopar", schedule, m, width, v)
    group = 2 if schedule.startswith("grouped") else None
    kind = "interleaved_1f1b" if v > 1 else schedule
    costs = SimpleNamespace(pipeline_memory="autopar", act_scale=1.0, _largest_boundary_bytes=width * 4)
    for r in runs:
        q = r["rank"]
        inflight = memory.inflight_microbatches(kind, pp, m, q, v, group)
        price = MemoryCosts.pipeline_buffer_bytes(costs, q, pp=pp, v=v, m=m, inflight=inflight, mbs=1, tp=1,
                                                  sp=False, schedule=kind)
        if v == 1:
            # input buffers at the peak: the micro-batches in flight (the last rank receives on every stage)
            assert r["inputs"] == (inflight if q == pp - 1 else 0)
            assert r["bytes"] == pytest.approx(price, rel=0.01)
        else:
            # the multi-stage runtime posts each receive one action ahead of its compute (torch's _add_send_recv):
            # one input buffer beyond the chunks in flight, and gradient buffers early, up to 2 not priced
            assert r["inflight_receiving"] <= r["inputs"] <= r["inflight_receiving"] + 1
            assert price - width * 4 <= r["bytes"] <= price + 2 * width * 4
