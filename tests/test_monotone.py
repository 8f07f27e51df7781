"""The non-decreasing fit against brute force: the least-squares monotone sequence in log-space."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from cost_models.monotone import nondecreasing_fit


def _sq_log_error(fit: list[float], times: list[float]) -> float:
    return sum((math.log(f) - math.log(t)) ** 2 for f, t in zip(fit, times, strict=True))


def test_monotone_input_unchanged() -> None:
    times = [1.0, 1.0, 2.0, 5.0]
    assert nondecreasing_fit(times) == pytest.approx(times)


def test_one_outlier_is_averaged_not_copied_forward() -> None:
    # a running max would lift 3 entries to 10; the fit pools only the violators
    fit = nondecreasing_fit([1.0, 10.0, 2.0, 3.0, 20.0])
    assert fit[0] == pytest.approx(1.0) and fit[-1] == pytest.approx(20.0)
    assert fit[1] == pytest.approx(fit[2]) == pytest.approx(fit[3]) == pytest.approx((10 * 2 * 3) ** (1 / 3))


@pytest.mark.parametrize("seed", range(20))
def test_is_the_least_squares_monotone_fit(seed: int) -> None:
    """Against every non-decreasing sequence whose values are block means of the data (the optimum is
    one of these: each block of a PAV solution takes its mean)."""
    rng = random.Random(seed)
    times = [math.exp(rng.uniform(-1, 1)) for _ in range(6)]
    fit = nondecreasing_fit(times)
    assert all(a <= b * (1 + 1e-12) for a, b in itertools.pairwise(fit))
    logs = [math.log(t) for t in times]
    best = math.inf
    for cuts in itertools.product((0, 1), repeat=len(times) - 1):  # 1 = a block boundary after i
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [len(times)]
        means = [sum(logs[a:b]) / (b - a) for a, b in itertools.pairwise(bounds)]
        if all(x <= y for x, y in itertools.pairwise(means)):
            spans = zip(itertools.pairwise(bounds), means, strict=True)
            cand = [math.exp(m) for (a, b), m in spans for _ in range(b - a)]
            best = min(best, _sq_log_error(cand, times))
    assert _sq_log_error(fit, times) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_refuses_non_positive_times() -> None:
    with pytest.raises(ValueError, match="positive"):
        nondecreasing_fit([1.0, 0.0])
