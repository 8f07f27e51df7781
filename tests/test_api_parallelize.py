"""`autopar.parallelize(model, cluster, ...)`: every rank plans identically and trains with single-device numerics."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import torch

from tests.dist_harness import run_distributed
from tests.parity_models import ATOL, RTOL, batches, build_model, optimizer, train_reference


def _plan_and_train() -> dict:
    import autopar
    from autopar.codegen import lm_cross_entropy

    model = build_model("gpt")
    reference = copy.deepcopy(model)
    data = batches(steps=3)
    ref_losses, _, _ = train_reference(reference, data)
    example = (torch.zeros(1, data[0][0].shape[1], dtype=torch.long),)
    # The planner chooses the layout here (tp pinned so the test also crosses the TP code path).
    pm = autopar.parallelize(model, autopar.Cluster.local(nproc=2), example_inputs=example, optimizer=optimizer,
                             loss_fn=lm_cross_entropy, global_batch_size=data[0][0].shape[0],
                             options=autopar.PlannerOptions(tp=2))
    losses = [pm.train_step(pm.local_batch(x), pm.local_batch(t)) for x, t in data]
    return {"config": str(pm.config), "losses": losses, "ref_losses": ref_losses}


def test_parallelize_from_a_cluster_plans_once_and_matches_single_device():
    results = run_distributed(_plan_and_train, 2, timeout_s=240)
    assert results[0]["config"] == results[1]["config"]  # the same plan on every rank
    assert "tp=2" in results[0]["config"]
    for r in results:
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=RTOL, atol=ATOL)


def test_parallelize_takes_and_forwards_every_keyword_of_codegen_parallelize(monkeypatch):
    """autopar.parallelize is the documented entry: each keyword codegen.parallelize takes (but `graph`, which it
    captures itself) is one of its keywords, with the same default, and reaches codegen unchanged (README's
    `max_grad_norm=1.0` was refused with a TypeError)."""
    import autopar
    import autopar.api
    from autopar import codegen

    api_params = inspect.signature(autopar.parallelize).parameters
    codegen_params = inspect.signature(codegen.parallelize).parameters
    keywords = [n for n, p in codegen_params.items() if p.kind is p.KEYWORD_ONLY and n != "graph"]
    missing = [n for n in keywords if n not in api_params]
    assert not missing, f"autopar.parallelize lacks codegen.parallelize's keywords {missing}"
    for n in keywords:
        assert api_params[n].kind is api_params[n].KEYWORD_ONLY
        assert api_params[n].default is codegen_params[n].default, n

    seen: dict = {}
    monkeypatch.setattr(autopar.api, "_graph", lambda *a, **k: "graph")
    monkeypatch.setattr(codegen, "parallelize", lambda model, plan, **kw: seen.update(kw))
    plan = autopar.Plan.load(Path(__file__).parent / "golden" / "gpt3-175b.json")
    given = {n: object() for n in keywords}
    autopar.parallelize(object(), plan, **given)
    assert {n: seen.get(n) for n in keywords} == given
