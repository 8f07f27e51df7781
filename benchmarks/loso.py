"""Leave-one-source-out (LOSO) validation of the cost model against published runs.

Everything derived from published runs is derived again without the source under test: the cost model's
one fitted quantity (the fraction of burst tensor-core throughput a GPU sustains in training,
cost_models.compute.sustained_fraction: every run is priced at each of SUSTAINED_GRID, and the
MAPE-minimising fraction of the training sources prices the held-out one), the baseline's one MFU
(6·N·tokens at a single utilisation, the MAPE-minimising one) and the error band (the spread of the
model's residuals on runs of the same kind). No constant of the cost model is keyed by a run or a source
(tests/test_no_run_keyed_constants.py).

Pure functions over `Row`s (no torch, no autopar), so tests can check them on synthetic numbers.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

import numpy as np

# the spread a band reports: with at least BAND_QUANTILE_MIN_RUNS runs, the 10th and 90th percentiles of
# their residuals, each source weighing alike (`_spread`); with fewer runs, their minimum and maximum
BAND_QUANTILES = (0.10, 0.90)
BAND_QUANTILE_MIN_RUNS = 10
# a band needs runs of at least this many sources of its kind (parallelism kind and hardware); with fewer it
# widens to the kind on any hardware, then to every run. A band is read for a source it was not derived from,
# and what varies from one source to the next (framework, cluster, how it reports) is most of the error: the
# spread of one or two sources' runs is their own and misses the next source (leave-one-source-out coverage
# 51% with a three-run minimum over 108 runs of 11 sources, 90% with this one: benchmarks/published_runs.py)
BAND_MIN_SOURCES = 4
# the sustained fractions every run is priced at, and the step of the fit between them (a run's step time
# is interpolated linearly in 1/fraction: compute time scales so)
SUSTAINED_GRID = (0.70, 0.75, 0.80, 0.85, 0.90, 0.95, 1.00)
FIT_STEP = 0.005


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One priced run: what LOSO needs of it."""

    name: str
    source_id: str
    kind: str  # parallelism kind (cost_models.error_band.layout_kind)
    hardware: str  # device family, e.g. "a100", "h100"
    published_s: float
    predicted_s: float
    ideal_s: float  # step time at MFU 1: 6·N·tokens / (gpus · peak)
    # (sustained fraction, predicted step time) at each of SUSTAINED_GRID; empty: predicted_s at any fraction
    curve: tuple[tuple[float, float], ...] = ()

    def at(self, fraction: float) -> Row:
        """This run priced at sustained `fraction`: its curve interpolated linearly in 1/fraction."""
        if not self.curve:
            return self
        xs = [1.0 / g for g, _ in self.curve]
        order = sorted(range(len(xs)), key=xs.__getitem__)
        t = float(np.interp(1.0 / fraction, [xs[i] for i in order], [self.curve[i][1] for i in order]))
        return dataclasses.replace(self, predicted_s=t)

    @property
    def error(self) -> float:
        """predicted / published − 1 (negative: predicted too fast)."""
        return self.predicted_s / self.published_s - 1.0

    @property
    def slowdown(self) -> float:
        """published / predicted − 1: how much slower the run was than predicted (what a band holds)."""
        return self.published_s / self.predicted_s - 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Band:
    """Published step time ∈ predicted · [1 + lo, 1 + hi], from `runs` runs matched at `basis`."""

    lo: float
    hi: float
    runs: int
    basis: str  # "kind+hardware" | "kind" | "all"


def mape(errors: Sequence[float]) -> float:
    return statistics.fmean(abs(e) for e in errors) if errors else math.nan


def fit_constant_mfu(train: Sequence[Row]) -> float:
    """The MFU c minimising the MAPE of step = ideal / c over `train`. The MAPE is piecewise convex in 1/c
    with its minimum at a weighted median of the per-run ratios, so one of the runs' own ratios is optimal."""
    if not train:
        raise ValueError("fit_constant_mfu needs at least one run")

    def loss(c: float) -> float:
        return mape([r.ideal_s / c / r.published_s - 1.0 for r in train])

    return min((r.ideal_s / r.published_s for r in train), key=loss)


def fit_sustained(train: Sequence[Row]) -> float | None:
    """The sustained fraction (within SUSTAINED_GRID's range, by FIT_STEP) minimising the model's MAPE over
    `train`; None when no run carries a curve."""
    if not any(r.curve for r in train):
        return None
    lo, hi = min(SUSTAINED_GRID), max(SUSTAINED_GRID)
    grid = [lo + i * FIT_STEP for i in range(round((hi - lo) / FIT_STEP) + 1)]
    return min(grid, key=lambda g: mape([r.at(g).error for r in train]))


def _spread(rows: Sequence[Row]) -> tuple[float, float]:
    """(lo, hi) of the rows' slowdowns: BAND_QUANTILES of their distribution with every source weighing alike.

    A band is read for a run of a source it was not derived from, and a source's runs share its errors
    (one framework, one cluster, one way of reporting), so the unit of independence is the source, not the
    run: weighted by run, the 48 runs of one sweep narrow the band to that sweep's spread and it misses the
    next source. Each run weighs 1 / (runs of its source); the q-quantile is the smallest slowdown whose
    cumulative weight reaches q of the total (the inverted empirical CDF)."""
    if len(rows) < BAND_QUANTILE_MIN_RUNS:
        v = sorted(r.slowdown for r in rows)
        return v[0], v[-1]
    per_source: dict[str, int] = {}
    for r in rows:
        per_source[r.source_id] = per_source.get(r.source_id, 0) + 1
    ordered = sorted(rows, key=lambda r: r.slowdown)
    cumulative = np.cumsum([1.0 / per_source[r.source_id] for r in ordered])
    cumulative /= cumulative[-1]
    return tuple(ordered[min(int(np.searchsorted(cumulative, q - 1e-12)), len(ordered) - 1)].slowdown
                 for q in BAND_QUANTILES)


def enough_sources(runs: Sequence[Row]) -> bool:
    """Whether `runs` come from enough sources (BAND_MIN_SOURCES) to show how a new source may differ."""
    return len({r.source_id for r in runs}) >= BAND_MIN_SOURCES


def derive_band(train: Sequence[Row], *, kind: str, hardware: str) -> Band:
    """The band of a layout of `kind` on `hardware` from the residuals of the training runs like it."""
    for basis, match in (("kind+hardware", lambda r: r.kind == kind and r.hardware == hardware),
                         ("kind", lambda r: r.kind == kind), ("all", lambda r: True)):
        runs = [r for r in train if match(r)]
        if enough_sources(runs) or (basis == "all" and runs):
            lo, hi = _spread(runs)
            return Band(lo=lo, hi=hi, runs=len(runs), basis=basis)
    raise ValueError("derive_band needs at least one training run")


def derive_bands(train: Sequence[Row]) -> dict[tuple[str, str], Band]:
    """A band for every (kind, hardware) seen in `train`, plus ("*", "*") over every run."""
    keys = {(r.kind, r.hardware) for r in train}
    out = {k: derive_band(train, kind=k[0], hardware=k[1]) for k in sorted(keys)}
    lo, hi = _spread(train)
    out[("*", "*")] = Band(lo=lo, hi=hi, runs=len(train), basis="all")
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class SourceResult:
    source_id: str
    runs: int
    model_mape: float  # the cost model on the held-out source
    baseline_mfu: float  # fitted without the source
    baseline_mape: float  # that MFU on the held-out source
    inside_band: int  # held-out runs whose published time fell inside the band derived without the source
    sustained: float | None = None  # the sustained fraction fitted without the source (None: none fitted)


def leave_one_source_out(rows: Sequence[Row]) -> list[SourceResult]:
    """For each source: hold its runs out, fit the sustained fraction, derive the baseline MFU and the bands
    from the rest, and measure the model (at that fraction), the baseline and the band's coverage on the
    held-out runs."""
    out = []
    for source in sorted({r.source_id for r in rows}):
        test = [r for r in rows if r.source_id == source]
        train = [r for r in rows if r.source_id != source]
        if not train:
            raise ValueError("leave-one-source-out needs at least two sources")
        g = fit_sustained(train)
        if g is not None:
            test, train = [r.at(g) for r in test], [r.at(g) for r in train]
        c = fit_constant_mfu(train)
        inside = 0
        for r in test:
            band = derive_band(train, kind=r.kind, hardware=r.hardware)
            inside += band.lo <= r.slowdown <= band.hi
        out.append(SourceResult(source_id=source, runs=len(test), model_mape=mape([r.error for r in test]),
                                baseline_mfu=c, baseline_mape=mape([r.ideal_s / c / r.published_s - 1.0 for r in test]),
                                inside_band=inside, sustained=g))
    return out


def overall(results: Sequence[SourceResult]) -> tuple[float, float]:
    """(model, baseline) LOSO MAPE over every run (each source weighted by its number of runs)."""
    n = sum(r.runs for r in results)
    return (sum(r.model_mape * r.runs for r in results) / n, sum(r.baseline_mape * r.runs for r in results) / n)
