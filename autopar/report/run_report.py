"""Predicted beside measured: a plan's breakdown against a RunRecord of that plan, component by component.

A component is *flagged* when its measured time is more than `threshold` (default 25%) off its
prediction, relative to the prediction. Components below a noise floor on both sides (default 2% of the
measured step) are not flagged: a 0.3 ms loss all-reduce against a predicted 0 says nothing about the
model. Recompute is not measured apart from the forward/backward it runs in (autopar.codegen.timing),
so the compute row holds predicted compute + recompute against measured compute. Likewise a gloo send
completes only when the neighbour posts its receive, so the time blocked in sends is partly waiting for
that neighbour: point-to-point transfer and pipeline bubble form one row, "pipeline".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from autopar.plan import BREAKDOWN_KEYS, Plan
from autopar.record import RunRecord

__all__ = ["ComponentRow", "RunComparison", "compare", "render_text", "FLAG_THRESHOLD", "NOISE_FLOOR_FRACTION"]

FLAG_THRESHOLD = 0.25
NOISE_FLOOR_FRACTION = 0.02
# Rows of the comparison: breakdown keys, merged where the runtime cannot tell them apart (docstring).
ROWS: dict[str, tuple[str, ...]] = {"compute": ("compute", "recompute"), "tp_comm": ("tp_comm",),
                                    "dp_comm": ("dp_comm",), "optimizer": ("optimizer",),
                                    "pipeline": ("pp_comm", "pipeline_bubble")}


@dataclass(frozen=True, kw_only=True)
class ComponentRow:
    name: str
    predicted_s: float
    measured_s: float
    error: float | None  # (measured − predicted) / predicted; None when nothing was predicted
    flagged: bool


@dataclass(frozen=True, kw_only=True)
class RunComparison:
    model_name: str
    config: str
    world_size: int
    steps: int
    predicted_step_time_s: float
    measured_step_time_s: float
    step_error: float
    components: tuple[ComponentRow, ...]
    stages: tuple[dict[str, float], ...]  # measured breakdown per pipeline rank
    bottleneck_rank: int
    calls_per_step: dict[str, float]  # collectives / p2p operations the bottleneck rank issued, by axis
    threshold: float
    noise_floor_s: float
    predicted_peak_memory_bytes: int = 0
    measured_peak_memory_bytes: int = 0  # the largest rank's torch.cuda.max_memory_allocated; 0: not measured
    cpu: str = ""  # the host CPU the run was measured on (RunRecord.cpu)

    @property
    def flagged(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.components if r.flagged)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["components"] = [dataclasses.asdict(r) for r in self.components]
        d["flagged"] = list(self.flagged)
        return d


def _row(name: str, predicted: float, measured: float, threshold: float, floor_s: float) -> ComponentRow:
    error = (measured - predicted) / predicted if predicted > 0 else None
    below_floor = max(predicted, measured) < floor_s
    flagged = not below_floor and (error is None or abs(error) > threshold)
    return ComponentRow(name=name, predicted_s=predicted, measured_s=measured, error=error, flagged=flagged)


def compare(plan: Plan, record: RunRecord, *, threshold: float = FLAG_THRESHOLD,
            noise_floor_fraction: float = NOISE_FLOOR_FRACTION) -> RunComparison:
    """Refuses a record of another plan (PlanMismatchError), then compares component by component."""
    if not (threshold > 0 and math.isfinite(threshold)):
        raise ValueError(f"threshold={threshold}; it must be a positive fraction, e.g. 0.25")
    record.check_plan(plan)
    predicted = dict(plan.estimate.breakdown)
    measured = record.breakdown()
    step_m = record.measured_step_time_s
    floor_s = noise_floor_fraction * step_m
    rows = tuple(_row(name, sum(predicted.get(k, 0.0) for k in keys), sum(measured[k] for k in keys), threshold,
                      floor_s) for name, keys in ROWS.items())
    step_p = plan.estimate.step_time_s
    return RunComparison(model_name=plan.model_name, config=str(plan.config), world_size=plan.world_size,
                         steps=record.steps, predicted_step_time_s=step_p, measured_step_time_s=step_m,
                         step_error=(step_m - step_p) / step_p, components=rows,
                         stages=tuple(record.stage_breakdowns()), bottleneck_rank=record.bottleneck.rank,
                         calls_per_step=dict(record.bottleneck.calls_per_step),
                         threshold=threshold, noise_floor_s=floor_s,
                         predicted_peak_memory_bytes=plan.estimate.peak_memory_bytes,
                         measured_peak_memory_bytes=max(r.peak_memory_bytes for r in record.ranks),
                         cpu=record.cpu)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f} ms"


def _err(error: float | None) -> str:
    return "      n/a" if error is None else f"{error * 100:+8.1f}%"


def render_text(c: RunComparison) -> str:
    lines = [f"autopar report: {c.model_name}, {c.config} on {c.world_size} process(es), "
             f"median of {c.steps} measured steps",
             *([f"host CPU: {c.cpu}"] if c.cpu else []),
             "",
             f"{'':<18}{'predicted':>12}{'measured':>12}{'error':>10}",
             f"{'step':<18}{_ms(c.predicted_step_time_s):>12}{_ms(c.measured_step_time_s):>12}"
             f"{_err(c.step_error):>10}"]
    for r in c.components:
        mark = "  <-- off by more than " + f"{c.threshold:.0%}" if r.flagged else ""
        lines.append(f"  {r.name:<16}{_ms(r.predicted_s):>12}{_ms(r.measured_s):>12}{_err(r.error):>10}{mark}")
    lines.append(f"(measured breakdown of the bottleneck rank {c.bottleneck_rank}; compute includes recompute, "
                 f"pipeline is p2p + bubble; not flagged below {c.noise_floor_s * 1e3:.1f} ms)")
    if c.calls_per_step:
        lines.append("collectives issued per step by that rank: "
                     + ", ".join(f"{axis} {n:g}" for axis, n in c.calls_per_step.items()))
    if len(c.stages) > 1:
        lines += ["", "measured per pipeline stage (busiest rank of each)"]
        keys = [k for k in BREAKDOWN_KEYS if k != "recompute"]
        lines.append("  stage " + "".join(f"{k:>16}" for k in keys))
        for i, s in enumerate(c.stages):
            lines.append(f"  {i:>5} " + "".join(f"{_ms(s[k]):>16}" for k in keys))
    if c.measured_peak_memory_bytes:
        p, m = c.predicted_peak_memory_bytes, c.measured_peak_memory_bytes
        error = _err((m - p) / p if p else None)
        lines += ["", f"{'peak memory':<18}{p / 2**30:8.2f} GiB{m / 2**30:8.2f} GiB{error:>10}"
                      "  (largest rank's torch.cuda.max_memory_allocated)"]
    flagged = c.flagged
    lines += ["", f"flagged: {', '.join(flagged)}" if flagged else "flagged: none"]
    return "\n".join(lines)
