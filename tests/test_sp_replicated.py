"""Sequence parallelism beside what tensor parallelism keeps whole (issue 36 §3).

Under SP a block's stream is one rank's shard of the sequence. Attention that no TP pattern splits (Phi-3's
fused q|k|v of unequal widths, OLMoE's q/k norms over all heads) needs every position, so a block holding it
runs on the full sequence (gathered at its input, split after it: Llama with a Phi-3 block in the middle),
and a model none of whose blocks can run on a shard gets no SP (the plan says why; pinning it is refused
before training, naming the block). A gated shared expert reads the MoE block's flattened tokens [b·s, h]
(Qwen2-MoE), gathered along them; a conv net (ConvNeXt: dim 1 is channels or height, not a sequence) is
never sequence-split, and its channels-last pointwise MLP trains under tp.

One gloo job of 2 ranks: each family planned by `autopar.plan` itself (tp=2 pinned, fp32; sequence
parallelism its own choice; Qwen2-MoE and the mixed model, for which it may choose SP, with SP pinned on);
3 AdamW steps each,
compared with one process (tests/test_parity.py's checks: losses, weights, gradients within rtol 1e-4 /
atol 1e-5). The first step's all-gathers equal what the cost model prices (planner/tp_costs.py), the full-
sequence block's gather and split included. On bc8ec31 each family failed: the planner turned SP on for
Phi-3 (a shape error in the first step) and gave no reason for OLMoE, pinned SP crashed Qwen2-MoE's shared
expert and the mixed model, ConvNeXt was refused under tp.
"""

from __future__ import annotations

import dataclasses

import pytest
from dist_harness import run_distributed
from parity_models import build_model, graph_of, make_plan, optimizer
from test_parity import _check

import autopar
from autopar.capture.sequence import sequence_span
from autopar.cluster import Cluster
from autopar.errors import InfeasiblePlanError, PlanMismatchError
from autopar.planner.costs import CostModel
from autopar.planner.space import Candidate
from autopar.planner.tp_costs import tp_collectives

PLANNER = dict(planner=True, tp=2)
PINNED = dict(PLANNER, sequence_parallel=True)
# Qwen2-MoE and the mixed model with SP pinned on: the planner may pick SP for them, but need not here
LM_CASES = [("phi3", PLANNER), ("olmoe", PLANNER), ("qwen2_moe", PINNED), ("mixed_attention", PINNED)]
KIND_CASES = [("convnext", PLANNER)]
REFUSED = (("phi3", dict(tp=2, sequence_parallel=True, precision="fp32")),)
NO_SP = {"phi3": "'model.layers.0' runs attention that tensor parallelism keeps whole",
         "olmoe": "'model.layers.0' runs attention that tensor parallelism keeps whole",
         "convnext": "input is not a sequence of tokens"}


@pytest.mark.multiproc
def test_planner_choice_of_sequence_parallelism_trains_as_one_process():
    from parity_kinds import lm_and_kind_cases

    per_rank = run_distributed(lm_and_kind_cases, 2, LM_CASES, KIND_CASES, 3, REFUSED, timeout_s=600)
    for rank in per_rank:  # pinned SP on Phi-3: refused on every rank, before training, naming the block
        refusal = rank.pop()["refused"]
        assert refusal and refusal.startswith("InfeasiblePlanError: sequence_parallel=True is not possible"), refusal
        assert "'model.layers.0' runs attention that tensor parallelism keeps whole" in refusal, refusal
    results = per_rank[0]
    _check(results)
    for other in per_rank[1:]:
        assert [r["losses"] for r in other] == [r["losses"] for r in results]
    for (kind, pins), r in zip(LM_CASES + KIND_CASES, results, strict=True):
        if kind in NO_SP:  # the planner turned SP off for the model and says why
            assert not r["sequence_parallel"], r["config"]
            assert any(n.startswith("sequence parallelism off") and NO_SP[kind] in n for n in r["notes"]), r
        if pins.get("sequence_parallel"):
            assert r["sequence_parallel"], r["config"]
        assert r["gathered_bytes"] == r["planned_gathered_bytes"], r  # what ran is what the planner priced
    mixed = results[LM_CASES.index(("mixed_attention", PINNED))]
    assert any("1 layer (model.layers.1) runs on the full sequence" in n for n in mixed["notes"]), mixed["notes"]


@pytest.mark.parametrize("kind", ["phi3", "olmoe"])
def test_pinned_sequence_parallelism_refused_naming_the_block(kind):
    model = build_model(kind)
    graph = graph_of(kind, model)
    with pytest.raises(InfeasiblePlanError, match=r"sequence_parallel=True is not possible: .*'model\.layers\.0'"):
        autopar.plan(graph, Cluster.local(nproc=2), global_batch_size=8,
                     options=autopar.PlannerOptions(tp=2, sequence_parallel=True, precision="fp32"))
    # a plan with SP made elsewhere (by hand, or for another model) stops before training, on every rank
    with pytest.raises(PlanMismatchError, match=r"sequence_parallel is on but .*'model\.layers\.0'"):
        autopar.codegen.parallelize(model, make_plan(graph, tp=2, sequence_parallel=True), graph=graph,
                                    optimizer=optimizer)


def test_full_sequence_block_priced_at_the_full_sequence():
    """The mixed model's Phi-3 block under SP: activations and kernels as without SP, its TP collectives as
    without SP plus an all-gather of the hidden states each way; a Llama block beside it keeps SP's savings."""
    graph = graph_of("mixed_attention", build_model("mixed_attention"))
    span = sequence_span(graph)
    assert span.whole_layers == ("model.layers.1",)
    assert span.sharded_layers == ("model.layers.0", "model.layers.2", "model.norm") and span.gather_after is None
    whole, split = graph.layer("model.layers.1"), graph.layer("model.layers.0")
    hidden = 16 * 64 * 4  # one sample's [seq, hidden] in fp32
    plain = tp_collectives(graph, whole, tp=2, sp=False, micro_batch=2)
    assert sorted(tp_collectives(graph, whole, tp=2, sp=True, micro_batch=2)) == sorted(
        [*plain, ("all_gather", "forward", 2 * hidden), ("all_gather", "backward", 2 * hidden)])
    costs = CostModel.for_cluster(graph, Cluster.local(nproc=2), precision="fp32")
    base = Candidate(tp=2, pp=1, dp=1, zero_stage=0, micro_batch_size=8, num_microbatches=1, schedule="1f1b",
                     virtual_stages=1, sequence_parallel=False, precision="fp32")
    runs = {sp: {r.name: r for r in costs.problem(dataclasses.replace(base, sequence_parallel=sp)).runs}
            for sp in (False, True)}
    assert runs[True][whole.name].act_bytes == runs[False][whole.name].act_bytes
    assert runs[True][whole.name].compute_s == runs[False][whole.name].compute_s
    assert runs[True][whole.name].tp_comm_s[0] > runs[False][whole.name].tp_comm_s[0]
    assert runs[True][split.name].act_bytes[0] < runs[False][split.name].act_bytes[0]


def test_no_sequence_no_sequence_parallelism():
    """A conv net's [batch, channels, h, w]: no sequence, so SP is refused when pinned, saying why."""
    from hf_kinds import build_kind, example

    graph = autopar.capture(build_kind("convnext"), (), example("convnext"))
    assert graph.seq_len is None
    with pytest.raises(InfeasiblePlanError, match="not a sequence of tokens"):
        autopar.plan(graph, Cluster.local(nproc=2), global_batch_size=8,
                     options=autopar.PlannerOptions(tp=2, sequence_parallel=True))


def test_a_failure_inside_a_sequence_sharded_layer_names_sequence_parallelism():
    """Code that sizes a tensor from its input's length (the zoo Llama's blocks narrow their rotary tables to
    x.size(1)) fails on a sequence shard: the advice is to turn SP off, not tp (the issue's wrong advice)."""
    from autopar.codegen.tensor_parallel import _explain_failures
    from autopar.errors import PlanMismatchError

    def forward():
        raise RuntimeError("The size of tensor a (16) must match the size of tensor b (8) at non-singleton dimension 2")

    with pytest.raises(PlanMismatchError, match=r"under sequence parallelism .*\(sequence_parallel=False\)"):
        _explain_failures("layers.0.attention", True)(forward)()
    with pytest.raises(PlanMismatchError, match=r"under tensor parallelism .* tp=1"):
        _explain_failures("layers.0.attention", False)(forward)()
