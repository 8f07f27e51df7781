"""The seams between ways to plan and ways to train (issue 36): every plan source × loss mode trains.

For each pinned degree (dp2, tp2 with the planner's own choice of sequence parallelism, pp2), transformers'
Llama and a self-written model are planned by the CLI, by `autopar.plan(model)` and by
`autopar.plan(autopar.capture(model, x))`, each with and without `loss_fn`, and each plan trains under 2 gloo
ranks with and without `loss_fn` (24 runs per layout, tests/journeys.py): losses at every step and final
weights against one process trained on the same loss, rtol 1e-4 / atol 1e-5. A plan priced under one loss
and trained under the other says so and trains (autopar/planner/plan_fit.py); a plan for another model is
refused naming what differs.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_distributed
from journeys import LOSSES, MODELS, SOURCES, journeys, make_plans
from parity_models import ATOL, RTOL

LAYOUTS = {"dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2)}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_plan_source_trains_under_every_loss(layout, tmp_path):
    plans = make_plans(LAYOUTS[layout], tmp_path)
    assert len(plans) == len(MODELS) * len(SOURCES) * len(LOSSES)
    per_rank = run_distributed(journeys, 2, plans, timeout_s=900.0)
    failures = []
    for r in per_rank[0]:
        if not all(math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL) for a, b in zip(r["losses"], r["ref_losses"],
                                                                                  strict=True)):
            failures.append(f"{r['case']}: losses {r['losses']} vs one process {r['ref_losses']}")
        if r["weight_excess"] > ATOL:
            failures.append(f"{r['case']}: weight {r['weight_key']} off by {r['weight_excess']:.2e} beyond rtol")
    assert not failures, "\n".join(failures)
    assert [r["losses"] for r in per_rank[1]] == [r["losses"] for r in per_rank[0]]


def _llama_graphs():
    from journeys import llama

    import autopar

    model, x = llama()
    return model, x, autopar.capture(model, x, own_loss=True), autopar.capture(model, x)


def test_a_plan_under_another_loss_is_accepted_and_priced_apart():
    """The plan's loss mode is recorded beside its fingerprint; check_plan_for_graph returns the graph the plan was
    priced on (the model recaptured under the plan's loss) and the note gives the difference."""
    import autopar
    from autopar import Cluster
    from autopar.planner.plan_fit import check_plan_for_graph, loss_switch_note

    _, _, own, external = _llama_graphs()
    assert (own.loss_mode, external.loss_mode) == ("own:labels", "loss_fn")
    assert own.fingerprint != external.fingerprint
    plan = autopar.plan(own, Cluster.local(nproc=1), global_batch_size=8)
    assert plan.loss_mode == "own:labels"
    assert autopar.Plan.from_dict(plan.to_dict()).loss_mode == "own:labels"
    asked = []
    priced = check_plan_for_graph(plan, external, recapture=lambda mode: asked.append(mode) or own)
    assert priced is own and asked == ["own:labels"]
    note = loss_switch_note(plan, priced, external, plan.config.micro_batch_size)
    saved = (external.saved_activation_bytes - own.saved_activation_bytes) * plan.config.micro_batch_size
    assert "its own loss (labels=" in note and "a loss_fn of its logits" in note and "lm_head" in note
    assert f"{saved / 2**20:+.3f} MiB of saved activations" in note
    assert loss_switch_note(plan, own, own, 1) is None


def test_a_plan_for_another_model_names_what_differs():
    """Not the same class named twice with advice to do what the user did: the layer count and sequence length."""
    from hf_families import _families

    import autopar
    from autopar import Cluster
    from autopar.errors import PlanMismatchError
    from autopar.planner.plan_fit import check_plan_for_graph

    _, _, own, _ = _llama_graphs()
    plan = autopar.plan(own, Cluster.local(nproc=1), global_batch_size=8)
    torch.manual_seed(0)
    deeper = _families()["llama"]()
    deeper.config.num_hidden_layers = 3
    import transformers

    deeper = transformers.LlamaForCausalLM(deeper.config)
    other = autopar.capture(deeper, (torch.zeros(1, 24, dtype=torch.long),), own_loss=True)
    with pytest.raises(PlanMismatchError, match=r"layers .* are not this model's .*; it is for 16 tokens per sample, "
                                                r"the example inputs have 24"):
        check_plan_for_graph(plan, other, recapture=lambda mode: None)


@pytest.mark.parametrize("given", ["llama3-8b", "graph"])
def test_parallelize_refuses_a_name_or_a_graph_before_anything_runs(given):
    """A name or a graph plans; only a module with weights trains (not a failure deep in codegen)."""
    import autopar
    from autopar import Cluster
    from autopar.errors import AutoparError

    model = given if given != "graph" else _llama_graphs()[2]
    with pytest.raises(AutoparError, match="parallelize trains the model itself .* pass the nn.Module"):
        autopar.parallelize(model, Cluster.local(nproc=1), optimizer=lambda p: None, global_batch_size=8)
