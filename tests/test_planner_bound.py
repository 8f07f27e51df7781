"""The pruning bounds never exceed the ILP optimum (else pruning would lose the exact answer); the tight
bound is exact where a formula says what the optimum is; the incumbent is feasible and above the optimum."""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_ilp import brute_force, brute_objective, random_problem

from autopar.planner.bound import _hull, lower_bound, tight_bound
from autopar.planner.ilp import solve
from autopar.planner.incumbent import incumbent
from autopar.planner.problem import InnerProblem, Run


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


# ---- the tight bound (count relaxation) and the incumbent built from it ----

@pytest.mark.parametrize("seed", range(60))
def test_tight_bound_is_below_the_optimum_and_the_incumbent_above(seed: int) -> None:
    pr = random_problem(seed)
    best = brute_force(pr)
    bnd = tight_bound(pr)
    if best is None:
        assert incumbent(pr, bnd) is None
        return
    assert bnd.value_s <= best * (1 + 1e-9)
    assert bnd.value_s >= lower_bound(pr) * (1 - 1e-9) or lower_bound(pr) > best  # never weaker than cheap
    inc = incumbent(pr, bnd)
    if inc is not None:
        assert inc.feasible and inc.objective_s >= best * (1 - 1e-9)
        assert brute_objective(pr, inc.layers_per_stage, inc.layer_modes) == pytest.approx(inc.objective_s, rel=1e-9)
    sol = solve(pr, bound=bnd, start=inc)  # bound rows and warm start must not change the optimum
    assert sol is not None and sol.objective_s == pytest.approx(best, rel=1e-7)


def _blocks(n: int, t: float = 1.0) -> Run:
    return Run(name="block", count=n, layer_names=tuple(f"b{i}" for i in range(n)),
               time_s=(t, 1.2 * t, 1.35 * t, 1.5 * t), compute_s=(t,) * 4,
               recompute_s=(0.0, 0.2 * t, 0.35 * t, 0.5 * t), tp_comm_s=(0.0,) * 4, act_bytes=(1.0, 0.5, 0.3, 0.1),
               state_bytes=1.0, backward_s=0.0, grad_sync_s=0.0, optimizer_s=0.0,
               send_s=(0.0, 0.0))


@pytest.mark.parametrize(("layers", "p", "v"), [(96, 8, 1), (99, 8, 1), (96, 16, 4), (99, 16, 4), (97, 8, 3),
                                                (126, 8, 4), (80, 16, 2)])
def test_pigeonhole_bottleneck_of_identical_blocks_is_exact(layers: int, p: int, v: int) -> None:
    """L identical blocks on p ranks: some rank holds ≥ ⌈L/p⌉ of them (v = 1); with v chunks of ⌊L/S⌋ or
    ⌈L/S⌉ layers, some rank holds v·⌊L/S⌋ + ⌈(L mod S)/p⌉. Ample memory: the bound is the optimum."""
    S = p * v
    a, e = divmod(layers, S)
    expect_T = math.ceil(layers / p) if v == 1 else v * a + math.ceil(e / p)
    m = 4 * p
    pr = InnerProblem(runs=(_blocks(layers),), num_ranks=p, virtual_stages=v, num_microbatches=m,
                      inflight=(float(p),) * p, capacity_bytes=(1e9,) * p, inter_node=(False,) * (S - 1))
    bnd = tight_bound(pr)
    assert bnd.bottleneck_s == pytest.approx(expect_T)
    optimum = (m - 1 / v) * expect_T + layers / v  # Σ t = L; no tail
    assert bnd.value_s == pytest.approx(optimum)
    sol = solve(pr, bound=bnd, start=incumbent(pr, bnd))
    assert sol is not None and sol.objective_s == pytest.approx(optimum)


def test_k_of_n_layers_recompute_where_memory_binds() -> None:
    """6 blocks on 2 ranks, 3 in flight on rank 0, which holds 3 + 3·Σa + W ≤ 11 bytes: all three without
    recompute need 12; one selective layer (a = 0.5, workspace 0.5) brings it to exactly 11 at time
    2 + 1.2 = 3.2, less than any other fitting mix (op_sac 3.35, full 3.5) or cut ((2, 4) puts 4 on rank 1).
    Objective (m − 1)·3.2 + (3.2 + 3) = 28.6. The bound relaxes the mix to fractional layers and the
    workspace to its least (0, no recompute): 2/3 of a selective layer, 3 + 0.2·2/3, between 3 and 3.2."""
    pr = InnerProblem(runs=(_blocks(6),), num_ranks=2, virtual_stages=1, num_microbatches=8, inflight=(3.0, 2.0),
                      capacity_bytes=(11.0, 100.0), inter_node=(False,))
    bnd = tight_bound(pr)
    sol = solve(pr, bound=bnd, start=incumbent(pr, bnd))
    assert sol is not None and sol.layers_per_stage == (3, 3)
    assert sol.layer_modes == ("selective", "none", "none", "none", "none", "none")
    assert sol.objective_s == pytest.approx(28.6) == brute_force(pr)
    assert 3.0 < bnd.bottleneck_s <= 3.2 and bnd.value_s <= 28.6
    # one mode per rank (the space before per-layer recompute): rank 0's three layers must all recompute;
    # selective for all three fits (3 + 3·1.5 + 0.5 = 8 ≤ 11) at 3.6, and the (3, 3) cut stays best:
    # (m − 1)·3.6 + (3.6 + 3) = 31.8
    uniform = dataclasses.replace(pr, per_layer=False)
    sol = solve(uniform, bound=tight_bound(uniform), start=incumbent(uniform, tight_bound(uniform)))
    assert sol is not None and sol.objective_s == pytest.approx(31.8) == brute_force(uniform)
    assert sol.layer_modes == ("selective",) * 3 + ("none",) * 3


def test_a_rank_that_cannot_hold_its_share_is_named() -> None:
    pr = InnerProblem(runs=(_blocks(8),), num_ranks=2, virtual_stages=1, num_microbatches=8, inflight=(4.0, 2.0),
                      capacity_bytes=(0.5, 100.0), inter_node=(False,))
    bnd = tight_bound(pr)
    assert bnd.value_s == math.inf and bnd.infeasible_rank == 0
