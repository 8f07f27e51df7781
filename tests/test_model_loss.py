"""The model's own loss and tied weights, checked in one process: which forward argument takes the targets,
which losses split exactly over micro-batches and ranks (and the refusal for the others), and vocab-parallel
patterns found at any nesting with a tied weight split alike on every side."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from own_models import VOCAB, FunctionalLM, NanoGPT, TargetArgLM, build_own
from torch import nn

import autopar
from autopar.capture.targets import target_parameter
from autopar.codegen.model_loss import LossWatch, check_model_loss, loss_of
from autopar.errors import PlanMismatchError

X = (torch.randint(0, VOCAB, (2, 16)),)


def test_target_argument_is_found_or_named():
    assert target_parameter(NanoGPT(), None) == "targets"
    assert target_parameter(FunctionalLM(), None) == "labels"
    assert target_parameter(TargetArgLM(), None) is None  # its targets go to `y`: name it
    assert target_parameter(TargetArgLM(), "y") == "y"
    with pytest.raises(PlanMismatchError, match="takes no such argument.*x, y"):
        target_parameter(TargetArgLM(), "labels")


def test_loss_of_each_output_style():
    loss = torch.tensor(1.5)
    assert loss_of(loss) is loss
    assert loss_of((torch.zeros(2, 3), loss)) is loss
    assert loss_of({"loss": loss, "logits": torch.zeros(2)}) is loss
    with pytest.raises(PlanMismatchError, match="without one scalar loss"):
        loss_of(torch.zeros(2, 3))


@pytest.mark.parametrize("name, arg", [("nanogpt", "targets"), ("functional_lm", "labels"), ("target_arg_lm", "y")])
def test_own_losses_that_split_exactly_are_accepted(name, arg):
    check_model_loss(build_own(name), arg, X, {})


def test_watch_counts_the_targets_the_mean_averages_over():
    model = build_own("functional_lm")  # shifts its labels inside: the last position of each sample never counts
    labels = X[0].clone()
    labels[0, 3:] = -100
    with LossWatch() as watch:
        loss = loss_of(model(X[0], labels=labels))
    summed, count = watch.take(loss)
    assert int(count) == (16 - 1) + (3 - 1)  # sample 1: 15 shifted targets; sample 0: positions 1, 2
    assert torch.allclose(summed, loss * count)


class _TwoLosses(nn.Module):
    def __init__(self, extra: str) -> None:
        super().__init__()
        self.emb, self.head, self.extra = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB), extra

    def forward(self, x, targets=None):
        logits = self.head(self.emb(x)).flatten(0, 1)
        if self.extra == "two_calls":
            return F.cross_entropy(logits, targets.flatten()) + F.cross_entropy(logits, targets.flatten())
        if self.extra == "none":
            return F.cross_entropy(logits, targets.flatten(), reduction="none").mean()
        return F.cross_entropy(logits, targets.flatten()) + 0.01 * logits.pow(2).mean()  # an auxiliary term


@pytest.mark.parametrize("extra, why", [("two_calls", "2 cross-entropy/NLL calls"), ("none", "reduction='none'"),
                                        ("aux", "further code")])
def test_losses_that_cannot_be_split_are_refused_naming_why(extra, why):
    with pytest.raises(PlanMismatchError, match=why) as err:
        check_model_loss(_TwoLosses(extra), "targets", X, {})
    assert "loss_fn" in str(err.value)


def _vocab_patterns(graph):
    return {c: p.kind for la in graph.layers for p in la.tp_patterns if p.kind in ("embedding", "lm_head")
            for c in p.column}


def test_vocab_parallel_modules_found_at_any_nesting_and_ties_split_alike():
    nano = autopar.capture(build_own("nanogpt"), X, {"targets": X[0]})  # wte in a ModuleDict, tied to lm_head
    assert _vocab_patterns(nano) == {"transformer.wte": "embedding", "lm_head": "lm_head"}
    functional = autopar.capture(build_own("functional_lm"), X)  # embedding two attributes down, tied
    assert _vocab_patterns(functional) == {"body.embed": "embedding", "unembed": "lm_head"}


class _TiedIntoABlock(nn.Module):
    """The embedding's weight reused by a projection inside the stack of blocks: no pattern splits that
    projection's weight as the vocab-parallel embedding would, so the tie is kept replicated on both sides."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, VOCAB, bias=False), nn.Linear(VOCAB, 16))
                                     for _ in range(2)])
        self.blocks[1][0].weight = self.emb.weight
        self.head = nn.Linear(16, 32)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_a_tie_no_pattern_can_split_alike_stays_replicated():
    graph = autopar.capture(_TiedIntoABlock(), X)
    split = {m for la in graph.layers for p in la.tp_patterns for m in (*p.column, *p.row)}
    assert not split & {"emb", "blocks.1.0"}  # neither side of the tie is sharded
    assert graph.metadata.get("tied_weights_replicated") == ["blocks.1.0", "emb"]


def test_default_loss_on_logits_that_do_not_match_the_targets_says_to_pass_a_loss_fn():
    from autopar.codegen import lm_cross_entropy

    logits, _ = build_own("nanogpt")(X[0])  # without targets nanoGPT returns only the last position's logits
    with pytest.raises(PlanMismatchError, match=r"shape \(2, 1, 128\) for targets of shape \(2, 16\).*loss_fn"):
        lm_cross_entropy(logits, X[0])


def _head_forward_flops(graph) -> float:
    return graph.layers[-1].forward_flops


def test_plan_estimate_and_parallelize_capture_the_program_that_trains():
    """nanoGPT computes its head over every position only when given targets; without a loss_fn it trains on
    its own loss, so plan and estimate price that program (the head's matmul over all 16 positions, 2·d·V
    FLOPs per token) and make the graph parallelize checks the plan against; with a loss_fn, the one
    without targets."""
    model = build_own("nanogpt")
    seq, dim = X[0].shape[1], model.lm_head.in_features
    cluster = autopar.Cluster.local(nproc=2)
    plan = autopar.plan(model, cluster, example_inputs=X, global_batch_size=4)
    trains = autopar.capture(model, X, own_loss=True)
    assert plan.graph_fingerprint == trains.fingerprint
    assert _head_forward_flops(trains) >= 2 * dim * VOCAB * seq  # logits for every position (+ the loss)
    outer = autopar.capture(model, X)  # as called: the last position's logits only
    assert _head_forward_flops(outer) < 2 * dim * VOCAB * 2
    assert autopar.plan(model, cluster, example_inputs=X, global_batch_size=4,
                        loss_fn=F.cross_entropy).graph_fingerprint == outer.fingerprint
    est = autopar.estimate(model, cluster, plan.config, example_inputs=X)
    assert est.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-9)


def test_cli_plans_and_captures_a_model_with_its_own_loss(tmp_path, capsys):
    from autopar.cli.main import main

    factory = tmp_path / "nano.py"
    factory.write_text("import sys, torch\n"
                       f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                       "from own_models import VOCAB, build_own\n\n"
                       "def build(seq_len=16):\n"
                       "    return build_own('nanogpt'), (torch.randint(0, VOCAB, (2, seq_len)),)\n")
    out = tmp_path / "plan.json"
    assert main(["plan", f"{factory}:build", "--cluster", "local", "--nproc", "2", "--global-batch-size", "4",
                 "--out", str(out)]) == 0
    plan = autopar.Plan.load(out)
    assert plan.graph_fingerprint == autopar.capture(build_own("nanogpt"), X, own_loss=True).fingerprint
    assert main(["plan", f"{factory}:build", "--cluster", "local", "--nproc", "2", "--global-batch-size", "4",
                 "--external-loss", "--out", str(out)]) == 0
    external = autopar.Plan.load(out)
    assert external.graph_fingerprint == autopar.capture(build_own("nanogpt"), X).fingerprint
    # explain recaptures MODEL and finds the capture the plan was made from
    assert main(["explain", str(out), "--model", f"{factory}:build", "--config", str(external.config)]) == 0
    assert main(["capture", f"{factory}:build", "--target-arg", "idx", "--external-loss"]) == 1
    assert "not both" in capsys.readouterr().err


class _Classifier(nn.Module):
    """Its own loss over one class label per sample: targets not shaped like its token input."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, 5)

    def forward(self, x, labels=None):
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h.mean(1))
        return logits if labels is None else F.cross_entropy(logits, labels)


def test_targets_not_shaped_like_the_input_are_asked_for():
    with pytest.raises(autopar.CaptureError, match=r"example labels= token ids of shape \[2, 16\].*example_kwargs="
                                                   r"\{'labels': \.\.\.\}.*--external-loss"):
        autopar.capture(_Classifier(), X, own_loss=True)
    given = autopar.capture(_Classifier(), X, {"labels": torch.zeros(2, dtype=torch.long)}, own_loss=True)
    assert given.fingerprint != autopar.capture(_Classifier(), X).fingerprint  # the loss is part of what trains
