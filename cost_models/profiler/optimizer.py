"""Time the optimizer phase's per-tensor loops as the training runtime runs them (Profile.optimizer).

Three loops (cost_models.optimizer_step prices from them): torch.optim.AdamW.step with torch's default
implementation on this device (its for-loop on a CPU, foreach on a GPU), the global gradient norm's
reads (autopar.codegen.clipping.global_grad_norm: vector_norm in fp32, cast, square, add, per tensor)
and an in-place scale of every gradient (fp16 unscaling: autopar.codegen.precision LossScaler.unscale_).
Each on a sweep of uniform tensors: 64 tensors of 64 elements (the per-tensor cost), then 16 × 2^14,
4 × 2^17, 2 × 2^20 and 1 × 2^22 elements (the streaming rate by tensor size: cache-resident to DRAM);
and, when the profile has a model, AdamW and the norm on that model's own parameter shapes (recorded to
set against the law; at most MODEL_PARAMS_MAX elements). In fp32, the dtype of the masters the optimizer
steps under every precision policy (cost_models.precision). About a second on this 2-vCPU VM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from cost_models.profile import OptimizerSample
from cost_models.profiler.budget import SizeSweep
from cost_models.profiler.timing import time_callable

__all__ = ["SWEEP", "MODEL_PARAMS_MAX", "measure_optimizer", "adamw_implementation"]

SWEEP = ((64, 64), (16, 2**14), (4, 2**17), (2, 2**20), (1, 2**22))  # (tensors, elements each)
MODEL_PARAMS_MAX = 2**24  # 16 M elements: 256 MB of parameters, gradients and moments
# Only to order the sweep and predict what the budget allows (budget.SizeSweep): a nominal 50 µs per
# tensor and 80 B per element at 10 GB/s, about this VM's; the samples are what the law uses.
_NOMINAL_TENSOR_S = 50e-6
_NOMINAL_PARAM_S = 8e-9

Progress = Callable[[str, float], None]


def adamw_implementation(params: Sequence[torch.Tensor]) -> str:
    """What torch.optim.AdamW (foreach and fused unset) runs over `params`: "fused", "foreach" or "for-loop"."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    fused, foreach = _default_to_fused_or_foreach(list(params), differentiable=False, use_fused=False)
    return "fused" if fused else "foreach" if foreach else "for-loop"


def _tensors(shapes: Sequence[tuple[int, ...]], device: torch.device) -> list[torch.Tensor]:
    out = []
    for shape in shapes:
        p = torch.randn(shape, device=device).requires_grad_(True)
        p.grad = torch.randn(shape, device=device)
        out.append(p)
    return out


def _loops(params: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)  # the step's math is independent of values
    grads = [p.grad for p in params]

    def grad_norm() -> float:
        total = torch.zeros((), dtype=torch.float64, device=params[0].device)
        for g in grads:
            total += torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2
        return total.item()

    def scale() -> None:
        for g in grads:
            g.mul_(1.0)

    return {"adamw": opt.step, "grad_norm": grad_norm, "scale": scale}


def _nominal_s(point: tuple[tuple[int, tuple], bool], model_numel: int) -> float:
    (n, shape), model = point
    return n * _NOMINAL_TENSOR_S + (model_numel if model else n * shape[0]) * _NOMINAL_PARAM_S


def measure_optimizer(device: torch.device, progress: Progress, clock: str = "wall", budget_s: float = math.inf,
                      model_shapes: Sequence[tuple[int, ...]] = ()) -> list[OptimizerSample]:
    """The sweep (module docstring), each loop a range of its own, then the model's shapes, within budget_s."""
    points = [((n, (size,)), False) for n, size in SWEEP]
    numel = sum(math.prod(s) for s in model_shapes)
    if model_shapes and numel <= MODEL_PARAMS_MAX:
        points.append(((len(model_shapes), tuple(model_shapes)), True))
    kinds = ("adamw", "grad_norm", "scale")
    # the per-tensor point first (the law needs it), then increasing work, as SizeSweep predicts from the last
    points[1:] = sorted(points[1:], key=lambda pt: _nominal_s(pt, numel))
    work = [_nominal_s(pt, numel) for pt in points]
    sweep = SizeSweep(budget_s, [(k, work[i]) for k in kinds for i, (_, model) in enumerate(points)
                                 if not (model and k == "scale")])
    out: list[OptimizerSample] = []
    impl = ""
    for kind in kinds:
        for i, ((n, shape), model) in enumerate(points):
            if model and kind == "scale":
                continue
            share = sweep.share_s(kind, work[i])
            if share is None:
                continue
            params = _tensors(list(shape) if model else [shape] * n, device)
            impl = impl or adamw_implementation(params)
            t = time_callable(_loops(params)[kind], device, trials=3, trial_s=0.02, clock=clock, budget_s=share)
            sweep.done(work[i], t, kind)
            total = sum(p.numel() for p in params)
            out.append(OptimizerSample(kind=kind, tensors=len(params), params=total, time_s=t,
                                       implementation=impl if kind == "adamw" else "", model_shapes=model))
            what = "the model's parameters" if model else f"{n} x {shape[0]:,}"
            label = f"optimizer adamw ({impl})" if kind == "adamw" else f"optimizer {kind}"
            progress(f"{label} over {what} ({len(params)} tensors, {total:,} elements): {t * 1e3:.3f} ms",
                     sweep.expected_left_s())
    return out
