"""Fold what real runs measured back into the profile the next plan starts from.

What is adjusted, and why that is sound:

- Compute. Every compute time the planner predicts from a profile comes from its measured tables —
  GEMM and elementwise (time against work, interpolated log-log, extrapolated at the best rate) and
  the eager-op floor (cost_models.compute). Multiplying every time in those tables by k multiplies
  every predicted compute time by exactly k (the model is homogeneous of degree 1 in the table times),
  so a plan re-priced on the calibrated profile predicts k× the compute it did. k is fitted on
  measured / predicted of (compute + recompute + optimizer) over the runs given (`fit_calibration`: the
  ratio of the sums for one or two runs, the median of the per-run ratios from three on, so that one run
  disturbed by other work on a shared machine does not set the factor): the in-situ cost of
  this model's kernels (small shapes, cache misses, framework dispatch, DTensor wrappers) relative to
  the isolated micro-benchmarks. Processes sharing cores is modelled before that (Cluster.local divides
  the machine among the processes), so k is a property of model and machine, not of the layout.
- Compute per process count. How much N processes slow each other beyond that core division (shared
  caches, memory bandwidth, hyper-threaded or oversubscribed vCPUs) depends on N, not on the layout: the
  ratio for the runs of N processes over k is kept per N (Profile.compute_scale_by_nproc) and applied by
  Cluster.local(nproc=N). Measured here: 2 processes on the 2 vCPUs ran ~2× the single-process tables'
  prediction while 4 and 8 ran close to the core-division model (`benchmarks/predict_vs_measure.py`).
- Communication. Per group size K, the profiled collective tables of K ranks are multiplied by the
  same kind of ratio of the components carried by K-rank groups (tp_comm on tp = K, dp_comm on
  dp = K), which scales every collective of K ranks predicted from them by the same factor.
- Nothing else: the pipeline bubble follows from the calibrated stage times; components predicted as
  zero (e.g. a data-parallel sync the planner assumes hidden) cannot be scaled, and stay in the report.

A run is only folded into the profile its plan was priced with (the plan's cluster fingerprint must
equal Cluster.local(nproc, profile)'s), measured on the same machine; anything else is refused.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.errors import ProfileMismatchError
from autopar.record import RunRecord
from cost_models.profile import Profile

__all__ = ["scale_profile", "Calibration", "fit_calibration", "calibrate", "COMPUTE_KEYS"]

COMPUTE_KEYS = ("compute", "recompute", "optimizer")


def scale_profile(profile: Profile, *, compute: float = 1.0, comm: dict[int, float] | None = None,
                  compute_by_nproc: dict[int, float] | None = None, note: str = "") -> Profile:
    """`profile` with compute table times × `compute`, K-rank collective times × comm[K], and runs of
    N processes' compute × compute_by_nproc[N] on top (kept in Profile.compute_scale_by_nproc)."""
    factors = [compute, *(comm or {}).values(), *(compute_by_nproc or {}).values()]
    if any(not f > 0 for f in factors):
        raise ValueError(f"scale factors must be positive; got compute={compute}, comm={comm}, "
                         f"compute_by_nproc={compute_by_nproc}")
    comm = comm or {}
    by_nproc = dict(profile.compute_scale_by_nproc)
    for n, f in (compute_by_nproc or {}).items():
        by_nproc[n] = by_nproc.get(n, 1.0) * f
    notes = "; ".join(n for n in (profile.notes, note) if n)
    return dataclasses.replace(
        profile,
        gemm=tuple(dataclasses.replace(g, time_s=g.time_s * compute) for g in profile.gemm),
        elementwise=tuple(dataclasses.replace(e, time_s=e.time_s * compute) for e in profile.elementwise),
        launch_overhead_s=profile.launch_overhead_s * compute,
        layer_times={k: v * compute for k, v in profile.layer_times.items()},
        compute_scale_by_nproc=by_nproc,
        collectives=tuple(dataclasses.replace(c, time_s=c.time_s * comm.get(c.group_size, 1.0))
                          for c in profile.collectives),
        notes=notes)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """The fitted factors and the sums they came from (seconds, summed over runs)."""

    compute_factor: float
    comm_factors: dict[int, float]  # group size → factor
    # process count → compute factor relative to compute_factor (how much more or less N processes slow
    # each other than the runs on average); only for counts some run had
    compute_factors_by_nproc: dict[int, float] = dataclasses.field(default_factory=dict)
    measured_compute_s: float
    predicted_compute_s: float
    runs: int

    def describe(self) -> str:
        comm = ", ".join([f"{k}-rank collectives ×{v:.3f}" for k, v in sorted(self.comm_factors.items())]
                         + [f"compute of {n} processes ×{v:.3f} more" for n, v in
                            sorted(self.compute_factors_by_nproc.items()) if abs(v - 1.0) > 1e-12])
        return (f"calibrated from {self.runs} run(s): compute ×{self.compute_factor:.3f} (measured "
                f"{self.measured_compute_s * 1e3:.1f} ms vs predicted {self.predicted_compute_s * 1e3:.1f} ms)"
                + (f"; {comm}" if comm else ""))


def _ratio(pairs: list[tuple[float, float]]) -> float:
    """measured / predicted over (measured, predicted) pairs: ratio of sums (the least-squares fit of
    measured = k·predicted weighted by 1/predicted) for ≤ 2 pairs, else the median of the ratios."""
    if len(pairs) <= 2:
        return sum(m for m, _ in pairs) / sum(p for _, p in pairs)
    return statistics.median(m / p for m, p in pairs)


def fit_calibration(records: Sequence[RunRecord]) -> Calibration:
    """Compute and per-group-size communication factors (module docstring)."""
    if not records:
        raise ValueError("calibration needs at least one run record")
    compute: list[tuple[float, float]] = []
    by_nproc: dict[int, list[tuple[float, float]]] = {}
    comm: dict[int, list[tuple[float, float]]] = {}
    for r in records:
        measured = r.breakdown()
        compute.append((sum(measured[k] for k in COMPUTE_KEYS),
                        sum(r.predicted_breakdown.get(k, 0.0) for k in COMPUTE_KEYS)))
        by_nproc.setdefault(r.world_size, []).append(compute[-1])
        for key, size in (("tp_comm", r.config.tp), ("dp_comm", r.config.dp)):
            if size > 1 and r.predicted_breakdown.get(key, 0.0) > 0:
                comm.setdefault(size, []).append((measured[key], r.predicted_breakdown[key]))
    meas_c, pred_c = sum(m for m, _ in compute), sum(p for _, p in compute)
    if pred_c <= 0 or meas_c <= 0 or any(p <= 0 for _, p in compute):
        raise ValueError(f"cannot calibrate compute: measured {meas_c} s, predicted {pred_c} s "
                         f"(per run: {compute})")
    factors = {k: _ratio(v) for k, v in comm.items()}
    overall = _ratio(compute)
    return Calibration(compute_factor=overall, comm_factors={k: f for k, f in factors.items() if f > 0},
                       compute_factors_by_nproc={n: _ratio(v) / overall for n, v in by_nproc.items()},
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
    return scale_profile(profile, compute=cal.compute_factor, comm=cal.comm_factors,
                         compute_by_nproc=cal.compute_factors_by_nproc, note=cal.describe()), cal
