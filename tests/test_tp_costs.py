"""Tensor-parallel collectives per layer (planner.tp_costs) and what the cost model charges for them.

The counts against a real step (CommDebugMode) are in test_codegen.py; here the payloads by hand for a
GPT (hidden h, sequence s, micro-batch b, bf16) and the cost model's use of the list.
"""

import pytest

import autopar
from autopar import Cluster
from autopar.planner.costs import CostModel
from autopar.planner.space import Candidate
from autopar.planner.tp_costs import TPCollective, tp_collectives

S, B = 128, 2


@pytest.fixture(scope="module")
def graph():
    return autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=S))


def test_collectives_per_layer_by_hand(graph):
    h = graph.hidden_size
    act = 2 * B * S * h  # bf16 [b, s, h]
    emb, block, norm, head = (graph.layer(n) for n in ("embed", "blocks.0", "ln_f", "lm_head"))

    def ops(layer, sp):
        return sorted(tp_collectives(graph, layer, tp=2, sp=sp, micro_batch=B))

    assert ops(emb, False) == [TPCollective("all_reduce", "forward", act)]
    assert ops(block, False) == sorted([TPCollective("all_reduce", p, act) for p in ("forward", "backward")] * 2)
    assert ops(norm, False) == []
    # the LM head: its input gradient, and the parallel cross-entropy's fp32 max and (sum-exp, target) pair
    assert ops(head, False) == sorted([TPCollective("all_reduce", "backward", act),
                                       TPCollective("all_reduce", "forward", 4 * B * S),
                                       TPCollective("all_reduce", "forward", 8 * B * S)])
    # SP: the sequence split after the embedding gathers the gradient back; the head takes shards
    assert ops(emb, True) == sorted([TPCollective("all_reduce", "forward", act),
                                     TPCollective("all_gather", "backward", act)])
    assert ops(block, True)[:4] == [TPCollective("all_gather", p, act) for p in ("backward", "backward", "forward",
                                                                                 "forward")]
    # 2 LayerNorms × (weight, bias) of h elements, each fp32 gradient (the masters') reduced once per step
    assert [c for c in ops(block, True) if c.phase == "step"] == [TPCollective("all_reduce", "step", 4 * h)] * 4
    assert ops(norm, True) == [TPCollective("all_reduce", "step", 4 * h)] * 2
    assert {c.op for c in ops(head, True)} == {"all_gather", "reduce_scatter", "all_reduce"}
    assert tp_collectives(graph, block, tp=1, sp=False, micro_batch=B) == ()


@pytest.mark.parametrize("sp", [False, True])
def test_cost_model_charges_the_listed_collectives(graph, sp):
    cm = CostModel.for_cluster(graph, Cluster.preset("dgx-a100-80gb", nodes=1))
    cand = Candidate(tp=2, pp=1, dp=1, zero_stage=0, micro_batch_size=B, num_microbatches=1, schedule="1f1b",
                     virtual_stages=1, sequence_parallel=sp)
    problem = cm.problem(cand)
    for run in problem.runs:
        layer = graph.layer(run.layer_names[0])
        listed = tp_collectives(graph, layer, tp=2, sp=sp, micro_batch=B)
        per_mb = sum(cm.comm.collective_s(c.op, c.n_bytes, 2, 2) for c in listed if c.phase != "step")
        per_step = sum(cm.comm.collective_s(c.op, c.n_bytes, 2, 2) for c in listed if c.phase == "step")
        assert run.tp_comm_s[0] == pytest.approx(per_mb, rel=1e-12, abs=0)
        no_tp = cm.problem(Candidate(**{**cand.__dict__, "tp": 1, "sequence_parallel": False}))
        assert per_step == 0 or run.grad_sync_s > per_step * (1 - 1e-12)
        assert no_tp.runs[0].tp_comm_s[0] == 0.0
