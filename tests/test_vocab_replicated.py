"""A vocabulary that tp does not divide stays whole; the rest of the model is split (autopar.capture.vocab_split).

GPT-2's 50,257 token ids refused tp=2 for the whole model. Now an embedding or LM head (or a tied pair) whose
vocabulary the degree does not divide stays replicated on every tp rank while the blocks' heads and MLPs are
split. Checked: tp2 on 2 gloo ranks trains as one process does (3 AdamW steps, rtol 1e-4) for a GPT-2-shaped
model (the zoo's: learned positions, untied head) and Llama (untied, and tied under sequence parallelism) with a
129-id vocabulary, with the head and embedding plain tensors, the blocks DTensors and the loss on full logits; the
pricing of the replicated head (parameters, FLOPs, logits whole per rank, no vocab-parallel collectives) against
arithmetic; the planner's tp list, refusals and plan note.
"""

from __future__ import annotations

import pytest
from dist_harness import run_distributed
from parity_models import BATCH, ODD_VOCAB, SEQ, build_model, graph_of, make_plan, parity_cases
from test_parity import _check

import autopar
from autopar import Cluster, PlannerOptions
from autopar.capture.vocab_split import layer_at_tp, vocab_parallel_head, whole_vocab_patterns
from autopar.planner.costs import CostModel
from autopar.planner.rules import tp_invalid
from autopar.planner.space import Candidate, tp_degrees
from autopar.planner.tp_costs import tp_collectives
from cost_models import memory as cm

STEPS = 3
CASES = [("gpt_odd_vocab", dict(tp=2)), ("gpt_odd_vocab", dict(tp=2, sequence_parallel="planner")),
         ("llama_odd_vocab", dict(tp=2)), ("llama_odd_vocab", dict(tp=2, sequence_parallel="planner")),
         ("llama_tied_odd_vocab", dict(tp=2, sequence_parallel="planner")), ("gpt2_odd_vocab", dict(tp=2))]


def _placements(kind: str, config: dict) -> dict:
    """Which parameters tp2 made DTensors, and whether the loss runs vocab-parallel."""
    from parity_models import optimizer
    from torch.distributed.tensor import DTensor

    from autopar.codegen import lm_cross_entropy, parallelize

    model = build_model(kind)
    graph = graph_of(kind, model)
    pm = parallelize(model, make_plan(graph, **config), graph=graph, optimizer=optimizer, loss_fn=lm_cross_entropy)
    names = {n: isinstance(p, DTensor) for n, p in pm.modules[0].named_parameters()}
    return {"dtensor": names, "vocab_parallel": pm.vocab_parallel, "sp": pm.config.sequence_parallel}


def _cases() -> tuple[list, list]:
    return parity_cases(CASES, STEPS), [_placements(k, c) for k, c in CASES]


@pytest.mark.multiproc
def test_odd_vocabulary_trains_under_tp2_as_one_process():
    per_rank = run_distributed(_cases, 2, timeout_s=600)
    results, placed = per_rank[0]
    _check(results)
    assert [r["losses"] for r in per_rank[1][0]] == [r["losses"] for r in results]
    for r in results:  # the all-gathers a step issues are those priced (SP's gather before the whole head)
        assert r["gathered_bytes"] == r["planned_gathered_bytes"], r["case"]
    assert [p["sp"] for p in placed] == [False, True, False, True, True, False]  # the planner allows SP there
    for (kind, _), p in zip(CASES, placed, strict=True):
        dt = p["dtensor"]
        whole = [n for n in dt if "wte" in n or "embed_tokens" in n or "lm_head" in n]
        split = [n for n in dt if any(s in n for s in ("q_proj", "o_proj", "up_proj", "down_proj", "qkv", "fc"))]
        assert whole and not any(dt[n] for n in whole), (kind, whole)
        if kind == "gpt2_odd_vocab":  # its Conv1D blocks are not split either: nothing is
            assert not any(dt.values()), kind
        else:
            assert split and all(dt[n] for n in split), (kind, split)
        assert not p["vocab_parallel"]


def _graph(kind: str):
    return graph_of(kind, build_model(kind))


def test_pricing_the_whole_head_against_arithmetic():
    """At tp2 the 129-id head and embedding are priced whole on each rank: parameters V·h (and the embedding's),
    FLOPs 2·V·h per token forward, logits B·S·V, no vocab-parallel collective; the blocks are split as ever."""
    graph = _graph("llama_odd_vocab")
    costs = CostModel.for_cluster(graph, Cluster.local(nproc=2))
    mem, comp = costs.memory, costs.compute
    names = [la.name for la in graph.layers]
    head_ri = next(i for i, g in enumerate(mem.runs) if g[0].kind == "head")
    emb_ri = next(i for i, g in enumerate(mem.runs) if g[0].kind == "embedding")
    block_ri = next(i for i, g in enumerate(mem.runs) if g[0].kind == "block")
    head, emb = mem.runs[head_ri][0], mem.runs[emb_ri][0]
    h = graph.hidden_size
    assert head.num_params == ODD_VOCAB * h and emb.num_params == ODD_VOCAB * h
    assert mem.run_local_params(head_ri, 2) == ODD_VOCAB * h  # whole, not V·h / 2
    assert mem.run_local_params(emb_ri, 2) == ODD_VOCAB * h
    assert mem.run_local_params(block_ri, 2) < graph.layer(names[1]).num_params  # blocks split
    # FLOPs: the head's GEMM (2·V·h per token) whole on each rank, none of it divided by tp
    at2 = layer_at_tp(head, 2)
    assert at2.forward_flops_tp_sharded == 0 and head.forward_flops_tp_sharded >= 2 * ODD_VOCAB * h * SEQ
    assert not any(k.tp_sharded for k in (*at2.kernels_forward.kernels, *at2.kernels_backward.kernels))
    assert comp.run(head_ri, 2, False, 1).compute_s == pytest.approx(comp.run(head_ri, 1, False, 1).compute_s)
    # the blocks' run is cheaper at tp2 than at tp1 (their GEMMs halve)
    assert comp.run(block_ri, 2, False, 1).compute_s < comp.run(block_ri, 1, False, 1).compute_s
    # no collective for the head or the embedding (no vocab-parallel all-reduces, no loss all-reduces)
    for ri in (head_ri, emb_ri):
        assert tp_collectives(graph, mem.runs[ri][0], tp=2, sp=False, micro_batch=1) == ()
    # logits: B·S·V whole on the last rank, the plain loss (not the vocab-parallel one's held copy)

    cand = Candidate.of(make_plan(graph, tp=2).config)  # one micro-batch of BATCH on one tp2 pair
    want = cm.logits_bytes(micro_batch=BATCH, seq_len=SEQ, vocab=ODD_VOCAB, tp=1, dtype_bytes=4,
                           loss_kernel=mem.loss_kernel, held=False)  # the runtime's loss (chunked)
    assert mem.loss_kernel == "chunked" and want >= BATCH * SEQ * ODD_VOCAB * 4
    assert mem.rank_memory(cand)[0].logits_bytes == want


def test_planner_keeps_the_degree_and_notes_the_whole_vocabulary():
    graph = _graph("llama_odd_vocab")
    assert [(la.name, p.kind) for la, p in whole_vocab_patterns(graph, 2)] == [
        ("model.embed_tokens", "embedding"), ("lm_head", "lm_head")]
    assert not vocab_parallel_head(graph, 2) and tp_degrees(graph, 2) == [1, 2]
    assert tp_invalid(graph, 2, devices_per_node=2, world_size=2) is None
    plan = autopar.plan(graph, Cluster.local(nproc=2), global_batch_size=BATCH,
                        options=PlannerOptions(tp=2, top_k=0, precision="fp32"))
    assert plan.config.tp == 2
    assert any("vocabulary 129 is not divisible by tp=2: the embedding and LM head stay replicated on every tp "
               "rank" in n for n in plan.estimate.notes), plan.estimate.notes
    # head counts that tp does not divide still refuse it
    assert "does not split every head count" in tp_invalid(graph, 4, devices_per_node=4, world_size=4)


def test_a_model_only_its_vocabulary_could_split():
    """HF GPT-2's blocks are Conv1D (no column→row linear pair capture splits): at an odd vocabulary tp splits
    nothing. The search leaves such a degree out; pinned, it is planned with a note that says so and the
    padding that would let it split (it trains as one process does: the parity case above)."""
    graph = _graph("gpt2_odd_vocab")
    assert tp_degrees(graph, 2) == [1]
    plan = autopar.plan(graph, Cluster.local(nproc=2), global_batch_size=BATCH,
                        options=PlannerOptions(tp=2, top_k=0, precision="fp32"))
    notes = " ".join(plan.estimate.notes)
    assert plan.config.tp == 2 and "tp=2 as pinned splits nothing of GPT2LMHeadModel" in notes, notes
    assert "vocab_size=256" in notes and "vocabulary 129 is not divisible by tp=2" in notes
    free = autopar.plan(graph, Cluster.local(nproc=2), global_batch_size=BATCH,
                        options=PlannerOptions(top_k=0, precision="fp32"))
    assert free.config.tp == 1
