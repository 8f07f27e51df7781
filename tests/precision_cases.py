"""Cases for tests/test_precision.py, run inside gloo ranks: each trains a tiny model under a precision
policy, gradient clipping or loss scaling and returns what the test compares with one process.

The references are independent of autopar's runtime: the same initial model on one process, trained on
the whole global batch with torch's own tools — `torch.autocast(bfloat16)` around forward and loss, fp32
AdamW, `torch.nn.utils.clip_grad_norm_` — or, for memory, the bytes the planner charges.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import torch
from parity_models import batches, build_model, excess, graph_of, logits_of, make_plan
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.codegen import lm_cross_entropy, parallelize
from autopar.codegen.data_parallel import local
from autopar.codegen.dist_optimizer import DistributedOptimizer

__all__ = ["job", "policy_cases", "policy_suite_case", "fp16_overflow_case", "memory_cases", "schedule_cases",
           "CLIP_LR", "MODES"]

CLIP_LR = 1e-2  # large enough that clipping at 0.05 is active on every step
# what a policy case trains under: the bf16 policy, or fp32 with clipping at 0.05 active on every step
MODES: dict[str, dict[str, Any]] = {"bf16": dict(precision="bf16"),
                                    "clip": dict(precision="fp32", max_grad_norm=0.05, lr=CLIP_LR)}


def adamw(lr: float):
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01, eps=1e-6)


def _reference(model: nn.Module, data, *, precision: str, lr: float, max_grad_norm: float | None):
    """One process: autocast to bf16 (policy bf16) around forward and loss, fp32 AdamW, clip_grad_norm_."""
    opt = adamw(lr)(model.parameters())
    losses, norms = [], []
    for x, t in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = lm_cross_entropy(logits_of(model, x), t)
        loss.backward()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def policy_case(kind: str, config: dict[str, Any], *, precision: str, max_grad_norm: float | None = None,
                lr: float = 1e-3, steps: int = 5) -> dict[str, Any]:
    """Parallel vs one process: losses, grad norms, final weights; dtypes of a Linear's output and of the
    optimizer's parameters."""
    model = build_model(kind)
    graph = graph_of(kind, model)
    data = batches(steps)
    ref_losses, ref_norms, ref_state = _reference(copy.deepcopy(model), data, precision=precision, lr=lr,
                                                  max_grad_norm=max_grad_norm)
    pm = parallelize(model, make_plan(graph, precision=precision, **config), graph=graph, optimizer=adamw(lr),
                     loss_fn=lm_cross_entropy, max_grad_norm=max_grad_norm)
    linear = next(m for part in pm.modules for m in part.modules() if isinstance(m, nn.Linear))
    seen: list[torch.dtype] = []
    linear.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    losses, norms = [], []
    for x, t in data:
        losses.append(pm.train_step(pm.local_batch(x), pm.local_batch(t)))
        norms.append(pm.grad_norm)
    weight_excess, weight_key = excess(pm.full_state_dict(), ref_state)
    return {"case": f"{kind} {precision} clip={max_grad_norm} {config}", "losses": losses, "ref_losses": ref_losses,
            "norms": norms, "ref_norms": ref_norms, "weight_excess": weight_excess, "weight_key": weight_key,
            "linear_dtypes": sorted({str(d) for d in seen}),
            "optimizer_dtypes": sorted({str(p.dtype) for g in pm.optimizer.param_groups for p in g["params"]})}


def policy_cases(cases: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    return [policy_case(kind, cfg, **kw) for kind, cfg, kw in cases]


def policy_suite_case(name: str, config: dict[str, Any], steps: int) -> dict[str, Any]:
    """`policy_case` for tests/test_eight_ranks.py's shared job: `name` is "<model kind>:<MODES key>"."""
    kind, mode = name.split(":")
    return policy_case(kind, config, steps=steps, **MODES[mode])


def fp16_overflow_case(root: str) -> dict[str, Any]:
    """fp16 under ZeRO-3 (every rank holds its own gradient shards): at step 2 one element of rank 0's
    local shard becomes inf just before unscaling. Every rank must skip that step (weights unchanged)
    and halve the scale; the other steps update. Then a checkpoint in `root` carries the scaler's state
    into a fresh model that resumes from it."""
    import torch.distributed as dist

    from autopar.codegen.checkpoint import Checkpointer

    model = build_model("gpt")
    graph = graph_of("gpt", model)
    world = int(os.environ["WORLD_SIZE"])  # the process group starts in parallelize
    pm = parallelize(model, make_plan(graph, precision="fp16", dp=world, zero_stage=3), graph=graph,
                     optimizer=adamw(1e-3), loss_fn=lm_cross_entropy)
    scaler = pm.loss_scaler
    unscale = scaler.unscale_
    poison = {"now": False}

    def poisoned(grads):
        grads = list(grads)
        if poison["now"] and dist.get_rank() == 0:
            grads[0].view(-1)[0] = float("inf")
        unscale(grads)

    scaler.unscale_ = poisoned
    unchanged, scales, norms = [], [], []
    for step, (x, t) in enumerate(batches(3)):
        poison["now"] = step == 1
        before = {k: local(v).clone() for k, v in pm.state_dict().items()}
        scale_used = scaler.scale
        pm.train_step(pm.local_batch(x), pm.local_batch(t))
        unchanged.append(all(torch.equal(local(v), before[k]) for k, v in pm.state_dict().items()))
        scales.append((scale_used, scaler.scale))
        norms.append(pm.grad_norm)
    Checkpointer(pm, root, model_name="gpt").save(3)
    resumed = parallelize(build_model("gpt", seed=1), make_plan(graph, precision="fp16", dp=world, zero_stage=3),
                          graph=graph, optimizer=adamw(1e-3), loss_fn=lm_cross_entropy)
    Checkpointer(resumed, root, model_name="gpt").resume()
    return {"rank": dist.get_rank(), "unchanged": unchanged, "scales": scales, "norms": norms,
            "skipped": scaler.skipped_steps, "saved_scaler": scaler.state_dict(),
            "resumed_scaler": resumed.loss_scaler.state_dict()}


def _local_bytes(t: torch.Tensor) -> int:
    x = local(t)
    return x.numel() * x.element_size()


def memory_case(precision: str, zero_stage: int, tp: int) -> dict[str, Any]:
    """Bytes of every parameter, gradient and optimizer-state tensor this rank holds after a step, by
    state, against the planner's model-state bytes for this rank (autopar.estimate's memory breakdown).
    Under ZeRO-1 with a 16-bit policy: the fp32 masters (weights), the fp32 main gradients (grads), Adam's
    moments (optimizer) and the 16-bit parameters (compute_copies)."""
    import torch.distributed as dist

    import autopar
    from autopar.cluster import Cluster

    world = int(os.environ["WORLD_SIZE"])  # the process group starts in parallelize
    model = build_model("gpt")
    graph = graph_of("gpt", model)
    plan = make_plan(graph, precision=precision, tp=tp, dp=world // tp, zero_stage=zero_stage)
    pm = parallelize(model, plan, graph=graph, optimizer=adamw(1e-3), loss_fn=lm_cross_entropy)
    gathered: list[int] = []  # ZeRO-2: FSDP2's gathered (unsharded) weights, held from forward to backward
    if zero_stage == 2:
        def held(module, args, out):
            gathered.append(sum(_local_bytes(p) for p in module.parameters()
                                if not isinstance(p, DTensor) or "dp" not in (p.device_mesh.mesh_dim_names or ())))
        pm.modules[0].register_forward_hook(held)
    params = [p for part in pm.modules for p in {id(q): q for q in part.parameters()}.values()]
    grad_bytes: list[int] = []  # ZeRO-1: every gradient is whole until the step drops the ones others own
    if pm.zero1 is not None:
        drop = pm.zero1.drop_unowned_grads
        pm.zero1.drop_unowned_grads = lambda: (grad_bytes.append(sum(_local_bytes(p.grad) for p in params
                                                                     if p.grad is not None)), drop())
    x, t = batches(1)[0]
    pm.train_step(pm.local_batch(x), pm.local_batch(t))
    moments = sum(_local_bytes(v) for st in pm.optimizer.state.values() for k, v in st.items()
                  if isinstance(v, torch.Tensor) and k != "step")
    dist_opt = pm.stepper if isinstance(pm.stepper, DistributedOptimizer) else None
    if dist_opt is not None:  # ZeRO-1 under a 16-bit policy: 16-bit parameters, fp32 main grads, owned masters
        got = {"weights": sum(_local_bytes(m) for m in dist_opt.masters), "grads": sum(_local_bytes(p.main_grad)
                                                                                      for p in params),
               "optimizer": moments, "compute_copies": sum(_local_bytes(p) for p in params)}
    else:
        got = {"weights": sum(_local_bytes(p) for p in params),
               "grads": max(grad_bytes, default=sum(_local_bytes(p.grad) for p in params if p.grad is not None)),
               "optimizer": moments}
    # bytes do not depend on the device: one H100 node of `world` GPUs (the CPU lists no fp16 throughput)
    node = dataclasses.replace(Cluster.preset("dgx-h100", nodes=1), devices_per_node=world)
    est = autopar.estimate(graph, node, plan.config)
    want = {k: est.memory_breakdown[k] for k in got}
    if "compute_copies" in got:  # the distributed optimizer's 16-bit parameters are the compute copy it prices
        want["compute_copies"] = est.memory_breakdown["compute_copies"]
    if gathered:  # the compute copies ZeRO-2 holds (those of ZeRO-0 live in autocast's cache, out of reach)
        got["compute_copies"], want["compute_copies"] = max(gathered), est.memory_breakdown["compute_copies"]
    return {"case": f"{precision} zero={zero_stage} tp={tp} rank={dist.get_rank()}", "got": got, "want": want}


def memory_cases(cases: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    return [memory_case(*c) for c in cases]


def _warmup_cosine(opt: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up then cosine decay, from torch.optim.lr_scheduler's own pieces."""
    from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

    return SequentialLR(opt, [LinearLR(opt, start_factor=0.1, total_iters=warmup),
                              CosineAnnealingLR(opt, T_max=total - warmup)], milestones=[warmup])


def _groups_by_name(named) -> torch.optim.Optimizer:
    """No weight decay on norms and biases (names ending in .bias, or holding 'ln'/'norm'), decay elsewhere."""
    named = list(named)
    no_decay = [(n, p) for n, p in named if n.endswith(".bias") or "ln" in n or "norm" in n]
    decay = [(n, p) for n, p in named if (n, p) not in no_decay]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-2, eps=1e-6)


def schedule_case(config: dict[str, Any], steps: int = 6) -> dict[str, Any]:
    """A warm-up + cosine LR schedule and name-based parameter groups on `pm.optimizer`, against the same
    schedule and groups on one process: learning rates and losses per step, weight decay per name."""
    model = build_model("gpt")
    graph = graph_of("gpt", model)
    data = batches(steps)
    ref_model = copy.deepcopy(model)
    ref_opt = _groups_by_name(ref_model.named_parameters())
    ref_sched = _warmup_cosine(ref_opt, 2, steps)
    ref_losses, ref_lrs = [], []
    for x, t in data:
        ref_opt.zero_grad()
        loss = lm_cross_entropy(logits_of(ref_model, x), t)
        loss.backward()
        ref_opt.step()
        ref_lrs.append(ref_opt.param_groups[0]["lr"])
        ref_sched.step()
        ref_losses.append(loss.item())
    pm = parallelize(model, make_plan(graph, precision="fp32", **config), graph=graph, optimizer=_groups_by_name,
                     loss_fn=lm_cross_entropy)
    sched = _warmup_cosine(pm.optimizer, 2, steps)
    losses, lrs = [], []
    for x, t in data:
        losses.append(pm.train_step(pm.local_batch(x), pm.local_batch(t)))
        lrs.append(pm.optimizer.param_groups[0]["lr"])
        sched.step()
    decay = {n: g["weight_decay"] for g in pm.optimizer.param_groups for n in g.get("param_names", ())}
    ref_decay = {n: g["weight_decay"] for g in ref_opt.param_groups for n in g["param_names"]}
    weight_excess, weight_key = excess(pm.full_state_dict(), {k: v.detach() for k, v in ref_model.state_dict().items()})
    return {"case": f"schedule {config}", "losses": losses, "ref_losses": ref_losses, "lrs": lrs, "ref_lrs": ref_lrs,
            "decay_ok": all(ref_decay[n] == d for n, d in decay.items()) and bool(decay),
            "is_optimizer": isinstance(pm.optimizer, torch.optim.AdamW),
            "weight_excess": weight_excess, "weight_key": weight_key}


def schedule_cases(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [schedule_case(c) for c in configs]


def job(policy: list | None = None, schedules: list | None = None, memory: list | None = None,
        overflow_root: str | None = None) -> dict[str, Any]:
    """Several kinds of case in one gloo job (one process start-up for all: the CI budget); the fp16
    overflow case runs when given a checkpoint folder."""
    return {"policy": policy_cases(policy or []), "schedules": schedule_cases(schedules or []),
            "memory": memory_cases(memory or []),
            "overflow": fp16_overflow_case(overflow_root) if overflow_root else None}
