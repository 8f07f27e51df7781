"""Cases for tests/test_grad_overlap.py, run inside gloo ranks: the same model, data and plan trained twice, the
ZeRO-0/1 gradient all-reduce overlapped with backward (autopar.codegen.grad_overlap) and after it (the old
path, `pm.grad_reduce.overlap = False`); the reduced gradients, weights and losses of every step compared bit
for bit, and the overlapped run's bucket launches recorded."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from parity_models import batches, build_model, graph_of, make_plan
from precision_cases import adamw

from autopar.codegen import data_parallel, lm_cross_entropy, parallelize
from autopar.codegen.data_parallel import grad_of, local

__all__ = ["exact_case", "job"]


def _train(model, graph, config: dict[str, Any], *, overlap: bool, steps: int, max_grad_norm: float | None
           ) -> dict[str, Any]:
    pm = parallelize(model, make_plan(graph, **config), graph=graph, optimizer=adamw(1e-2),
                     loss_fn=lm_cross_entropy, max_grad_norm=max_grad_norm)
    pm.grad_reduce.overlap = overlap
    names = {id(p): n for part in pm.modules for n, p in part.named_parameters()}
    losses, grads, launches = [], [], []
    for x, t in batches(steps):
        losses.append(pm.train_step(pm.local_batch(x), pm.local_batch(t)))
        # after the step: ZeRO-0's gradients and the distributed optimizer's main gradients stay until the next
        # step's zero_grad (ZeRO-1 over fp32 keeps the owned ones)
        grads.append({names[id(p)]: local(g).detach().clone() for p in pm.grad_reduce.params
                      if (g := grad_of(p)) is not None})
        launches.append(list(pm.grad_reduce.launches))
    return {"losses": losses, "grads": grads, "weights": pm.state_dict(), "launches": launches,
            "buckets": pm.grad_reduce.buckets, "params": len(pm.grad_reduce.params),
            "expected": [pm.grad_reduce._expected[id(p)] for p in pm.grad_reduce.params]}


def train_both_ways(kind: str, bucket_bytes: int, train: Callable[[Any, Any, bool], dict[str, Any]]
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """`train(model, graph, overlap)` on one model of `kind`, with the overlap off (on a copy) and on, both under
    `bucket_bytes` buckets (small, so a tiny model has several)."""
    before = data_parallel.BUCKET_BYTES
    data_parallel.BUCKET_BYTES = bucket_bytes
    try:
        model = build_model(kind)
        graph = graph_of(kind, model)
        return train(copy.deepcopy(model), graph, False), train(model, graph, True)
    finally:
        data_parallel.BUCKET_BYTES = before


def bitwise_differences(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Two runs' gradients and weights compared bit for bit (the names that differ), and their losses."""
    grads_differ = sorted({n for a, b in zip(old["grads"], new["grads"], strict=True)
                           for n in a.keys() | b.keys() if n not in a or n not in b or not torch.equal(a[n], b[n])})
    weights_differ = sorted(n for n in old["weights"]
                            if not torch.equal(local(old["weights"][n]), local(new["weights"][n])))
    return {"grads_differ": grads_differ, "weights_differ": weights_differ,
            "grads_compared": sum(len(g) for g in new["grads"]), "losses": (old["losses"], new["losses"])}


def exact_case(kind: str, config: dict[str, Any], *, steps: int = 2, max_grad_norm: float | None = None,
               bucket_bytes: int = 4096) -> dict[str, Any]:
    """Overlapped vs after-backward: the names of the gradients, weights and losses that differ (any bit), the
    overlapped run's launches (bucket, in backward, gradients counted by then) and its bucket count.
    bucket_bytes: small, so a tiny model has several buckets (both runs use it)."""
    old, new = train_both_ways(kind, bucket_bytes, lambda model, graph, overlap: _train(
        model, graph, dict(config), overlap=overlap, steps=steps, max_grad_norm=max_grad_norm))
    return {"case": f"{kind} {config}", **bitwise_differences(old, new),
            "launches": new["launches"], "old_launches": old["launches"], "buckets": new["buckets"],
            "params": new["params"], "expected": new["expected"]}


def job(cases: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    return [exact_case(kind, config, **kw) for kind, config, kw in cases]
