"""Parity of the model kinds of tests/hf_kinds.py: each rank trains the parallel model on its share of every
batch, given as the model takes it (a dict of keyword inputs), and checks it against the same initial model
trained on one process over the whole batch (the checks of tests/test_parity.py).

Batch norm: under data parallelism its statistics are synchronised over the data-parallel ranks of each
micro-batch, so the reference runs the same micro-batches: with m micro-batches per rank, one process
runs m forwards of dp·mbs samples each (micro-batch i of every rank, concatenated) and averages the m
losses, which is what the parallel step computes.
"""

from __future__ import annotations

import copy
from typing import Any

import capture_cache
import torch
from hf_kinds import batch, build_kind, example
from parity_models import RTOL, Gathers, excess, make_plan, optimizer, planned_gathers
from torch.utils._pytree import tree_map

from autopar.codegen import lm_cross_entropy, parallelize
from autopar.codegen.dataflow import model_logits
from autopar.codegen.state import full_gradients
from autopar.errors import PlanMismatchError

BATCH, STEPS = 8, 3
_GRAPHS: dict[str, Any] = {}


def _data(kind: str, steps: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    return [batch(kind, BATCH, seed=1 + i) for i in range(steps)]


def _same_micro_batches(inputs: Any, targets: Any, dp: int, m: int) -> list[tuple[Any, Any]]:
    """The global batch regrouped as the parallel step sees it: micro-batch i of every dp rank together."""
    n = BATCH // (dp * m)
    order = [r * m * n + i * n + j for i in range(m) for r in range(dp) for j in range(n)]
    idx = torch.tensor(order)
    pick = lambda x: tree_map(lambda t: t[idx] if isinstance(t, torch.Tensor) else t, x)  # noqa: E731
    inputs, targets = pick(inputs), pick(targets)
    k = dp * n
    return [(tree_map(lambda t, i=i: t[i * k:(i + 1) * k] if isinstance(t, torch.Tensor) else t, inputs),
             targets[i * k:(i + 1) * k]) for i in range(m)]


def train_reference(model: torch.nn.Module, data, dp: int, m: int):
    opt = optimizer(model.parameters())
    losses = []
    for inputs, targets in data:
        opt.zero_grad()
        total = 0.0
        for x, t in _same_micro_batches(inputs, targets, dp, m):
            loss = lm_cross_entropy(model_logits(model(**x)), t) / m
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, grads


def scaled_excess(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """max(|got − want|) − rtol·max|want| per tensor (≤ atol passes), and the worst name: gradients after
    several AdamW steps come from two trajectories whose weights already differ by float32 rounding
    (~3e-6 for Swin v2 under tp2), which an entry near zero carries in absolute terms; each tensor's
    gradient is held to rtol of its own scale instead (weights stay element-wise)."""
    per = {k: (got[k] - v).abs().max().item() - RTOL * v.abs().max().item() for k, v in want.items() if k in got}
    worst = max(per, key=per.get)
    return per[worst], worst


def kind_case(kind: str, config: dict[str, Any], steps: int = STEPS) -> dict[str, Any]:
    """Run in every rank: the parallel losses per step, the reference's, and the largest weight/gradient error."""
    model = build_kind(kind)
    if kind not in _GRAPHS:
        _GRAPHS[kind] = capture_cache.capture(model, (), example(kind))
    graph = _GRAPHS[kind]
    plan = make_plan(graph, **config)  # stage_sizes: layers per stage, to cut where an even split would not
    data = _data(kind, steps)
    ref_losses, ref_state, ref_grads = train_reference(copy.deepcopy(model), data, plan.config.dp,
                                                       plan.config.num_microbatches)
    pm = parallelize(model, plan, graph=graph, example_kwargs=example(kind), optimizer=optimizer,
                     loss_fn=lm_cross_entropy)
    gathers = Gathers()
    with gathers:  # the first step's all-gathers, against what the cost model prices (tp only: no ZeRO-3)
        losses = [pm.train_step(pm.local_batch(data[0][0]), pm.local_batch(data[0][1]))]
    losses += [pm.train_step(pm.local_batch(x), pm.local_batch(t)) for x, t in data[1:]]
    full = pm.full_state_dict()
    grads = full_gradients(pm.modules, pm.mesh["pp"])
    weight_excess, weight_key = excess(full, ref_state)
    grad_excess, grad_key = scaled_excess(grads, ref_grads)
    return {"case": f"{kind} {config}", "losses": losses, "ref_losses": ref_losses, "config": str(plan.config),
            "sequence_parallel": plan.config.sequence_parallel, "notes": plan.estimate.notes,
            "weight_excess": weight_excess, "weight_key": weight_key,
            "grad_excess": grad_excess, "grad_key": grad_key, "grad_names": sorted(grads),
            "missing": sorted(set(ref_state) - set(full)), "extra": sorted(set(full) - set(ref_state)),
            "gathered_bytes": gathers.n_bytes, "planned_gathered_bytes": planned_gathers(graph, plan.config)}


def kind_cases(cases: list[tuple[str, dict[str, Any]]], steps: int = STEPS,
               refused: tuple[tuple[str, dict[str, Any]], ...] = ()) -> list[dict[str, Any]]:
    """The parity cases, then the layouts `parallelize` must refuse: their messages."""
    out = [kind_case(kind, cfg, steps) for kind, cfg in cases]
    for kind, cfg in refused:
        try:
            kind_case(kind, cfg, 1)
        except PlanMismatchError as e:
            out.append({"case": f"{kind} {cfg}", "refused": str(e)})
        else:
            out.append({"case": f"{kind} {cfg}", "refused": None})
    return out


def lm_and_kind_cases(lm_cases: list[tuple[str, dict[str, Any]]], cases: list[tuple[str, dict[str, Any]]],
                      steps: int = STEPS, refused: tuple[tuple[str, dict[str, Any]], ...] = ()) -> list[dict[str, Any]]:
    """Causal-LM parity cases (parity_models.parity_case), then these kinds' (kind_case), in one job; then the
    causal LMs `refused` lists, each `autopar.parallelize(model, Cluster.local(), options=PlannerOptions(**pins))`
    as a user calls it, which must raise on every rank: the error's class and message."""
    from parity_models import SEQ, build_model, parity_cases

    import autopar
    from autopar.cluster import Cluster

    out = parity_cases(lm_cases, steps) + [kind_case(kind, cfg, steps) for kind, cfg in cases]
    for kind, pins in refused:
        try:
            autopar.parallelize(build_model(kind), Cluster.local(nproc=2), example_inputs=(torch.zeros(1, SEQ).long(),),
                                global_batch_size=BATCH, options=autopar.PlannerOptions(**pins), optimizer=optimizer,
                                loss_fn=lm_cross_entropy)
        except Exception as e:  # noqa: BLE001 - what a user would see, whatever it is
            out.append({"case": f"{kind} {pins}", "refused": f"{type(e).__name__}: {e}"})
        else:
            out.append({"case": f"{kind} {pins}", "refused": None})
    return out
