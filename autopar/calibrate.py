"""Fold what real runs measured back into the profile the next plan starts from.

What is adjusted, and why that is sound:

- Kernel compute. Every kernel time the planner predicts from a profile comes from its measured tables —
  GEMM and elementwise (time against work or shape, interpolated, extrapolated at the best rate) and the
  eager-op floor (cost_models.compute). Multiplying every time in those tables by a multiplies every
  predicted kernel time by exactly a (the model is homogeneous of degree 1 in the table times), so a
  plan re-priced on the calibrated profile predicts a× the kernel time it did. a is the in-situ cost of
  this model's kernels (small shapes, framework dispatch between them, a load that changed since the
  profile) relative to the micro-benchmarks. Processes sharing cores, caches and the machine's other
  load are measured before that (Profile.process_slowdown, the kernel mix timed in n processes at once,
  applied by Cluster.local), so a stays near 1 on the machine the profile describes.
- Host overhead. The planner prices DTensor's dispatch (tensor parallelism on CPU) from the profile's host
  floor, not its kernel tables, and reports that part of its prediction (Estimate.host_s). It is scaled
  by its own factor h: it is Python work that runs while the peer ranks wait in latency-bound
  collectives, so it neither shares cores as kernels do nor gains from the same in-situ factor. Measured
  here (`benchmarks/predict_vs_measure.py`): one compute factor per process count left DP4 ZeRO-1 35%
  under and PP+TP 9% over at 4 processes; the two factors bring all seven layouts within 20%.
- The fit (`fit_calibration`), on measured / predicted (compute + recompute + optimizer): a from the runs
  whose predicted host share is under HOST_SHARE (the ratio of sums for one or two runs, the median of the
  per-run ratios from three on, so that one run disturbed by other work does not set it); h from the
  others, on what a leaves: (measured − a·kernels) / host. With no run of one kind, h = a (one factor).
- Communication. Per group size K, the profiled collective tables of K ranks are multiplied by the
  same kind of ratio of the components carried by K-rank groups (tp_comm on tp = K, dp_comm on
  dp = K), which scales every collective of K ranks predicted from them by the same factor.
- Point-to-point. The p2p table is multiplied by measured / predicted pp_comm of the pipelined runs. On
  gloo a send returns only once the peer has posted its receive, so the measured send time of a pipeline
  holds waits for the neighbour. The profiler times each send after a compute segment on both ranks
  (profiler.collectives), which holds the wait for a peer that arrives later or was descheduled; what
  is left is the schedule's own wait for the neighbour's work, which this factor prices into each
  boundary send, so that schedules with more boundaries (interleaving) cost what they do.
- Nothing else: the pipeline bubble follows from the calibrated stage times; components predicted as
  zero (e.g. a data-parallel sync the planner assumes hidden) cannot be scaled, and stay in the report.

A run is only folded into the profile its plan was priced with (the plan's cluster fingerprint must
equal Cluster.local(nproc, profile)'s), measured on the same machine; anything else is refused.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.errors import ProfileMismatchError
from autopar.record import RunRecord
from cost_models.profile import Profile, scale_profile

__all__ = ["Calibration", "fit_calibration", "calibrate", "COMPUTE_KEYS", "HOST_SHARE"]

COMPUTE_KEYS = ("compute", "recompute", "optimizer")
# a run whose predicted host overhead is below this share of its predicted compute calibrates the kernels
HOST_SHARE = 0.1


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """The fitted factors and the sums they came from (seconds, summed over runs)."""

    compute_factor: float
    host_factor: float
    comm_factors: dict[int, float]  # group size → factor
    p2p_factor: float = 1.0
    measured_compute_s: float
    predicted_compute_s: float
    runs: int

    def describe(self) -> str:
        comm = ", ".join(f"{k}-rank collectives ×{v:.3f}" for k, v in sorted(self.comm_factors.items()))
        return (f"calibrated from {self.runs} run(s): kernels ×{self.compute_factor:.3f}, host overhead "
                f"×{self.host_factor:.3f} (compute measured {self.measured_compute_s * 1e3:.1f} ms vs predicted "
                f"{self.predicted_compute_s * 1e3:.1f} ms)" + (f"; {comm}" if comm else "")
                + (f"; point-to-point ×{self.p2p_factor:.3f}" if self.p2p_factor != 1.0 else ""))


def _ratio(pairs: list[tuple[float, float]]) -> float:
    """measured / predicted over (measured, predicted) pairs: ratio of sums (the least-squares fit of
    measured = k·predicted weighted by 1/predicted) for ≤ 2 pairs, else the median of the ratios."""
    if len(pairs) <= 2:
        return sum(m for m, _ in pairs) / sum(p for _, p in pairs)
    return statistics.median(m / p for m, p in pairs)


def fit_calibration(records: Sequence[RunRecord]) -> Calibration:
    """Kernel, host and per-group-size communication factors (module docstring)."""
    if not records:
        raise ValueError("calibration needs at least one run record")
    rows: list[tuple[float, float, float]] = []  # (measured, predicted kernels, predicted host)
    comm: dict[int, list[tuple[float, float]]] = {}
    p2p: list[tuple[float, float]] = []
    for r in records:
        measured = r.breakdown()
        pred = sum(r.predicted_breakdown.get(k, 0.0) for k in COMPUTE_KEYS)
        host = min(max(r.predicted_host_s, 0.0), pred)
        rows.append((sum(measured[k] for k in COMPUTE_KEYS), pred - host, host))
        for key, size in (("tp_comm", r.config.tp), ("dp_comm", r.config.dp)):
            if size > 1 and r.predicted_breakdown.get(key, 0.0) > 0:
                comm.setdefault(size, []).append((measured[key], r.predicted_breakdown[key]))
        if r.config.pp > 1 and r.predicted_breakdown.get("pp_comm", 0.0) > 0 and measured["pp_comm"] > 0:
            p2p.append((measured["pp_comm"], r.predicted_breakdown["pp_comm"]))
    meas_c, pred_c = sum(m for m, _, _ in rows), sum(k + h for _, k, h in rows)
    if pred_c <= 0 or meas_c <= 0 or any(k + h <= 0 for _, k, h in rows):
        raise ValueError(f"cannot calibrate compute: measured {meas_c} s, predicted {pred_c} s "
                         f"(per run, measured / kernels / host: {rows})")
    kernel_runs = [(m, k) for m, k, h in rows if h <= HOST_SHARE * (k + h) and k > 0]
    host_runs = [(m, k, h) for m, k, h in rows if h > HOST_SHARE * (k + h)]
    if kernel_runs and host_runs:
        a = _ratio(kernel_runs)
        # what the kernels leave of the measured compute is host; at least a tenth of the prediction, so
        # that one run where the kernels alone overshoot cannot zero the host overhead
        h = _ratio([(max(m - a * k, 0.1 * h), h) for m, k, h in host_runs])
    else:
        a = h = _ratio([(m, k + h) for m, k, h in rows])
    factors = {k: _ratio(v) for k, v in comm.items()}
    return Calibration(compute_factor=a, host_factor=h, comm_factors={k: f for k, f in factors.items() if f > 0},
                       p2p_factor=_ratio(p2p) if p2p else 1.0,
                       measured_compute_s=meas_c, predicted_compute_s=pred_c, runs=len(records))


def _check(record: RunRecord, profile: Profile, where: str) -> None:
    from autopar.cluster import Cluster

    record.check_machine(hostname=profile.machine.hostname, device_name=profile.device_name,
                         torch_version=profile.torch_version, where=where)
    expected = Cluster.local(nproc=record.world_size, profile=profile).fingerprint
    if expected != record.cluster_fingerprint:
        raise ProfileMismatchError(
            f"{where} ran a plan priced on cluster {record.cluster_fingerprint}, but this profile on "
            f"{record.world_size} local processes gives cluster {expected}: the plan was made with another "
            "profile. Pass the profile the plan was made with (`autopar plan ... --profile P`), or re-plan "
            "with this one and record a new run."
        )


def calibrate(records: Sequence[RunRecord], profile: Profile, *, names: Sequence[str] | None = None
              ) -> tuple[Profile, Calibration]:
    """The calibrated profile and the factors, after refusing runs from another machine or profile."""
    names = list(names or [f"run {i}" for i in range(len(records))])
    for record, name in zip(records, names, strict=True):
        _check(record, profile, name)
    cal = fit_calibration(records)
    return scale_profile(profile, compute=cal.compute_factor, host=cal.host_factor, comm=cal.comm_factors,
                         p2p=cal.p2p_factor, note=cal.describe()), cal
