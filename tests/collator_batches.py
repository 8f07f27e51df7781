"""Batches as a Hugging Face data collator yields them — one dict, `labels` inside — and parity of training on them.

One family of each kind: a decoder (Qwen2: tied embeddings, labels the ids with the prompt and padding
ignored), an encoder masked LM (BERT: labels only at the masked positions, -100 elsewhere, two samples of
the first batch with none at all) and an encoder–decoder (BART: `labels` without decoder ids, which the model
shifts into its decoder's input itself, padded labels -100). Each rank calls the public API as a user's
loop would: `autopar.parallelize(model, plan, example_kwargs=first_rows(batch), optimizer=...)`, then
`pm.train_step(pm.local_batch(batch))`; the reference is the same initial model trained on one process with
`model(**batch).loss` over the whole batch.
"""

from __future__ import annotations

import copy
from typing import Any

import capture_cache
import torch
from hf_families import build_family
from hf_kinds import DEC_SEQ, SEQ, build_kind
from parity_models import BATCH, excess, make_plan, optimizer

import autopar
from autopar.codegen.state import full_gradients

VOCAB = 128
FAMILIES = {"qwen2": "decoder", "bert": "encoder masked LM", "bart": "encoder-decoder"}
STEPS = 3


def build(name: str) -> torch.nn.Module:
    return build_family(name) if FAMILIES[name] == "decoder" else build_kind(name)


def collated(name: str, size: int = BATCH, seed: int = 1) -> dict[str, torch.Tensor]:
    """One batch of `size` samples as a collator yields it for family `name`: ids, padding mask and labels,
    -100 where a position does not count (a different number of counted tokens in every sample)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (size, SEQ), generator=g)
    mask = torch.ones(size, SEQ, dtype=torch.long)
    pads = torch.arange(size) % 4  # 0..3 padded positions at the end of each sample
    for i, n in enumerate(pads.tolist()):
        if n:
            mask[i, SEQ - n:] = 0
    kind = FAMILIES[name]
    if kind == "decoder":  # next-token labels are the ids (shifted inside the model): prompt and padding ignored
        labels = ids.clone()
        labels[:, : 1 + seed % 3] = -100
        labels[mask == 0] = -100
    elif kind == "encoder masked LM":  # the masked positions' tokens; a collator's 15 %, here ~25 %
        chosen = (torch.rand(size, SEQ, generator=g) < 0.25) & (mask == 1)
        if seed == 1:
            chosen[:2] = False  # two samples without a masked token: a whole micro-batch counts none
        chosen[2:, 0] = True  # every other sample has one at least
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        ids = torch.where(chosen, torch.full_like(ids, 3), ids)  # the [MASK] token
    else:  # targets of their own length, padded with -100 (the model shifts them into its decoder's ids)
        labels = torch.randint(4, VOCAB, (size, DEC_SEQ), generator=g)
        for i, n in enumerate((torch.arange(size) % 3).tolist()):
            if n:
                labels[i, DEC_SEQ - n:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def first_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v[:1] for k, v in batch.items()}


_REFERENCES: dict[str, tuple] = {}


def _reference(name: str, model: torch.nn.Module, data: list[dict[str, torch.Tensor]]) -> tuple:
    """One process, the whole batch, the model's own loss: `model(**batch).loss`."""
    if name not in _REFERENCES:
        ref = copy.deepcopy(model)
        opt = optimizer(ref.parameters())
        losses = []
        for batch in data:
            opt.zero_grad()
            loss = ref(**batch).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        grads = {k: p.grad.detach().clone() for k, p in ref.named_parameters() if p.grad is not None}
        with torch.no_grad():
            evaluated = ref.eval()(**data[0]).loss.item()
        _REFERENCES[name] = losses, {k: v.detach().clone() for k, v in ref.state_dict().items()}, grads, evaluated
    return _REFERENCES[name]


def labels_case(name: str, layout: dict[str, Any], steps: int = STEPS) -> dict[str, Any]:
    """Run in every rank: training on batches with `labels` inside against one process's `model(**batch).loss`."""
    model = build(name)
    data = [collated(name, seed=1 + i) for i in range(steps)]
    example = first_rows(data[0])
    graph = capture_cache.capture(model, (), example, own_loss=True)  # the graph the user's plan is made from
    plan = make_plan(graph, **layout)
    ref_losses, ref_state, ref_grads, ref_eval = _reference(name, model, data)
    pm = autopar.parallelize(model, plan, example_kwargs=example, optimizer=optimizer)
    losses = [pm.train_step(pm.local_batch(batch)) for batch in data]
    refusals = []  # raised by every rank alike, before any collective: the job goes on
    local = pm.local_batch(data[0])
    for inputs, targets in (({k: v for k, v in local.items() if k != "labels"}, None), (local, local["labels"])):
        try:
            pm.train_step(inputs, targets)
        except autopar.AutoparError as e:
            refusals.append(str(e))
    evaluated = pm.eval_loss(pm.local_batch(data[0]))
    full = pm.full_state_dict()
    grads = full_gradients(pm.modules, pm.mesh["pp"])
    weight_excess, weight_key = excess(full, ref_state)
    grad_excess, grad_key = excess(grads, ref_grads)
    return {"case": f"{name} {layout}", "losses": losses, "ref_losses": ref_losses, "eval_loss": evaluated,
            "ref_eval_loss": ref_eval, "refusals": refusals,
            "weight_excess": weight_excess, "weight_key": weight_key, "grad_excess": grad_excess,
            "grad_key": grad_key, "missing": sorted(set(ref_state) - set(full)),
            "extra": sorted(set(full) - set(ref_state)), "vocab_parallel": pm.vocab_parallel}


def labels_cases(cases: list[tuple[str, dict[str, Any]]], steps: int = STEPS) -> list[dict[str, Any]]:
    return [labels_case(name, layout, steps) for name, layout in cases]
