"""Pins are the user's decision (autopar.planner.rules): a pinned value that only a rule of thumb keeps out of the
search is planned, priced as it runs and noted in the plan; a pin that cannot run is refused naming the pin,
the rule and the values that pass.

Rules of thumb: cp chunks of ≥ MIN_CP_CHUNK tokens, virtual stages ≤ max_virtual_stages. Hard rules, each
refused by name: cp without attention over a sequence or with fewer tokens than chunks, cp with compiled
blocks, tp that does not split the heads or leaves the node, pp past the layers, degrees that do not fit the
devices, dp that does not divide the batch, pins that exclude each other.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from test_planner import fake_cluster, gpt_graph

import autopar
from autopar.cli.main import main
from autopar.cluster import Cluster
from autopar.config import ParallelConfig, PlannerOptions
from autopar.errors import InfeasiblePlanError
from autopar.plan import Plan
from autopar.planner.space import MIN_CP_CHUNK
from autopar.report.text import render_plan

SEQ = 64  # the tiny Llama's max positions (tests/hf_families.py); chunks of 16 under cp2, far below 4,096
BATCH = 8


@pytest.fixture(scope="module")
def llama_graph():
    from hf_families import build_family

    return autopar.capture(build_family("llama"), (torch.zeros(1, SEQ, dtype=torch.long),))


def test_pinned_cp_on_a_short_sequence_is_planned_with_a_note(llama_graph):
    cluster = Cluster.local(nproc=2)
    plan = autopar.plan(llama_graph, cluster, global_batch_size=BATCH, options=PlannerOptions(cp=2, top_k=1))
    assert plan.config.cp == 2 and plan.config.world_size == 2
    note = next(n for n in plan.estimate.notes if n.startswith("cp=2 as pinned"))
    assert f"2 chunks of {SEQ // 4} tokens" in note and f"{MIN_CP_CHUNK:,}-token chunks" in note
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and note in again.estimate.notes  # the note round-trips in the plan's JSON
    assert f"note            {note}" in render_plan(plan)  # and `autopar plan` / `autopar show` print it
    # the rule of thumb still bounds the search: unpinned, cp stays 1 at 64 tokens, and no such note
    free = autopar.plan(llama_graph, cluster, global_batch_size=BATCH, options=PlannerOptions(top_k=0))
    assert free.config.cp == 1 and not any("as pinned" in n for n in free.estimate.notes)
    # estimate of the same layout says the same
    est = autopar.estimate(llama_graph, cluster, plan.config)
    assert note in est.notes


def test_cli_plan_with_cp_on_a_short_sequence(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--cluster", "local", "--nproc", "2", "--global-batch-size", "4",
                 "--seq-len", "64", "--cp", "2", "--top", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert Plan.load(out).config.cp == 2 and "note            cp=2 as pinned" in printed
    assert main(["show", str(out)]) == 0
    assert "cp=2 as pinned: each rank holds 2 chunks of 16 tokens" in capsys.readouterr().out


def test_pinned_virtual_stages_past_the_search_limit_are_planned_with_a_note():
    graph = gpt_graph(layers=8, hidden=256, heads=8, seq=128, vocab=4096)
    options = PlannerOptions(pp=2, virtual_stages=3, num_microbatches=4, max_virtual_stages=2, top_k=0)
    plan = autopar.plan(graph, fake_cluster(per_node=2), global_batch_size=4, options=options)
    assert (plan.config.schedule, plan.config.virtual_stages) == ("interleaved_1f1b", 3)
    assert any("virtual_stages=3 as pinned, above max_virtual_stages=2" in n for n in plan.estimate.notes)


def _refusals():
    g = gpt_graph(layers=4, hidden=256, heads=16, seq=128, vocab=4096)  # 6 layers with embedding and head
    eight = fake_cluster(per_node=8)
    return [
        # (graph, cluster, batch, options, what the message must say)
        (dataclasses.replace(g, seq_len=None), eight, 8, PlannerOptions(cp=2),
         r"cp=2 splits each sequence .* has no sequence dimension in its inputs: leave cp unset or 1"),
        (gpt_graph(layers=4, hidden=256, heads=16, seq=8, vocab=4096), eight, 8, PlannerOptions(cp=8),
         r"cp=8 splits each sequence into 2·cp = 16 chunks, but .* hold 8 tokens .*pin cp ≤ 4 or plan longer"),
        (g, eight, 8, PlannerOptions(tp=3), r"tp=3 does not split every head count .*heads \[16\].*possible tp"),
        (g, fake_cluster(nodes=2, per_node=8), 8, PlannerOptions(tp=16),
         r"tp=16 is not possible on 16 devices of 8 per node: .*divide the devices of a node.*possible tp: "
         r"\[1, 2, 4, 8\]"),
        (g, fake_cluster(nodes=2, per_node=8), 16, PlannerOptions(pp=16),
         r"pp=16 exceeds the 6 layers of synthetic-gpt .*possible pp: \[1, 2, 4\]"),
        (g, eight, 8, PlannerOptions(tp=2, pp=2, dp=4), r"tp=2 · pp=2 · dp=4 = 16 do not fit the 8 devices"),
        (g, eight, 4, PlannerOptions(dp=8), r"dp=8 does not divide the global batch 4 .*possible dp: \[1, 2, 4\]"),
        (g, eight, 8, PlannerOptions(tp=1, sequence_parallel=True), r"sequence_parallel=True .* needs tp > 1"),
        (g, eight, 8, PlannerOptions(dp=2, micro_batch_size=8),
         r"pinned options \(.*dp=2, micro_batch_size=8.*\) together .*change one of: dp=2 \(with the other pins: "
         r"dp ∈ \[1\]\), micro_batch_size=8 \(with the other pins: micro_batch_size ∈ \[1, 2, 4\]\)"),
    ]


@pytest.mark.parametrize("case", range(len(_refusals())))
def test_a_pin_that_cannot_run_is_refused_naming_the_rule(case):
    graph, cluster, batch, options, message = _refusals()[case]
    with pytest.raises(InfeasiblePlanError, match=message):
        autopar.plan(graph, cluster, global_batch_size=batch, options=options)


def test_estimate_refuses_a_cp_layout_that_cannot_run():
    graph = dataclasses.replace(gpt_graph(layers=2, hidden=256, heads=8, seq=128, vocab=4096), seq_len=None)
    with pytest.raises(InfeasiblePlanError, match=r"cp=2 splits each sequence"):
        autopar.estimate(graph, fake_cluster(per_node=2), ParallelConfig(cp=2))


# ---- CP through autopar.parallelize on a small model: one 2-rank gloo job ----

def _plan_cp2_and_train() -> dict:
    from parity_models import batches, build_model, excess, optimizer, train_reference

    from autopar.codegen import lm_cross_entropy
    from autopar.codegen.state import full_gradients

    data = batches(3, seq=SEQ)
    model = build_model("llama")  # transformers' LlamaForCausalLM; positions come from the rank's shard
    ref_losses, ref_state, ref_grads = train_reference(copy.deepcopy(model), data)
    pm = autopar.parallelize(model, Cluster.local(), example_inputs=(torch.zeros(1, SEQ, dtype=torch.long),),
                             optimizer=optimizer, loss_fn=lm_cross_entropy, global_batch_size=BATCH,
                             options=PlannerOptions(cp=2))
    losses = [pm.train_step(pm.local_batch(x), pm.local_batch(t)) for x, t in data]
    full = pm.full_state_dict()
    weight_excess, weight_key = excess(full, ref_state)
    grad_excess, grad_key = excess(full_gradients(pm.modules, pm.mesh["pp"]), ref_grads)
    return {"case": f"llama planned with cp=2 ({pm.config})", "cp": pm.config.cp, "losses": losses,
            "ref_losses": ref_losses, "weight_excess": weight_excess, "weight_key": weight_key,
            "grad_excess": grad_excess, "grad_key": grad_key,
            "missing": sorted(set(ref_state) - set(full)), "extra": sorted(set(full) - set(ref_state))}


@pytest.mark.multiproc
def test_parallelize_with_pinned_cp_trains_a_small_llama_like_one_process():
    from dist_harness import run_distributed
    from test_parity import _check

    per_rank = run_distributed(_plan_cp2_and_train, 2, timeout_s=600)
    assert [r["cp"] for r in per_rank] == [2, 2]
    _check([per_rank[0]])
    assert per_rank[1]["losses"] == per_rank[0]["losses"]
