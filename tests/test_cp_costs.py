"""Context parallelism in the planner: what it prices against what codegen runs, and when it is chosen."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import autopar
from autopar import Cluster, ParallelConfig, PlannerOptions
from autopar.planner.costs import CostModel
from autopar.planner.cp_costs import cp_ranks_per_node, kv_exchange_bytes
from autopar.planner.problem import MODES
from autopar.planner.search import price
from autopar.planner.space import Candidate, cp_degrees


class _KV(TorchFunctionMode):
    """Bytes of the keys and values each SDPA call receives (what codegen all-gathers under cp)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.bytes.append(sum(t.numel() * t.element_size() for t in args[1:3]))
        return func(*args, **(kwargs or {}))


def test_kv_exchange_bytes_are_what_the_model_hands_sdpa():
    from hf_families import build_family

    model = build_family("llama")  # grouped-query attention: 2 key/value heads of 4
    seq, batch = 16, 3
    graph = autopar.capture(model, (torch.zeros(1, seq, dtype=torch.long),))
    with _KV() as kv:
        model(torch.zeros(batch, seq, dtype=torch.long), attention_mask=torch.ones(batch, seq, dtype=torch.long))
    blocks = [la for la in graph.layers if la.kind == "block"]
    assert len(kv.bytes) == len(blocks)
    for got, layer in zip(kv.bytes, blocks, strict=True):
        assert kv_exchange_bytes(graph, layer, tp=1, micro_batch=batch, elem=4) == got
        assert kv_exchange_bytes(graph, layer, tp=2, micro_batch=batch, elem=4) == got / 2


def test_cp_groups_stay_in_a_node_when_tp_cp_fits():
    assert cp_ranks_per_node(tp=2, cp=4, devices_per_node=8) == 4
    assert cp_ranks_per_node(tp=8, cp=16, devices_per_node=8) == 1  # Llama 3's CP16 crosses nodes
    assert cp_ranks_per_node(tp=4, cp=4, devices_per_node=8) == 2


@pytest.fixture(scope="module")
def long_llama():
    model, x = autopar.zoo.build("llama3-8b", seq_len=65536)
    return autopar.capture(model, x)


def test_per_token_costs_divide_by_cp(long_llama):
    """Activations and compute of a rank under cp are those of 1/cp of the tokens; the K/V exchange is extra."""
    cluster = Cluster.preset("dgx-h100", nodes=2)
    costs = CostModel.for_cluster(long_llama, cluster)
    base = dict(tp=1, pp=1, dp=2, zero_stage=3, micro_batch_size=2, num_microbatches=1, schedule="1f1b",
                virtual_stages=1, sequence_parallel=False)
    one = costs.problem(Candidate(**base, cp=1), ("none", "full"))
    eight = costs.problem(Candidate(**base, cp=8), ("none", "full"))
    ri = next(i for i, r in enumerate(one.runs) if r.count > 1)  # the blocks
    layer = long_llama.layers[next(i for i, la in enumerate(long_llama.layers) if la.name == one.runs[ri].name)]
    kv = kv_exchange_bytes(long_llama, layer, tp=1, micro_batch=2, elem=2)
    repeated = kv_exchange_bytes(long_llama, layer, tp=1, micro_batch=2, elem=2, repeated=True)
    assert repeated == kv * 4  # llama3-8b: 32 query heads, 8 key/value heads
    # full recompute keeps the layer input only: exactly 1/cp; none keeps the gathered K/V (at the KV heads) in
    # place of the shard's K/V that capture counts repeated to the query heads; op_sac keeps all it gathers
    assert eight.runs[ri].act_bytes[-1] == pytest.approx(one.runs[ri].act_bytes[-1] / 8)
    assert eight.runs[ri].act_bytes[0] == pytest.approx(one.runs[ri].act_bytes[0] / 8 + kv - repeated / 8)
    # the all-gather and reduce-scatter of the K/V over 8 ranks inside a node (ring: (K−1)/K · n / β each)
    link = cluster.intra_node
    ring = 2 * (7 / 8 * kv / link.bandwidth_Bps)
    assert eight.runs[ri].tp_comm_s[0] >= ring
    assert eight.runs[ri].compute_s[0] < one.runs[ri].compute_s[0] / 8 * 1.1


def test_cp_attention_is_priced_as_rectangles_of_full_tiles(long_llama):
    """Under cp a rank's query chunks attend c × (g+1)·c rectangles, causal only in their last c × c block:
    c²·(2·cp + 1) scores, (2·cp + 1)/(4·cp) of its share of the full matrix at the rate of kernels that compute
    every tile, in place of the layer's causal kernels (priced for a whole-sequence triangle)."""
    cluster = Cluster.preset("dgx-h100", nodes=2)
    costs = CostModel.for_cluster(long_llama, cluster)
    cand = Candidate(tp=1, pp=1, dp=2, zero_stage=3, micro_batch_size=2, num_microbatches=1, schedule="1f1b",
                     virtual_stages=1, sequence_parallel=False, cp=8)
    run = costs.problem(cand, ("none",)).runs
    ri = next(i for i, r in enumerate(run) if r.count > 1)
    share = cand.tokens_share
    causal = costs.compute.attention_s(ri, 1, False, share)
    full = costs.compute.attention_s(ri, 1, False, share, causal=False)
    assert 0.5 < causal / full < 0.6  # the layer's causal kernels: ~half the full matrix, diagonal overheads
    other = costs.compute.run(ri, 1, False, share).compute_s - causal
    assert run[ri].compute_s[0] == pytest.approx(other + full * 17 / 32, rel=1e-9)


def test_long_sequences_choose_context_parallelism(long_llama):
    # at 131,072 tokens (2 sequences on 16 H100) cp wins by ~2%; at 65,536 the best cp layout and tp4·dp4 with
    # op_sac are within 0.5% of each other, and which wins turns on the precision policy's bytes
    model, x = autopar.zoo.build("llama3-8b", seq_len=131072)
    longer = autopar.capture(model, x)
    cluster = Cluster.preset("dgx-h100", nodes=2)
    plan = autopar.plan(longer, cluster, global_batch_size=2, options=PlannerOptions(top_k=1))
    assert plan.config.cp > 1 and plan.estimate.fits
    # without cp the best layout is slower (it must recompute or shard otherwise): exact search, gap 0
    flat = autopar.plan(longer, cluster, global_batch_size=2, options=PlannerOptions(cp=1, top_k=0))
    assert flat.estimate.step_time_s > plan.estimate.step_time_s
    # a cp = 1 layout that keeps every activation of 65,536 tokens breaks a memory row, named
    costs = CostModel.for_cluster(long_llama, cluster)
    cfg = ParallelConfig(tp=4, pp=1, dp=4, zero_stage=3, micro_batch_size=1, num_microbatches=1)
    over = price(costs, cfg)
    assert not over.solution.feasible and over.solution.violated.startswith("memory_rank")


def test_cp_degrees_need_attention_and_chunks_of_4096_tokens(long_llama):
    assert cp_degrees(long_llama, 16) == [1, 2, 4, 8]
    assert max(cp_degrees(long_llama, 4096)) == 65536 // (2 * 4096)
    model, x = autopar.zoo.build("llama3-8b", seq_len=8192)
    short = autopar.capture(model, x)
    assert cp_degrees(short, 8) == [1]


def test_kv_exchange_priced_alike_in_compiled_blocks_and_gathered_again_only_by_full_recompute(long_llama):
    """Codegen runs the K/V all-gather as one custom op in eager and compiled blocks alike: priced the same,
    kept by the selective policies (selective, op_sac), run again by full recompute (counted in
    tests/test_cp_compile.py)."""
    cluster = Cluster.preset("dgx-h100", nodes=2)
    costs = CostModel.for_cluster(long_llama, cluster)
    cand = Candidate(tp=1, pp=1, dp=2, zero_stage=3, micro_batch_size=1, num_microbatches=1, schedule="1f1b",
                     virtual_stages=1, sequence_parallel=False, cp=8)
    eager, compiled = (costs.problem(dataclasses.replace(cand, compile=c)).runs for c in (False, True))
    ri = next(i for i, r in enumerate(eager) if r.count > 1)
    layer = costs.memory.runs[ri][0]
    n = kv_exchange_bytes(long_llama, layer, tp=1, micro_batch=1, elem=costs.memory.elem)
    gather = costs.comm.collective_s("all_gather", n, 8, 8)
    scatter = costs.comm.collective_s("reduce_scatter", n, 8, 8)
    assert gather > 0
    for runs, comp in ((eager, False), (compiled, True)):
        run = runs[ri]
        assert run.tp_comm_s == pytest.approx((gather + scatter,) * len(MODES), rel=1e-9)  # tp = 1: cp's only
        alone = costs.compute.run(ri, 1, False, cand.tokens_share, comp).recompute_s  # the kernels run again
        again = {m: gather if m == "full" else 0.0 for m in MODES}
        assert run.recompute_s == pytest.approx(tuple(a + again[m] for a, m in zip(alone, MODES, strict=True)),
                                                rel=1e-9)
    assert compiled[ri].compute_s[0] < eager[ri].compute_s[0]  # its pointwise chains fused


def test_the_planner_compiles_blocks_under_context_parallelism():
    """With compile left to the planner (compile=None), a long-context layout is planned with compiled blocks
    when they are faster, as without cp."""
    model, x = autopar.zoo.build("llama3-8b", seq_len=131072)
    longer = autopar.capture(model, x)
    cluster = Cluster.preset("dgx-h100", nodes=2)
    either = autopar.plan(longer, cluster, global_batch_size=2, options=PlannerOptions(cp=8, compile=None, top_k=1))
    eager = autopar.plan(longer, cluster, global_batch_size=2, options=PlannerOptions(cp=8, top_k=1))
    assert either.config.cp == 8 and either.config.compile and not eager.config.compile
    assert either.estimate.fits and either.estimate.step_time_s < eager.estimate.step_time_s
    pinned = autopar.plan(longer, cluster, global_batch_size=2, options=PlannerOptions(cp=8, compile=True, top_k=1))
    assert pinned.config.cp == 8 and pinned.config.compile  # refused before (ConfigError / a pin rule)
