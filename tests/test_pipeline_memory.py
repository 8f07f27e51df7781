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


def test_pipeline_buffers_per_microbatch_hand_formula() -> None:
    # pp = 2, 1F1B, m = 8, micro-batch 2: a boundary tensor is B = 2 samples × s·h bf16. Rank 0 (first stage)
    # receives nothing, keeps m gradient buffers and its 2 in-flight outputs: (8 + 2)·B; rank 1 (last) keeps
    # m input buffers, of which its 1 in-flight one is its first layer's saved input: (8 − 1)·B.
    graph, cluster = gpt_graph(layers=8, hidden=1024, seq=1024), fake_cluster()
    cfg = ParallelConfig(tp=1, pp=2, dp=4, zero_stage=0, micro_batch_size=2, num_microbatches=8, recompute="full")
    est = autopar.estimate(graph, cluster, cfg)
    B = 2 * (2 * 1024 * 1024)
    plan = autopar.plan(graph, cluster, global_batch_size=64,
                        options=PlannerOptions(tp=1, pp=2, dp=4, zero_stage=0, micro_batch_size=2, schedule="1f1b",
                                               recompute="full"))
    by_rank = {st.pp_rank: st.memory_breakdown["pipeline_buffers"] for st in plan.stages}
    assert by_rank == {0: 10 * B, 1: 7 * B}
    assert est.memory_breakdown["pipeline_buffers"] in (10 * B, 7 * B)


def test_pipeline_runtime_is_checked() -> None:
    with pytest.raises(ConfigError, match="pipeline_runtime"):
        PlannerOptions(pipeline_runtime="gpipe")
    assert memory.PIPELINE_MEMORY == ("torch", "megatron")
    assert {n: r.memory for n, r in PIPELINE_RUNTIMES.items()} == {"torch": "torch", "megatron": "megatron",
                                                                  "deepspeed": "megatron"}


def _torch_recv_buffers(m: int, width: int) -> tuple[int, int, int]:
    """On a 2-rank gloo pipeline of two Linear stages, after one 1F1B step of m micro-batches of [1, width]:
    (rank, bytes of this stage's input receive buffers, bytes of its gradient receive buffers)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    stage = PipelineStage(torch.nn.Linear(width, width), rank, 2, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda y, t: ((y - t) ** 2).mean())
    x, target = torch.randn(m, width), torch.randn(m, width)
    if rank == 0:
        sched.step(x)
    else:
        sched.step(target=target, losses=[])

    def size(infos) -> int:  # distinct storages: a reused buffer would count once
        seen = {}
        for info_tuple in infos.values():
            for info in info_tuple:
                buf = getattr(info, "buffer", None)
                if isinstance(buf, torch.Tensor):
                    seen[buf.untyped_storage().data_ptr()] = buf.untyped_storage().nbytes()
        return sum(seen.values())

    return rank, size(stage.args_recv_info), size(stage.grad_recv_info)


def test_torch_pipelining_allocates_a_receive_buffer_per_microbatch() -> None:
    # the measured counterpart of pipeline_buffer_bytes' receive buffers: m of them per direction
    m, width = 4, 256
    got = sorted(run_distributed(_torch_recv_buffers, 2, m, width))
    one = width * 4  # one fp32 [1, width] micro-batch
    assert got == [(0, 0, m * one), (1, m * one, 0)]
