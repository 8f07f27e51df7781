"""The user journeys of tests/test_journeys.py: every way to make a plan × every way to train it.

A plan comes from the CLI (`autopar plan tests/journeys.py:factory`, with or without `--external-loss`),
from `autopar.plan(model)` (with or without `loss_fn`) or from `autopar.plan(autopar.capture(model, x))`
(captured as called, or `own_loss=True`). Each is made in the test process, as a user makes it before
launching, with the planner's own choices under one pinned degree (its choice of sequence parallelism under
tp2 included), and trained under 2 gloo ranks with and without `loss_fn`: the layout does not depend on the
loss, so every combination trains, each against one process trained on the same loss.

The two models take their targets (`labels=`, shifted inside), so without `loss_fn` they train on their own
loss: transformers' Llama and a self-written `FunctionalLM` (tests/own_models.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

VOCAB, SEQ, BATCH, STEPS = 128, 16, 8, 2
MODELS = ("llama", "functional")
SOURCES = ("cli", "plan_model", "plan_capture")
LOSSES = ("own", "loss_fn")  # without loss_fn (the model's own), with lm_cross_entropy


def llama() -> tuple[torch.nn.Module, tuple]:
    """CLI factory: transformers' Llama at test size (tests/hf_families.py), seed 0."""
    from hf_families import _families

    torch.manual_seed(0)
    return _families()["llama"](), (torch.zeros(1, SEQ, dtype=torch.long),)


def functional() -> tuple[torch.nn.Module, tuple]:
    """CLI factory: the self-written FunctionalLM (tied head, `.loss` over shifted labels), seed 0."""
    from own_models import FunctionalLM

    torch.manual_seed(0)
    return FunctionalLM(), (torch.zeros(1, SEQ, dtype=torch.long),)


FACTORIES = {"llama": llama, "functional": functional}


def make_plans(layout: dict[str, int], out_dir: Path) -> dict[tuple[str, str, str], Any]:
    """{(model, source, plan loss): Plan} for one pinned degree, made the ways users make them."""
    import autopar
    from autopar import Cluster, Plan, PlannerOptions
    from autopar.cli.main import main
    from autopar.codegen import lm_cross_entropy

    cluster = Cluster.local(nproc=2)
    options = PlannerOptions(**layout)
    flags = [f"--{k}={v}" for k, v in layout.items()]
    plans = {}
    for name in MODELS:
        model, x = FACTORIES[name]()
        for loss in LOSSES:
            path = out_dir / f"{name}-{loss}.json"
            code = main(["plan", f"{Path(__file__).parent / 'journeys.py'}:{name}", "--cluster", "local",
                         "--nproc", "2", "--global-batch-size", str(BATCH), "--out", str(path), *flags,
                         *(["--external-loss"] if loss == "loss_fn" else [])])
            assert code == 0, f"autopar plan {name} {flags} exited {code}"
            plans[name, "cli", loss] = Plan.load(path)
            kw = {"loss_fn": lm_cross_entropy} if loss == "loss_fn" else {}
            plans[name, "plan_model", loss] = autopar.plan(model, cluster, example_inputs=x, global_batch_size=BATCH,
                                                           options=options, **kw)
            graph = autopar.capture(model, x, own_loss=loss == "own")
            plans[name, "plan_capture", loss] = autopar.plan(graph, cluster, global_batch_size=BATCH, options=options)
    return plans


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


def _loss(model: torch.nn.Module, loss: str, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    from autopar.codegen import lm_cross_entropy

    return model(x, labels=t).loss if loss == "own" else lm_cross_entropy(model(x).logits, t)


_REFERENCES: dict[tuple[str, str], tuple] = {}


def _reference(name: str, loss: str) -> tuple:
    """One process on the whole batch: losses, final weights."""
    if (name, loss) not in _REFERENCES:
        from parity_models import optimizer

        model, _ = FACTORIES[name]()
        opt = optimizer(model.parameters())
        losses = []
        for x, t in _batches():
            opt.zero_grad()
            value = _loss(model, loss, x, t)
            value.backward()
            opt.step()
            losses.append(value.item())
        _REFERENCES[name, loss] = losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _REFERENCES[name, loss]


def journeys(plans: dict[tuple[str, str, str], Any]) -> list[dict[str, Any]]:
    """In every rank: each plan trained with and without loss_fn through autopar.parallelize."""
    from parity_models import excess, optimizer

    import autopar
    from autopar.codegen import lm_cross_entropy

    out = []
    for (name, source, plan_loss), plan in plans.items():
        for run_loss in LOSSES:
            model, x = FACTORIES[name]()
            kw = {"loss_fn": lm_cross_entropy} if run_loss == "loss_fn" else {}
            pm = autopar.parallelize(copy.deepcopy(model), plan, example_inputs=x, optimizer=optimizer, **kw)
            losses = [pm.train_step(pm.local_batch(a), pm.local_batch(b)) for a, b in _batches()]
            ref_losses, ref_state = _reference(name, run_loss)
            worst, key = excess(pm.full_state_dict(), ref_state)
            out.append({"case": f"{name} planned by {source} for {plan_loss}, trained on {run_loss} ({plan.config})",
                        "losses": losses, "ref_losses": ref_losses, "weight_excess": worst, "weight_key": key,
                        "sequence_parallel": plan.config.sequence_parallel})
    return out
