"""The profile's time budget: how a sweep decides what it can afford to measure, and what it extrapolates.

A profile must finish in its budget on any machine, including one where a kernel runs 100× slower than
expected (bfloat16 GEMMs on a CPU without AVX-512-BF16/AMX run at 1–20 GFLOP/s, measured here with
`ONEDNN_MAX_CPU_ISA=AVX2`). So each sweep measures its ranges (a dtype and layout, an elementwise op)
one after another, each with an equal share of what the sweep has left (what a fast range leaves over
flows to the later ones), and a range's sizes in increasing order. Before a size it predicts the call
time from the rate of the sizes already measured (`fitted_time_s`); when the least cost of measuring it (a
warm-up call and one timed call) exceeds what the range has left, the range stops there and its
remaining sizes are filled in from the fitted curve, marked extrapolated. Within a size, the number of
trials shrinks to fit (`trials_within`).

The phases of one profile (kernels, layers, collectives) split the total by weight in the same way:
each phase gets its weight's share of what is left when it starts (`PhaseClock`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Sequence

__all__ = ["PhaseClock", "SizeSweep", "fitted_time_s", "alpha_beta_time_s", "trials_within", "QUICK_BUDGET_S",
           "QUICK_LAYERS_BUDGET_S", "FULL_BUDGET_S"]

# `autopar profile --quick` must finish in a minute (issue 13). The budget covers the measurements,
# spawning the collective processes included; starting Python and importing torch come on top (~5 s on
# this 2-vCPU VM under load: `time autopar profile --quick` 55.8 s against 50.8 s measured with a 50 s
# budget), so 45 s leaves a margin. Timing a model's layers adds its own 40 s (capture comes on top).
QUICK_BUDGET_S = 45.0
QUICK_LAYERS_BUDGET_S = 40.0
FULL_BUDGET_S = 600.0


def fitted_time_s(points: Sequence[tuple[float, float]], work: float) -> float:
    """Time at `work` from measured (work, time_s) points of one range: work over the median rate
    (work / time) of the last three points. Past the measured sizes a kernel's time grows at least in
    proportion to its work (its rate stops rising once the machine is saturated), and the median keeps
    one disturbed trial from setting the curve: a 4 MiB add timed at 0.24 GB/s between two at 6–7 GB/s
    during a load spike here would have extrapolated, with a power law fitted to the last three, to
    0.01 GB/s at 64 MiB."""
    if not points:
        raise ValueError("fitted_time_s needs at least one measured point")
    rates = [w / t for w, t in sorted(points)[-3:]]
    return work / statistics.median(rates)


def alpha_beta_time_s(points: Sequence[tuple[float, float]], n_bytes: float) -> float:
    """Time of a message of n_bytes from measured (n_bytes, time_s) points of one collective: the line
    time = α + n/β fitted by least squares to the last three points (the α-β model of comm.py), at least
    the largest point's time. A collective's small sizes are latency: extrapolated at their rate, a 1 KiB
    all-reduce of 10 ms would price 1 MiB at 10 s (seen here) where the line gives ~20 ms. With one point,
    or a line that does not rise (noise), the largest point's rate beyond it."""
    if not points:
        raise ValueError("alpha_beta_time_s needs at least one measured point")
    pts = sorted(points)[-3:]
    n_last, t_last = pts[-1]
    slope = 0.0
    if len(pts) >= 2:
        mx, my = sum(n for n, _ in pts) / len(pts), sum(t for _, t in pts) / len(pts)
        var = sum((n - mx) ** 2 for n, _ in pts)
        slope = sum((n - mx) * (t - my) for n, t in pts) / var if var > 0 else 0.0
    if len(pts) == 1:
        return t_last if n_bytes <= n_last else t_last * n_bytes / n_last
    if slope <= 0:
        slope = t_last / n_last
    return max(t_last, t_last + slope * (n_bytes - n_last))


def trials_within(budget_s: float, call_s: float, *, trial_s: float, most: int) -> int:
    """Trials of about max(trial_s, call_s) each that fit in `budget_s` after the warm-up call, 1..most."""
    per_trial = max(trial_s, call_s)
    return max(1, min(most, int((budget_s - call_s) / per_trial)))


class PhaseClock:
    """The whole profile's budget, shared among named phases by weight as each starts.

    Not frozen: it is a running clock. `clock` is injectable so tests can simulate slow machines."""

    def __init__(self, total_s: float, weights: dict[str, float], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not total_s > 0:
            raise ValueError(f"budget {total_s} s: pass a positive number of seconds")
        self.total_s = total_s
        self.clock = clock
        self.start = clock()
        self._weights = dict(weights)

    def elapsed_s(self) -> float:
        return self.clock() - self.start

    def left_s(self) -> float:
        return max(0.0, self.total_s - self.elapsed_s())

    def begin(self, phase: str) -> float:
        """Seconds phase `phase` may take: its weight's share of what is left, among phases not yet begun."""
        weight = self._weights.pop(phase, 0.0)
        rest = sum(self._weights.values())
        return self.left_s() * (weight / (weight + rest) if weight + rest > 0 else 1.0)

    def drop(self, phase: str) -> None:
        """A phase that will not run gives its share to the others."""
        self._weights.pop(phase, None)


class SizeSweep:
    """One sweep's decisions: which of its items to measure within `budget_s`, the rest extrapolated.

    `items` are (range, work) pairs in the order they will be measured: grouped by range and, within a
    range, in increasing work. Each range, as it starts, gets an equal share of what the sweep has left
    among the ranges still to come. Before each item the caller asks `share_s`: None when the item's
    least cost (a warm-up and one timed call, predicted from the range's fitted curve) exceeds what its
    range has left — the range stops there and the rest of it is extrapolated — else the seconds this
    item may spend (half of what its range has left: the larger items after it need the rest). Then the
    caller reports the measured call time with `done`. `fallback` names a wider range (e.g. the dtype of
    a (dtype, layout) range) whose points predict a range not measured yet.
    """

    def __init__(self, budget_s: float, items: Sequence[tuple[Hashable, float]], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.deadline = clock() + budget_s
        self.pending = list(items)
        self.points: dict[Hashable, list[tuple[float, float]]] = {}
        self.stopped: set[Hashable] = set()
        self._group: Hashable = object()
        self._group_deadline = self.deadline

    def left_s(self) -> float:
        return max(0.0, self.deadline - self.clock())

    def predict_s(self, group: Hashable, work: float, fallback: Hashable | None = None) -> float | None:
        """Call time from the range's fitted curve (else the fallback range's), None when neither has points."""
        pts = self.points.get(group) or (self.points.get(fallback) if fallback is not None else None)
        return fitted_time_s(pts, work) if pts else None

    def share_s(self, group: Hashable, work: float, fallback: Hashable | None = None) -> float | None:
        """Seconds this item may spend, or None when its range stops here (over what the range has left)."""
        if group != self._group:
            ranges_left = len(dict.fromkeys(g for g, _ in self.pending)) or 1
            self._group = group
            self._group_deadline = self.clock() + self.left_s() / ranges_left
        if self.pending:
            self.pending.pop(0)
        if group in self.stopped:
            return None
        left = min(self._group_deadline, self.deadline) - self.clock()
        predicted = self.predict_s(group, work, fallback)
        if left <= 0 or (predicted is not None and 2 * predicted > left):
            self.stopped.add(group)
            return None
        return left / 2

    def done(self, work: float, time_s: float, *groups: Hashable) -> None:
        """Record a measured call time in each of `groups` (the range, and the wider fallback range)."""
        for g in groups:
            self.points.setdefault(g, []).append((work, time_s))

    def expected_left_s(self, trials: int = 3, trial_s: float = 0.02) -> float:
        """Expected seconds for the pending items (warm-up plus trials each, stopped ranges free), at most
        what the sweep has left."""
        total = 0.0
        for group, work in self.pending:
            if group in self.stopped:
                continue
            t = self.predict_s(group, work) or 0.0
            total += t + trials * max(t, trial_s)
        return min(total, self.left_s())
