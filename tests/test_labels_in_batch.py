"""A batch as a data collator yields it — `{"input_ids", "attention_mask", "labels"}` — trains on the model's own
loss with `train_step(batch)`: the labels are taken out of the dict and go where targets passed apart go (split
into micro-batches, fed to every pipeline stage, the loss vocab-parallel under tensor parallelism), and the
global mean over counted tokens (-100 ignored) is one process's `model(**batch).loss`.

tests/collator_batches.py: Qwen2 (decoder), BERT (masked LM, a micro-batch without any masked token) and BART
(labels without decoder ids, shifted into them by the model) under dp2 (ZeRO-3, 2 micro-batches per rank), tp2
(2 micro-batches) and pp2 (1F1B; BART cut after its decoder's token embedding, so both stages read the labels),
one gloo job of 2 ranks per layout: losses at every step, eval_loss, final weights and last gradients within
rtol 1e-4 / atol 1e-5 after 3 AdamW steps. The fast tests: the example with labels captures the program plan
and estimate price for targets passed apart; targets given both ways are refused naming both places; a
failing check of the model's own loss keeps the model's error.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_distributed
from test_parity import ATOL, RTOL, _check

import autopar
from autopar.errors import AutoparError, PlanMismatchError

LAYOUTS = {"dp2": dict(dp=2, zero_stage=3, num_microbatches=2), "tp2": dict(tp=2, num_microbatches=2),
           "pp2": dict(pp=2, num_microbatches=2, schedule="1f1b")}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_labels_inside_the_batch_train_as_one_process(layout):
    from collator_batches import FAMILIES, labels_cases

    per_rank = run_distributed(labels_cases, 2, [(name, LAYOUTS[layout]) for name in FAMILIES], timeout_s=600)
    _check(per_rank[0])
    for r in per_rank[0]:
        assert math.isclose(r["eval_loss"], r["ref_eval_loss"], rel_tol=RTOL, abs_tol=ATOL), r
        assert r["vocab_parallel"] == (layout == "tp2"), r  # the loss over vocab-sharded logits under tp
        assert len(r["refusals"]) == 2, r  # no targets anywhere; targets both ways (and no step taken)
        assert "got no targets; pass them as its second argument, or in the inputs dict as 'labels'" in \
            r["refusals"][0], r
        assert "train_step got the targets twice: in the batch dict as 'labels' and as its targets argument" in \
            r["refusals"][1], r
    for other in per_rank[1:]:  # the reported loss is the global mean on every rank
        assert [r["losses"] for r in other] == [r["losses"] for r in per_rank[0]]


def _batch():
    ids = torch.randint(4, 128, (2, 16))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def test_targets_given_both_ways_are_refused_naming_both_places():
    from autopar.capture.targets import targets_in_batch

    batch = _batch()
    with pytest.raises(AutoparError, match=r"train_step got the targets twice: in the batch dict as 'labels' and "
                                           r"as its targets argument; pass one"):
        targets_in_batch(batch, batch["labels"], "labels", where="train_step")
    inputs, targets = targets_in_batch(batch, None, "labels", where="train_step")
    assert set(inputs) == {"input_ids", "attention_mask"} and targets is batch["labels"]
    assert targets_in_batch(batch, None, None, where="train_step") == (batch, None)  # trained on a loss_fn


def test_the_example_with_labels_captures_the_program_plans_price():
    """Labels in the example dict: the same graph as the example without them, with the example targets capture
    gives a model trained on its own loss (so plan and estimate price what trains)."""
    from hf_families import build_family

    model = build_family("qwen2")
    batch = _batch()
    batch["labels"][:, :3] = -100
    apart = {k: v[:1] for k, v in batch.items() if k != "labels"}
    inside = {k: v[:1] for k, v in batch.items()}
    graph = autopar.capture(model, (), apart, own_loss=True)
    assert autopar.capture(model, (), inside, own_loss=True).fingerprint == graph.fingerprint
    cluster = autopar.Cluster.local(nproc=2)
    plan = autopar.plan(model, cluster, example_kwargs=inside, global_batch_size=4)
    assert plan.graph_fingerprint == graph.fingerprint
    est = autopar.estimate(model, cluster, plan.config, example_kwargs=inside)
    assert est.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-9)


def test_a_failing_own_loss_check_keeps_the_models_error():
    """The error a forward raises is kept whole, with a module's repr (Python names a called object by it)
    shortened to its class; given example targets that do not fit, the message says so rather than blaming
    targets shaped like the input."""
    from own_models import build_own
    from test_model_loss import X, _Classifier

    from autopar.capture.targets import failure_text
    from autopar.codegen.model_loss import check_model_loss

    model = build_own("functional_lm")
    with pytest.raises(TypeError) as twice:
        model(X[0], **{"labels": X[0]}, **{"labels": X[0]})
    assert failure_text(twice.value, model) == "TypeError: FunctionalLM got multiple values for keyword argument " \
                                               "'labels'"
    wrong = torch.zeros(3, dtype=torch.long)  # class labels for 3 samples, the batch has 2
    with pytest.raises(PlanMismatchError, match=r"with the example's labels, and it failed: ValueError: Expected "
                                                r"input batch_size \(2\) to match target batch_size \(3\)") as err:
        check_model_loss(_Classifier(), "labels", X, {}, wrong)
    assert "shaped like" not in str(err.value) and "_Classifier(" not in str(err.value)
