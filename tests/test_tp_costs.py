"""Tensor-parallel collectives per layer (planner.tp_costs) and what the cost model charges for them.

The counts against a real step (CommDebugMode) are in test_codegen.py; here the payloads by hand for a
GPT (hidden h, sequence s, micro-batch b, bf16) and the cost model's use of the list.
"""

import pytest
import torch

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


class _TablesAttention(torch.nn.Module):
    """Attention with every kind of per-head table codegen/head_bias.py cuts: a bucketed embedding of one value
    per head (cut at its output), a table and a logit scale met by the scores (cut there), a table plus a mask
    with the batch axis (cut there, one copy per sample), and a constant bias (no gradient, nothing gathered)."""

    def __init__(self, dim: int = 32, heads: int = 4, tokens: int = 8) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.buckets = torch.nn.Embedding(16, heads)
        self.register_buffer("bucket_ids", torch.arange(tokens * tokens).reshape(tokens, tokens) % 16)
        self.table = torch.nn.Parameter(torch.zeros(heads, tokens, tokens))
        self.scale = torch.nn.Parameter(torch.zeros(heads, 1, 1))
        self.shifted = torch.nn.Parameter(torch.zeros(1, heads, tokens, tokens))
        self.register_buffer("mask", torch.zeros(64, 1, tokens, tokens))
        self.register_buffer("zero_bias", torch.zeros(1, heads, tokens, tokens))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, self.heads, self.hd).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-1, -2)) * self.scale.exp()
        scores = scores + self.buckets(self.bucket_ids).permute(2, 0, 1).unsqueeze(0) + self.table
        scores = scores + (self.shifted + self.mask.narrow(0, 0, b)) + self.zero_bias
        return x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


def test_per_head_tables_are_priced_as_codegen_gathers_them():
    heads, tokens, batch = 4, 8, 3
    model = torch.nn.Sequential(_TablesAttention(), _TablesAttention())
    graph = autopar.capture(model, (torch.randn(batch, tokens, 32),))
    (pattern,) = [p for p in graph.layers[0].tp_patterns if p.kind == "attention"]
    table = heads * tokens * tokens * 4  # fp32
    assert pattern.head_table_bytes == table + table + heads * 4  # bucketed embedding, table, logit scale
    assert pattern.head_table_bytes_per_sample == table  # the table plus the batch's mask
    listed = [c for c in tp_collectives(graph, graph.layers[0], tp=2, sp=False, micro_batch=B) if c.op == "all_gather"]
    assert listed == [TPCollective("all_gather", "backward", 2 * table + heads * 4 + B * table)]
