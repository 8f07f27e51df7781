"""A tied weight in the planner: memory on every holding stage, and the all-reduce that sums its gradients
over pipeline stages (codegen/shared.py), priced as one all-reduce of the rank's share of the weight."""

from __future__ import annotations

import pytest
import torch
from hf_families import HIDDEN, VOCAB, build_family

import autopar
from autopar import Cluster
from autopar.planner.costs import CostModel
from autopar.planner.space import Candidate


def _graph(kind: str):
    return autopar.capture(build_family(kind), (torch.zeros(1, 16, dtype=torch.long),))


def test_tied_head_counts_the_weight_on_its_own_layer():
    tied, untied = _graph("llama_tied"), _graph("llama")
    # the tied head holds a replica of the embedding: as many parameters as the untied head's own weight
    assert tied.layers[-1].num_params == untied.layers[-1].num_params == VOCAB * HIDDEN
    assert tied.num_params == untied.num_params - VOCAB * HIDDEN
    (tie,) = tied.shared_params
    assert tie.names == ("model.embed_tokens.weight", "lm_head.weight") and tie.num_params == VOCAB * HIDDEN
    assert not untied.shared_params


@pytest.mark.parametrize("tp,dp,zero", [(1, 4, 0), (2, 2, 0), (1, 4, 3)])
def test_cross_stage_gradient_sum_is_priced_on_both_ends(tp, dp, zero):
    graph = _graph("llama_tied")
    cluster = Cluster.preset("dgx-h100", nodes=1)
    costs = CostModel.for_cluster(graph, cluster)
    cand = Candidate(tp=tp, pp=2, dp=dp, zero_stage=zero, micro_batch_size=1, num_microbatches=2, schedule="1f1b",
                     virtual_stages=1, sequence_parallel=False)
    names = [run[0].name for run in costs.memory.runs]
    # fp32 gradients (the reduce dtype), vocab-parallel under TP, an FSDP shard under ZeRO-3
    share = VOCAB * HIDDEN * 4 / tp / (dp if zero >= 2 else 1)
    expected = costs.comm.collective_s("all_reduce", share, 2, 2)  # 2·2·dp·tp ≤ 8 GPUs: one node
    for ri, name in enumerate(names):
        got = costs.comm.shared_sync_s(ri, cand)
        assert got == pytest.approx(expected if name in ("model.embed_tokens", "lm_head") else 0.0)
    one_stage = Candidate(tp=tp, pp=1, dp=dp, zero_stage=zero, micro_batch_size=1, num_microbatches=2,
                          schedule="1f1b", virtual_stages=1, sequence_parallel=False)
    assert all(costs.comm.shared_sync_s(ri, one_stage) == 0.0 for ri in range(len(names)))


def test_one_stage_holds_a_tied_weight_once():
    """Same model with and without the tie, on one stage: the tied one needs exactly one head weight's
    model states less: under bf16 (the H100's default) fp32 master, fp32 gradient, two fp32 Adam moments and
    the weight's bf16 compute copy, 4 + 4 + 8 + 2 bytes."""
    tied, untied = _graph("llama_tied"), _graph("llama")
    cluster = Cluster.preset("dgx-h100", nodes=1)
    cfg = autopar.ParallelConfig(dp=8, micro_batch_size=1, num_microbatches=1)
    est_tied = autopar.estimate(tied, cluster, cfg, global_batch_size=8)
    est_untied = autopar.estimate(untied, cluster, cfg, global_batch_size=8)
    per_param = 4 + 4 + 8 + 2
    assert est_untied.peak_memory_bytes - est_tied.peak_memory_bytes == pytest.approx(VOCAB * HIDDEN * per_param,
                                                                                      rel=1e-6)
