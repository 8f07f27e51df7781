"""Forward and backward time of model layers, each given as a callable that runs it once.

The caller (autopar.profiling) builds one `LayerCase` per distinct layer signature, with real weights
and inputs on the device; this module only times them, so it needs no knowledge of models.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from cost_models.profile import layer_key
from cost_models.profiler.budget import trials_within
from cost_models.profiler.timing import synchronize, time_callable

__all__ = ["LayerCase", "measure_layer", "training_step"]


@dataclass(frozen=True, kw_only=True)
class LayerCase:
    signature: str  # the layer's signature in the captured graph
    micro_batch: int  # samples in the inputs the callable uses
    forward: Callable[[], Any]  # runs the layer with autograd on; returns its output tensor(s)
    label: str = ""  # for progress messages, e.g. "blocks.0"


def _grad_outputs(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    flat = tree_leaves(out)
    tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    return tensors, [torch.ones_like(t) for t in tensors]


def _backward_s(case: LayerCase, device: torch.device, reps: int) -> float:
    total = 0.0
    for _ in range(reps):
        tensors, grads = _grad_outputs(case.forward())
        synchronize(device)
        t0 = time.perf_counter()
        torch.autograd.backward(tensors, grads)
        synchronize(device)
        total += time.perf_counter() - t0
    return total / reps


def measure_layer(case: LayerCase, device: torch.device, *, quick: bool,
                  budget_s: float | None = None) -> dict[str, float]:
    """{layer_key(sig, "fwd", b): s, layer_key(sig, "bwd", b): s}; backward alone, forward re-run untimed.
    Within budget_s: half for the forward, the backward's repetitions and trials fit in what is left."""
    start = time.perf_counter()
    trials = 3 if quick else 5
    fwd = time_callable(case.forward, device, trial_s=0.02 if quick else 0.05, trials=trials, max_reps=50,
                        budget_s=None if budget_s is None else budget_s / 2)
    tensors, _ = _grad_outputs(case.forward())
    out = {layer_key(case.signature, "fwd", case.micro_batch): fwd}
    if tensors:
        first = _backward_s(case, device, 1)  # also the warm-up
        reps = max(1, min(20, int((0.04 if quick else 0.1) / max(fwd, 1e-6))))
        if budget_s is not None:  # each repetition re-runs the forward untimed
            per_trial = reps * (fwd + first)
            left = budget_s - (time.perf_counter() - start)
            reps = max(1, min(reps, int(left / (fwd + first))))
            trials = trials_within(left, 0.0, trial_s=reps * (fwd + first), most=trials) if per_trial > 0 else 1
            if left < 2 * (fwd + first):
                out[layer_key(case.signature, "bwd", case.micro_batch)] = first
                return out
        out[layer_key(case.signature, "bwd", case.micro_batch)] = statistics.median(
            _backward_s(case, device, reps) for _ in range(trials))
    return out


def training_step(cases: list[LayerCase]) -> Callable[[], None]:
    """One forward and backward of every case: the model's own kernels, for timing how they slow down
    in several processes at once (contention.py)."""
    def step() -> None:
        for case in cases:
            tensors, grads = _grad_outputs(case.forward())
            if tensors:
                torch.autograd.backward(tensors, grads)
    return step
