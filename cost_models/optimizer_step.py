"""The optimizer phase's time law, fitted to what the profile measured (Profile.optimizer).

The phase is a handful of per-tensor loops (autopar.codegen.runtime `_step`): the global gradient norm
reads every local gradient (one vector_norm, a cast, a square and an add per tensor), fp16 unscales
every gradient in place, and torch.optim.AdamW steps the parameters the rank updates. On a CPU torch
runs AdamW as a Python for-loop over the tensors (`_single_tensor_adam`: foreach and fused are its
defaults on GPUs only), about ten eager ops per tensor, so a step over many small tensors costs the
per-op floor many times over, not the bytes it streams: gpt-tiny's 69 tensors (1.1 M parameters) take
~10 ms on one core of this VM where 80 B per parameter at the table rate priced 2–5 ms. Each loop is
priced as

    t(n tensors, P elements) = n · per_tensor_s + P · per_param_s(P / n)

per_tensor_s from the sweep point of 64 tensors of 64 elements (their data is a negligible share of
the time), per_param_s (seconds per element: the loop's bytes over its streaming rate) at the tensors'
size, log-log interpolated between the sweep points, whose time less n · per_tensor_s it is: the loops
run tensor by tensor, so a tensor's size, not the step's total, sets whether its passes hit cache.
The profile times these loops with the training processes' threads, and Cluster.local scales them with
the other kernel tables by the measured slowdown of n processes at once (profile.scale_profile).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cost_models.profile import OPTIMIZER_LOOPS, OptimizerSample, Profile

__all__ = ["LoopLaw", "OptimizerLaws", "fit_loop"]


@dataclass(frozen=True, kw_only=True)
class LoopLaw:
    """t = tensors · per_tensor_s + params · per_param_s at the tensors' mean size (module docstring)."""

    kind: str
    per_tensor_s: float
    sizes: tuple[float, ...]  # elements per tensor of the sweep points, increasing
    per_param_s: tuple[float, ...]  # seconds per element at each size

    def seconds_per_param(self, size: float) -> float:
        """Seconds per element for tensors of `size` elements: interpolated in log size, clamped at the ends."""
        if len(self.sizes) == 1 or size <= self.sizes[0]:
            return self.per_param_s[0]
        if size >= self.sizes[-1]:
            return self.per_param_s[-1]
        return float(np.exp(np.interp(math.log(size), np.log(self.sizes), np.log(self.per_param_s))))

    def rate_Bps(self, size: float, bytes_per_param: float) -> float:
        """The loop's streaming rate at that size, counting bytes_per_param per element."""
        return bytes_per_param / self.seconds_per_param(size)

    def time_s(self, tensors: float, params: float) -> float:
        """Seconds of the loop over `tensors` tensors holding `params` elements (fractions allowed: a
        rank's average share)."""
        if tensors <= 0 or params <= 0:
            return 0.0
        return tensors * self.per_tensor_s + params * self.seconds_per_param(params / tensors)


def fit_loop(samples: list[OptimizerSample]) -> LoopLaw | None:
    """The law of one loop from its uniform sweep points (module docstring); None with fewer than two."""
    uniform = sorted((s for s in samples if not s.model_shapes), key=lambda s: s.params / s.tensors)
    if len(uniform) < 2:
        return None
    tiny, rest = uniform[0], uniform[1:]
    per_tensor = tiny.time_s / tiny.tensors
    # at least a tenth of the measured time is the elements': a noisy tiny point must not zero a size
    per_param = [max(s.time_s - s.tensors * per_tensor, 0.1 * s.time_s) / s.params for s in rest]
    return LoopLaw(kind=uniform[0].kind, per_tensor_s=per_tensor,
                   sizes=tuple(s.params / s.tensors for s in rest), per_param_s=tuple(per_param))


@dataclass(frozen=True, kw_only=True)
class OptimizerLaws:
    """The fitted law of each measured loop (OPTIMIZER_LOOPS), and torch's AdamW implementation."""

    laws: dict[str, LoopLaw]
    implementation: str

    @classmethod
    def from_profile(cls, profile: Profile | None) -> OptimizerLaws | None:
        """The profile's laws; None when it measured no AdamW sweep (files written before it, GPU catalogs)."""
        if profile is None or not profile.optimizer:
            return None
        laws = {k: law for k in OPTIMIZER_LOOPS
                if (law := fit_loop([s for s in profile.optimizer if s.kind == k])) is not None}
        if "adamw" not in laws:
            return None
        impl = next((s.implementation for s in profile.optimizer if s.kind == "adamw"), "")
        return cls(laws=laws, implementation=impl)

    def time_s(self, kind: str, tensors: float, params: float) -> float:
        """Seconds of loop `kind`; 0 when the profile did not measure it."""
        law = self.laws.get(kind)
        return law.time_s(tensors, params) if law is not None else 0.0
