"""Summing the micro-batches' weight gradients as the pipeline runtime does (cost_models.pipeline.GRAD_ACCUMULATION).

The reference is the parameter count of a GPT block by hand (Megatron's 12·h² + 13·h: QKV, projection and
two MLP weights with their biases, two LayerNorms) and the bytes `grad += new` moves on 16-bit gradients
(two read, one written), priced as memory-bound kernels on the device; the runtime that fuses the sum into
the weight-gradient GEMM (Megatron-LM) and autopar's own (not priced) add nothing.
"""

from __future__ import annotations

import pytest

import autopar
from autopar import Cluster, ParallelConfig
from autopar.planner.costs import CostModel
from autopar.planner.space import Candidate
from cost_models.pipeline import ACCUMULATE_PASSES, PIPELINE_RUNTIMES, PipelineRuntime


@pytest.fixture(scope="module")
def gpt_graph():
    # wide enough that the bytes, not the kernels' launch floor, set the time of the sum
    model, x = autopar.zoo.build("gpt-tiny", seq_len=128, n_layers=2, hidden_size=4096, n_heads=32)
    return autopar.capture(model, x)


def _block_compute_s(graph, runtime: str, *, tp: int, pp: int, m: int) -> tuple[float, CostModel]:
    cluster = Cluster.preset("dgx-a100-80gb", nodes=1)
    costs = CostModel.for_cluster(graph, cluster, pipeline_runtime=runtime)
    c = Candidate.of(ParallelConfig(tp=tp, pp=pp, dp=1, num_microbatches=m, recompute="full"))
    block = next(r for r, g in zip(costs._run_list(c), costs.memory.runs, strict=True) if g[0].kind == "block")
    return block.compute_s[0], costs


def test_deepspeed_adds_one_accumulation_pass_per_micro_batch_after_the_first(gpt_graph):
    tp, pp, m = 2, 2, 8
    fused, _ = _block_compute_s(gpt_graph, "megatron", tp=tp, pp=pp, m=m)
    summed, costs = _block_compute_s(gpt_graph, "deepspeed", tp=tp, pp=pp, m=m)
    h = gpt_graph.hidden_size
    # a GPT block on one of tp ranks: the weights and the column-parallel QKV and fc1 biases (3h + 4h) are
    # split, the row-parallel projection and fc2 biases and both LayerNorms' weights and biases (6h) are not
    local_params = (12 * h * h + 7 * h) / tp + 6 * h
    layer = next(g[0] for g in costs.memory.runs if g[0].kind == "block")
    kernels = layer.kernels_forward.gemm_count + len(layer.norm_param_numels)
    per_pass = costs.compute.model.kernels_time_s(gemm_flops=0.0, gemm_count=0, attention_flops=0.0,
                                                  attention_count=0, memory_bytes=3 * 2 * local_params,
                                                  memory_count=kernels, dtype="bfloat16")
    expected = per_pass * costs.compute.straggler * (m - 1) / m
    # (the memory model splits the replicated 6h too: 6h·tp / 12h² = 0.02% of the block at h = 4096)
    assert summed - fused == pytest.approx(expected, rel=1e-3)
    assert summed - fused > 1e-4  # ~600 MB of gradient traffic per micro-batch: not the launch floor
    assert ACCUMULATE_PASSES == 3


def test_fused_unpriced_and_unpipelined_add_nothing(gpt_graph):
    megatron, _ = _block_compute_s(gpt_graph, "megatron", tp=2, pp=2, m=8)
    torch_rt, _ = _block_compute_s(gpt_graph, "torch", tp=2, pp=2, m=8)
    assert torch_rt == pytest.approx(megatron)
    # pp = 1 is not the pipeline runtime's loop; one micro-batch sums nothing
    for pp, m in ((1, 8), (2, 1)):
        assert _block_compute_s(gpt_graph, "deepspeed", tp=2, pp=pp, m=m)[0] == pytest.approx(
            _block_compute_s(gpt_graph, "megatron", tp=2, pp=pp, m=m)[0])


def test_runtime_refuses_unknown_accumulation():
    assert {n: r.accumulation for n, r in PIPELINE_RUNTIMES.items()} == {
        "autopar": "not_priced", "torch": "not_priced", "megatron": "fused", "deepspeed": "autograd_16bit"}
    with pytest.raises(ValueError, match="accumulation"):
        PipelineRuntime(p2p="batched", memory="torch", accumulation="fp32_hooks")
