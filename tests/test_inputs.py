"""Inputs as models take them (autopar/codegen/batch.py): tensors, tuples (None allowed) and dicts, nested,
split along the batch with tensors that have no batch dim given whole; several targets; and a model whose
later pipeline stage reads the inputs' values, trained under pp2 and dp2 against one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.codegen.batch import as_call, slice_batch, split_batch
from autopar.errors import AutoparError, CaptureError

SEQ, VOCAB, HIDDEN, BATCH = 8, 32, 16, 8


def test_nested_batches_split_along_dim_0_and_keep_the_rest_whole():
    ids, bias = torch.arange(8 * 3).reshape(8, 3), torch.ones(3)
    batch = {"ids": ids, "extra": (ids * 2, None, bias), "flag": True}
    parts = split_batch(batch, 4, 8)
    assert [p["ids"].tolist() for p in parts] == [ids[2 * i:2 * i + 2].tolist() for i in range(4)]
    assert all(p["extra"][2] is bias and p["extra"][1] is None and p["flag"] is True for p in parts)
    assert torch.equal(parts[3]["extra"][0], ids[6:] * 2)
    assert torch.equal(slice_batch((ids, bias), 4, 8, 8)[0], ids[4:])
    assert as_call(ids) == ((ids,), {}) and as_call((ids, None)) == ((ids, None), {})
    assert as_call({"input_ids": ids}) == ((), {"input_ids": ids})


def test_a_batch_of_the_wrong_size_is_refused_saying_what_it_holds():
    with pytest.raises(AutoparError, match=r"must hold 8 samples.*dim 0 of \[6\]"):
        split_batch({"ids": torch.zeros(6, 3)}, 2, 8)
    with pytest.raises(AutoparError, match="no tensor with a batch dim"):
        slice_batch((None, 3), 0, 4, 8)
    with pytest.raises(AutoparError, match="keys must be strings"):
        as_call({1: torch.zeros(2)})


def test_capture_takes_keyword_inputs_and_refuses_other_forms():
    model = TwoInputs()
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    graph = autopar.capture(model, (ids, None), {"mask": torch.ones(2, SEQ), "scale": torch.ones(HIDDEN)})
    assert graph.example_batch_size == 2 and graph.seq_len == SEQ
    with pytest.raises(CaptureError, match="example_kwargs is a list"):
        autopar.capture(model, (ids,), [torch.ones(2, SEQ)])
    with pytest.raises(CaptureError, match="example_inputs is a str"):
        autopar.capture(model, "ids")


class TwoInputs(nn.Module):
    """Ids and an optional positional input, a padding mask and a per-feature scale (no batch dim) by keyword;
    the last block's glue reads the mask and the ids' values, so a later pipeline stage needs them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, extra=None, *, mask, scale):
        x = self.emb(ids)
        if extra is not None:
            x = x + extra
        for block in self.blocks:
            x = torch.tanh(block(x)) * mask.unsqueeze(-1)
        return self.head(x * scale + (ids == 1).unsqueeze(-1).float())


def two_targets_loss(logits, targets):
    """Several targets: the tokens, and a per-token weight."""
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), targets["tokens"].reshape(-1), reduction="none")
    return (ce * targets["weight"].reshape(-1)).mean()


def _batches(steps: int):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        mask = (torch.rand(BATCH, SEQ, generator=g) > 0.2).float()
        inputs = {"ids": ids, "extra": None, "mask": mask, "scale": torch.linspace(0.5, 1.5, HIDDEN)}
        targets = {"tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                   "weight": torch.rand(BATCH, SEQ, generator=g)}
        out.append((inputs, targets))
    return out


def _train_two_inputs(config: dict) -> dict:
    from parity_models import excess, make_plan, optimizer

    from autopar.codegen import parallelize

    torch.manual_seed(0)
    model = TwoInputs()
    ref = copy.deepcopy(model)
    kwargs = {"ids": torch.zeros(1, SEQ, dtype=torch.long), "extra": None, "mask": torch.ones(1, SEQ),
              "scale": torch.ones(HIDDEN)}
    graph = autopar.capture(model, (), kwargs)
    plan = make_plan(graph, **config)
    pm = parallelize(model, plan, graph=graph, example_kwargs=kwargs, optimizer=optimizer, loss_fn=two_targets_loss)
    data = _batches(3)
    losses = [pm.train_step(pm.local_batch(x), pm.local_batch(t)) for x, t in data]
    opt, ref_losses = optimizer(ref.parameters()), []
    m, dp = plan.config.num_microbatches, plan.config.dp
    for x, t in data:  # one process, the same micro-batches: m of dp·mbs samples (rank r's i-th slice each)
        opt.zero_grad()
        total = 0.0
        for i in range(m):
            rows = [r * BATCH // dp + i * BATCH // (dp * m) + j for r in range(dp) for j in range(BATCH // (dp * m))]
            xi, ti = ({k: v[rows] if isinstance(v, torch.Tensor) and v.dim() and v.size(0) == BATCH else v
                       for k, v in d.items()} for d in (x, t))
            loss = two_targets_loss(ref(xi.pop("ids"), xi.pop("extra"), **xi), ti) / m
            loss.backward()
            total += loss.item()
        opt.step()
        ref_losses.append(total)
    return {"losses": losses, "ref_losses": ref_losses, "weights": excess(pm.full_state_dict(), ref.state_dict())[0]}


def _layouts() -> list[dict]:
    return [_train_two_inputs(cfg) for cfg in (dict(pp=2, num_microbatches=2), dict(dp=2, num_microbatches=2))]


@pytest.mark.multiproc
def test_dict_inputs_several_targets_and_input_values_on_a_later_stage_train_as_one_process():
    from dist_harness import run_distributed
    from parity_models import ATOL, RTOL

    for rank_results in run_distributed(_layouts, 2, timeout_s=300):
        for r in rank_results:
            assert r["losses"] == pytest.approx(r["ref_losses"], rel=RTOL, abs=ATOL)
            assert r["weights"] <= ATOL


def test_the_logits_are_found_in_a_dict_output_or_the_ambiguity_is_named():
    from autopar.codegen.dataflow import model_logits

    logits, hidden = torch.zeros(2, 3), torch.ones(2, 3)
    assert model_logits({"hidden": hidden, "logits": logits}) is logits
    assert model_logits({"scores": logits, "n": 3}) is logits  # the one tensor
    with pytest.raises(AutoparError, match=r"tensors \['a', 'b'\] and no 'logits'.*key 'logits'"):
        model_logits({"a": logits, "b": hidden})
