"""Cases for tests/test_dist_optimizer.py, run inside gloo ranks: ZeRO-1 under a 16-bit policy as the
distributed optimizer (autopar.codegen.dist_optimizer) against one process running the same algorithm.

The reference is independent of autopar's runtime: the same initial model on one process, its parameters
cast to the compute dtype and fp32 masters kept beside them; each step runs the global batch as dp·m
micro-batches in rank order under `torch.autocast`, adds each 16-bit gradient into fp32 buffers, divides
them by dp (and unscales them under fp16, skipping a step whose norm is not finite and halving the scale),
clips with `clip_grad_norm_`, steps fp32 AdamW on the masters and rounds them into the parameters. The
old reference (fp32 parameters under autocast, precision_cases.py) differs from this algorithm wherever a
weight enters an op autocast does not cast (embeddings, norms): those read the 16-bit rounding here.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import torch
import torch.distributed as dist
from parity_models import batches, build_model, excess, graph_of, logits_of, make_plan
from precision_cases import _groups_by_name, _warmup_cosine, adamw, memory_case

from autopar.codegen import lm_cross_entropy, parallelize
from autopar.codegen.checkpoint import Checkpointer
from autopar.codegen.data_parallel import local
from autopar.codegen.dist_optimizer import DistributedOptimizer
from autopar.codegen.precision import LossScaler

__all__ = ["job", "reference"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def reference(model: torch.nn.Module, data, *, precision: str, dp: int, m: int, lr: float,
              max_grad_norm: float | None = None, poison: frozenset[int] = frozenset(), groups: bool = False
              ) -> tuple[list[float], list[float], dict[str, torch.Tensor], list[float]]:
    """(losses, gradient norms, final masters by name, learning rates) of the module docstring's algorithm; at
    the steps in `poison` one gradient element is made infinite after unscaling (an fp16 overflow); `groups`:
    parameter groups by name and a warm-up + cosine LR schedule (precision_cases' own)."""
    dtype = DTYPES[precision]
    named = list(model.named_parameters())
    masters = [p.detach().clone() for _, p in named]
    with torch.no_grad():
        for _, p in named:
            p.data = p.data.to(dtype)
    opt = (_groups_by_name([(n, w) for (n, _), w in zip(named, masters, strict=True)]) if groups
           else adamw(lr)(masters))
    sched = _warmup_cosine(opt, 2, len(data)) if groups else None
    lrs: list[float] = []
    scaler = LossScaler() if precision == "fp16" else None
    losses, norms = [], []
    for step, (x, t) in enumerate(data):
        scale = scaler.scale if scaler is not None else 1.0
        main = [torch.zeros_like(w) for w in masters]
        total = 0.0
        for xc, tc in zip(x.tensor_split(dp * m), t.tensor_split(dp * m), strict=True):
            with torch.autocast("cpu", dtype=dtype):
                loss = lm_cross_entropy(logits_of(model, xc), tc)
            (loss * (scale / m)).backward()
            for g, (_, p) in zip(main, named, strict=True):
                g += p.grad
                p.grad = None
            total += loss.item()
        losses.append(total / (dp * m))
        for g in main:
            g.div_(dp).mul_(1.0 / scale)
        if step in poison:
            main[0].view(-1)[0] = float("inf")
        # the norm as a sum of per-tensor squares in fp64: clip_grad_norm_'s fp32 norm of norms differs in the
        # last bit, and a last-bit change of a master can flip its 16-bit rounding (a 2^-8 relative step)
        norm = math.sqrt(sum(float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2 for g in main))
        norms.append(norm if math.isfinite(norm) else float("inf"))
        if scaler is not None:
            scaler.update(not math.isfinite(norm))
            if not math.isfinite(norm):
                continue
        coef = max_grad_norm / (norm + 1e-6) if max_grad_norm is not None else 1.0  # clip_grad_norm_'s rule
        for w, g in zip(masters, main, strict=True):
            w.grad = g.mul_(coef) if coef < 1.0 else g
        opt.step()
        with torch.no_grad():
            for w, (_, p) in zip(masters, named, strict=True):
                w.grad = None
                p.copy_(w)
        if sched is not None:
            lrs.append(opt.param_groups[0]["lr"])
            sched.step()
    return losses, norms, {n: w for (n, _), w in zip(named, masters, strict=True)}, lrs


def parity_case(kind: str, config: dict[str, Any], *, precision: str, lr: float = 1e-3,
                max_grad_norm: float | None = None, poison: tuple[int, ...] = (), steps: int = 4,
                groups: bool = False) -> dict[str, Any]:
    """The parallel run and the reference: losses, norms, final masters, the dtypes the rank holds, skips;
    `groups`: the user's parameter groups by name and LR schedule on `pm.optimizer` (learning rates, and each
    name's weight decay, against the reference's)."""
    model = build_model(kind)
    graph = graph_of(kind, model)
    data = batches(steps)
    dp, m = config.get("dp", 1), config.get("num_microbatches", 1)
    ref_losses, ref_norms, ref_masters, ref_lrs = reference(
        copy.deepcopy(model), data, precision=precision, dp=dp, m=m, lr=lr, max_grad_norm=max_grad_norm,
        poison=frozenset(poison), groups=groups)
    pm = parallelize(model, make_plan(graph, precision=precision, **config), graph=graph,
                     optimizer=_groups_by_name if groups else adamw(lr), loss_fn=lm_cross_entropy,
                     max_grad_norm=max_grad_norm)
    sched = _warmup_cosine(pm.optimizer, 2, steps) if groups else None
    lrs: list[float] = []
    scaler = pm.loss_scaler
    if scaler is not None and poison:
        unscale = scaler.unscale_
        now = {"step": -1}

        def poisoned(grads):  # rank 0's first gradient becomes inf after unscaling, as the reference's does
            grads = list(grads)
            unscale(grads)
            if now["step"] in poison and dist.get_rank() == 0:
                grads[0].view(-1)[0] = float("inf")

        scaler.unscale_ = poisoned
    losses, norms = [], []
    for step, (x, t) in enumerate(data):
        if scaler is not None and poison:
            now["step"] = step
        losses.append(pm.train_step(pm.local_batch(x), pm.local_batch(t)))
        norms.append(pm.grad_norm)
        if sched is not None:
            lrs.append(pm.optimizer.param_groups[0]["lr"])
            sched.step()
    weight_excess, weight_key = excess(pm.full_state_dict(), ref_masters)
    decay = {n: g["weight_decay"] for g in pm.optimizer.param_groups for n in g.get("param_names", ())}
    params = [p for part in pm.modules for p in part.parameters()]
    return {"case": f"{kind} {precision} clip={max_grad_norm} poison={poison} {config}", "losses": losses,
            "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms, "weight_excess": weight_excess,
            "weight_key": weight_key, "distributed": isinstance(pm.stepper, DistributedOptimizer),
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "optimizer_dtypes": sorted({str(p.dtype) for g in pm.optimizer.param_groups for p in g["params"]}),
            "skipped": scaler.skipped_steps if scaler is not None else 0, "lrs": lrs, "ref_lrs": ref_lrs,
            "decay_ok": not groups or (bool(decay) and all(d == (0.0 if n.endswith(".bias") or "ln" in n or "norm" in n
                                                                  else 0.1) for n, d in decay.items()))}


def _moments(pm) -> dict[str, torch.Tensor]:
    """Adam's moments of the parameters this rank steps, by parameter name (full tensors, on the CPU)."""
    from autopar.codegen.state import optimizer_state

    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in optimizer_state(pm.stepper, pm.modules).items() if k.endswith(("exp_avg", "exp_avg_sq"))}


def checkpoint_case(root: str, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two steps under `first`, saved; loaded into a fresh model (another seed) under `second`: the full state
    dicts (fp32 under both) and every moment the loading rank steps must equal the saved ones bit for bit;
    `pm.save`/`pm.load` one way, the Checkpointer's DCP files the other (`first` with ZeRO-1 saves through it)."""
    model = build_model("gpt")
    graph = graph_of("gpt", model)
    pm = parallelize(model, make_plan(graph, precision="bf16", **first), graph=graph, optimizer=adamw(1e-3),
                     loss_fn=lm_cross_entropy)
    for x, t in batches(2):
        pm.train_step(pm.local_batch(x), pm.local_batch(t))
    saved_state = pm.full_state_dict()
    saved_moments: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(saved_moments, _moments(pm))
    saved = {k: v for d in saved_moments for k, v in d.items()}
    through_checkpointer = first.get("zero_stage") == 1
    if through_checkpointer:
        Checkpointer(pm, root, model_name="gpt").save(2)
    else:
        pm.save(root)
    resumed = parallelize(build_model("gpt", seed=1), make_plan(graph, precision="bf16", **second), graph=graph,
                          optimizer=adamw(1e-3), loss_fn=lm_cross_entropy)
    if through_checkpointer:
        Checkpointer(resumed, root, model_name="gpt").resume()
    else:
        resumed.load(root)
    state = resumed.full_state_dict()
    moments = _moments(resumed)
    rounded = True  # the 16-bit parameters are the loaded masters rounded, on every rank
    if isinstance(resumed.stepper, DistributedOptimizer):
        full = resumed.stepper.full_precision()
        rounded = all(torch.equal(local(p), local(full[id(p)]).to(p.dtype)) for p in resumed.stepper.all_params)
    return {"case": f"{first} -> {second}", "state_equal": sorted(k for k in saved_state
                                                                   if not torch.equal(state[k], saved_state[k])),
            "state_dtypes": sorted({str(v.dtype) for v in state.values()}),
            "moments_equal": sorted(k for k in moments if not torch.equal(moments[k], saved[k])),
            "moments_checked": len(moments), "rounded": rounded}


def job(parity: list | None = None, memory: list | None = None, checkpoints: list | None = None,
        root: str | None = None) -> dict[str, Any]:
    """Every kind of case in one gloo job (one process start-up for all)."""
    ckpt = [checkpoint_case(os.path.join(root, str(i)), a, b) for i, (a, b) in enumerate(checkpoints or [])]
    return {"parity": [parity_case(kind, cfg, **kw) for kind, cfg, kw in parity or []],
            "memory": [memory_case(*c) for c in memory or []], "checkpoints": ckpt}
