"""A cheap lower bound on the ILP's optimum, used to skip outer candidates without solving them.

Relaxation (every step only removes constraints, so the bound is valid):
- memory: only the pooled capacity counts, Σ_q M[q] ≥ Σ_layers (σ + φ_min·a[mode] ) + W — stages may
  share memory and every rank holds the fewest micro-batches in flight (φ_min);
- modes are chosen per layer and fractionally: the minimum-work mix under pooled memory is a
  multiple-choice knapsack LP, solved exactly by walking each run's lower convex hull of (bytes, seconds)
  in order of seconds added per byte saved (Sinha & Zoltners 1979);
- time: the bottleneck rank does at least the average work W/p and at least the longest single layer;
  each stage boundary costs at least its two cheapest sends; the tail E is at least its rank average.
Then LB = (m − 1/v)·T_lb + W_lb/v + E_lb ≤ (m − 1/v)·T + Σ t/v + E.
"""

from __future__ import annotations

from autopar.planner.ilp import MODES, InnerProblem

__all__ = ["lower_bound"]


def _hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Lower convex hull of (memory, time) points, by decreasing memory (fastest first)."""
    pts = sorted(set(points), key=lambda x: (-x[0], x[1]))
    hull: list[tuple[float, float]] = []
    for p in pts:
        if hull and p[0] == hull[-1][0]:  # same memory, no faster (sorted by time within equal memory)
            continue
        if hull and p[1] <= hull[-1][1]:  # less memory and no slower: dominates
            while hull and p[1] <= hull[-1][1]:
                hull.pop()
        while len(hull) >= 2:
            (m1, t1), (m2, t2) = hull[-2], hull[-1]
            # keep convex: the slope (time added per byte saved) must increase along the hull
            if (t2 - t1) * (m2 - p[0]) >= (p[1] - t2) * (m1 - m2):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def lower_bound(pr: InnerProblem) -> float:
    """A value ≤ the optimum of `pr`; +inf when even the pooled memory cannot hold the model."""
    p, v, m, S = pr.num_ranks, pr.virtual_stages, pr.num_microbatches, pr.num_stages
    if pr.num_layers < S:
        return float("inf")
    phi = min(pr.inflight)
    ks = [MODES.index(k) for k in pr.modes]
    ws = min(pr.workspace_bytes(MODES[k]) for k in ks)
    budget = sum(pr.capacity_bytes) - ws
    work, used, steps = 0.0, 0.0, []
    longest = 0.0
    for r in pr.runs:
        hull = _hull([(r.state_bytes + phi * r.act_bytes[k], r.time_s[k]) for k in ks])
        work += r.count * hull[0][1]
        used += r.count * hull[0][0]
        longest = max(longest, min(r.time_s[k] for k in ks))
        for (m1, t1), (m2, t2) in zip(hull, hull[1:], strict=False):
            steps.append(((t2 - t1) / (m1 - m2), r.count * (m1 - m2)))
    if used > budget:
        for slope, saved in sorted(steps):
            take = min(saved, used - budget)
            work += slope * take
            used -= take
            if used <= budget:
                break
        if used > budget * (1 + 1e-9):
            return float("inf")
    work += sum(2 * min(r.send_s[inter] for r in pr.runs) for inter in pr.inter_node)
    T = max(work / p, longest)
    opt = sum(r.count * r.optimizer_s for r in pr.runs)
    dp = sum(r.count * (r.grad_sync_s - r.backward_s) for r in pr.runs)
    tail = max(opt / p, (opt + dp) / p + pr.grad_sync_latency_s)
    return (m - 1.0 / v) * T + work / v + tail
