"""The pruning bound never exceeds the ILP optimum (else pruning would lose the exact answer)."""

from __future__ import annotations

import math

import pytest
from test_ilp import brute_force, random_problem

from autopar.planner.bound import _hull, lower_bound


@pytest.mark.parametrize("seed", range(40))
def test_bound_is_below_brute_force_optimum(seed: int) -> None:
    pr = random_problem(seed)
    best = brute_force(pr)
    lb = lower_bound(pr)
    if best is None:
        return  # the bound may or may not detect infeasibility; it must only never cut a feasible problem
    assert math.isfinite(lb) and lb <= best * (1 + 1e-9)
    assert lb >= 0.4 * best  # and it is not vacuous on these problems


def test_hull_drops_dominated_and_concave_points() -> None:
    # (memory, time): (5, 1.5) is dominated by (4, 1.2); (3, 3) lies above the chord (4, 1.2)–(1, 3.3).
    pts = [(10, 1.0), (5, 1.5), (4, 1.2), (3, 3.0), (1, 3.3)]
    assert _hull(pts) == [(10, 1.0), (4, 1.2), (1, 3.3)]
