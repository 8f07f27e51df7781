"""Lower bounds on the inner problem's optimum, used to order and prune outer candidates.

Every bound below only *removes* constraints of the ILP (`autopar.planner.ilp`), so it never exceeds
the optimum; `tests/test_planner_bound.py` checks that against brute force. Two tiers:

`lower_bound` (cheap, microseconds; every candidate gets it):
- memory is pooled, Σ_q M[q] ≥ Σ_layers (σ + φ_min·a[mode]) + W, and modes are fractional per layer:
  the minimum-work mix is a multiple-choice knapsack LP, solved exactly by walking each run's lower
  convex hull of (bytes, seconds) in order of seconds added per byte saved (Sinha & Zoltners 1979);
- the bottleneck rank does at least the average work W/p and at least the longest layer;
- the tail E is at least its rank average.

`tight_bound` (milliseconds; only candidates whose cheap bound is competitive) keeps each rank's own
memory and in-flight micro-batches, and the integrality of the layer counts:
- *where a layer can be*: with S stages of ≥ 1 layer (v = 1) or of ⌊L/S⌋ / ⌈L/S⌉ layers (v > 1), the
  first layer of stage s lies in [P_min(s), P_max(s)], so layer i can only be on stages s_lo(i)..s_hi(i)
  and hence on a known set of ranks; a layer with one possible stage is *mandatory* on its rank
  (the embedding on rank 0, the LM head on rank p−1, ...);
- *count relaxation*: rank q holds N_q layers, Σ N_q = L, N_q in its range (v > 1: v·⌊L/S⌋ +
  0..min(v, L mod S)). The least time of rank q with N layers, f_q(N), is its mandatory layers plus
  the N − |mandatory| cheapest layers it may hold, each under its own mode, with the rank's memory row
  relaxed in Lagrangian fashion (`_rank_times`), +inf when even the leanest modes (mandatory plus the
  leanest layers, ·φ_q, plus the least workspace) overflow M[q]; plus the cheapest sends each of its
  stage boundaries can carry. f_q is non-decreasing, so T ≥ T* = min_N max_q f_q(N_q) is found by
  bisection over the values of f (a feasible threshold θ needs Σ_q max{N : f_q(N) ≤ θ} ≥ L). This is
  the pigeonhole argument made exact: with L identical blocks over S stages some rank holds
  ≥ ⌈L/p⌉ of them, plus the embedding or head it cannot shed;
- Σ_s t[s] ≥ max(pooled knapsack work, min_N Σ_q f_q(N_q)) (a min-plus convolution over ranks);
- the tail E ≥ min_N max_q g_q(N_q), g_q = cheapest ω-sum + max(0, cheapest (γ − β)-sum + γ0), made
  non-decreasing by its suffix minimum (a lower envelope, so still a bound).
LB = (m − 1/v)·T* + Σt_lb / v + E_lb. The counts that attain T* seed the incumbent heuristic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.planner.problem import MODES, InnerProblem

__all__ = ["Bound", "lower_bound", "tight_bound", "stage_start_range"]

_INF = float("inf")


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


def _pooled_work(pr: InnerProblem) -> float:
    """Least Σ layer time under pooled memory and fractional modes; +inf when the pool cannot hold it."""
    phi = min(pr.inflight)
    ks = [MODES.index(k) for k in pr.modes]
    budget = sum(pr.capacity_bytes) - min(pr.workspace_bytes(MODES[k]) for k in ks)
    work, used, steps = 0.0, 0.0, []
    for r in pr.runs:
        hull = _hull([(r.state_bytes + phi * r.act_bytes[k], r.time_s[k]) for k in ks])
        work += r.count * hull[0][1]
        used += r.count * hull[0][0]
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
            return _INF
    return work


def lower_bound(pr: InnerProblem) -> float:
    """A value ≤ the optimum of `pr` in microseconds of work; +inf when pooled memory cannot hold it."""
    p, v, a, S = pr.num_ranks, pr.virtual_stages, pr.bottleneck_slots, pr.num_stages
    if pr.num_layers < S:
        return _INF
    work = _pooled_work(pr)
    if work == _INF:
        return _INF
    ks = [MODES.index(k) for k in pr.modes]
    longest = max(min(r.time_s[k] for k in ks) for r in pr.runs)
    cheapest_send = [min(r.send_s[x] for r in pr.runs) for x in (0, 1)]  # intra-node, inter-node
    work += 2 * sum(cheapest_send[inter] for inter in pr.inter_node)
    T = max(work / p, longest)
    opt = sum(r.count * r.optimizer_s for r in pr.runs)
    dp = sum(r.count * (r.grad_sync_s - r.backward_s) for r in pr.runs)
    tail = max(opt / p, (opt + dp) / p + pr.grad_sync_latency_s)
    return a * T + work / v + tail


@dataclass(frozen=True, kw_only=True)
class Bound:
    """`tight_bound`'s result: value_s ≤ optimum, with the parts and the counts/modes that attain T*."""

    value_s: float
    bottleneck_s: float  # T* ≤ T (the slowest rank's time per micro-batch)
    work_s: float  # ≤ Σ_s t[s]
    tail_s: float  # ≤ E
    counts: tuple[int, ...] = ()  # layers per rank attaining T* (empty when infeasible)
    infeasible_rank: int = -1  # a rank that cannot fit even its leanest share, when value_s is +inf


def stage_start_range(pr: InnerProblem) -> tuple[np.ndarray, np.ndarray]:
    """(P_min, P_max): bounds on the first layer of each stage s = 0..S (P[S] = L) over all cut vectors."""
    L, S, v = pr.num_layers, pr.num_stages, pr.virtual_stages
    s = np.arange(S + 1)
    if v == 1:
        return s.copy(), L - S + s
    a, e = divmod(L, S)
    return a * s + np.maximum(0, e - (S - s)), a * s + np.minimum(s, e)


def _layer_arrays(pr: InnerProblem):
    of = np.repeat(np.arange(len(pr.runs)), [r.count for r in pr.runs])
    runs = pr.runs
    tau = np.array([r.time_s for r in runs])[of]  # (L, 3)
    act = np.array([r.act_bytes for r in runs])[of]
    state = np.array([r.state_bytes for r in runs])[of]
    omega = np.array([r.optimizer_s for r in runs])[of]
    delta = np.array([r.grad_sync_s - r.backward_s for r in runs])[of]
    send = np.array([r.send_s for r in runs])[of]  # (L, 2)
    return tau, act, state, omega, delta, send


def _cheapest_sums(values: np.ndarray, optional: np.ndarray, width: int) -> np.ndarray:
    """values (L,) or (L, p); optional (L, p) → (p, width+1): sum of the n cheapest optional layers per rank
    (+inf past the rank's optional layers)."""
    v = values if values.ndim == 2 else np.broadcast_to(values[:, None], optional.shape)
    srt = np.sort(np.where(optional, v, np.inf).T, axis=1)[:, :width]
    out = np.zeros((optional.shape[1], width + 1))
    np.cumsum(srt, axis=1, out=out[:, 1:])
    return out


def _minmax(F: np.ndarray, lo: np.ndarray, hi: np.ndarray, L: int) -> tuple[float, np.ndarray | None]:
    """min over N (lo ≤ N ≤ hi, Σ N = L) of max_q F[q, N_q], F non-decreasing in N; and such an N."""
    if (lo > hi).any() or lo.sum() > L or hi.sum() < L:
        return _INF, None
    vals = np.unique(F[np.isfinite(F)])
    cols = np.arange(F.shape[1])
    inrange = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None])

    def top(theta: float) -> np.ndarray | None:
        ok = inrange & np.less_equal(F, theta)
        if not ok[np.arange(len(lo)), lo].all():
            return None
        n = lo - 1 + ok.sum(axis=1)
        return n if n.sum() >= L else None

    lo_i, hi_i = 0, len(vals) - 1
    if len(vals) == 0 or top(vals[-1]) is None:
        return _INF, None
    while lo_i < hi_i:
        mid = (lo_i + hi_i) // 2
        if top(vals[mid]) is None:
            lo_i = mid + 1
        else:
            hi_i = mid
    theta = float(vals[lo_i])
    n = top(theta)
    assert n is not None  # internal: vals[hi_i] was checked feasible
    while n.sum() > L:  # shed layers from the slowest ranks that can give one up
        cur = np.where(n > lo, F[np.arange(len(n)), n], -np.inf)
        n[int(np.argmax(cur))] -= 1
    return theta, n


def _minsum(F: np.ndarray, lo: np.ndarray, hi: np.ndarray, L: int) -> float:
    """min over N (lo ≤ N ≤ hi, Σ N = L) of Σ_q F[q, N_q]: min-plus convolution rank by rank."""
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    total = np.arange(L + 1)
    for q in range(F.shape[0]):
        n = np.arange(int(lo[q]), int(min(hi[q], L)) + 1)
        n = n[np.isfinite(F[q, n])]
        if not len(n):
            return _INF
        before = total[None, :] - n[:, None]  # (|n|, L+1): layers on ranks < q
        prev = np.where(before >= 0, best[np.maximum(before, 0)], np.inf)
        best = (prev + F[q, n][:, None]).min(axis=0)
    return float(best[L])


@dataclass(frozen=True)
class _Where:
    """Which ranks may and must hold each layer, and each rank's range of layer counts."""

    allowed: np.ndarray  # (L, p) bool
    mandatory: np.ndarray  # (L, p) bool
    lo: np.ndarray  # (p,) fewest layers rank q can hold
    hi: np.ndarray  # (p,) most
    rank_send_s: np.ndarray  # (p,) cheapest sends over the stage boundaries of rank q
    boundary_send_s: np.ndarray  # (S−1,) cheapest send per boundary


def _where(pr: InnerProblem, send: np.ndarray) -> _Where:
    p, v, S, L = pr.num_ranks, pr.virtual_stages, pr.num_stages, pr.num_layers
    pmin, pmax = stage_start_range(pr)
    idx = np.arange(L)
    s_lo = np.searchsorted(pmax[1:], idx, side="right")  # first stage that can still hold layer i
    s_hi = np.searchsorted(pmin[:S], idx, side="right") - 1  # last stage that can already hold it
    width = s_hi - s_lo
    q = np.arange(p)
    allowed = (width[:, None] + 1 >= p) | ((q[None, :] - s_lo[:, None]) % p <= width[:, None])
    mandatory = allowed & ((width[:, None] == 0) | (p == 1))
    n_mand, n_all = mandatory.sum(axis=0), allowed.sum(axis=0)
    if v == 1:
        lo, hi = np.maximum(1, n_mand), np.minimum(L - S + 1, n_all)
    else:
        a, e = divmod(L, S)
        lo, hi = np.maximum(v * a, n_mand), np.minimum(v * a + min(v, e), n_all)
    inter = np.array(pr.inter_node, dtype=int)
    bsend = np.array([send[pmin[b + 1] - 1:pmax[b + 1], inter[b]].min() for b in range(S - 1)])
    rank_send = np.zeros(p)
    for b in range(S - 1):  # stage b sends its output on, stage b+1 sends the gradient back
        rank_send[b % p] += bsend[b]
        rank_send[(b + 1) % p] += bsend[b]
    return _Where(allowed=allowed, mandatory=mandatory, lo=lo, hi=hi, rank_send_s=rank_send,
                  boundary_send_s=bsend)


@dataclass(frozen=True)
class _Shape:
    """What `_table` needs of (where, counted) alone, the same for every `values` a bound tabulates."""

    opt_c: np.ndarray  # (L, p) optional counted layers of each rank
    opt_o: np.ndarray | None  # (L, p) optional uncounted layers; None when there are none
    take_c: np.ndarray  # (p, n+1) optional counted layers taken at b
    x: np.ndarray  # (p, n+1) optional uncounted layers taken at b (≤ L)
    ok: np.ndarray  # (p, n+1) whether b is possible
    b_lo: np.ndarray
    b_hi: np.ndarray


def _shape(w: _Where, counted: np.ndarray) -> _Shape:
    L, p = w.allowed.shape
    cnt = counted[:, None]
    opt_c, opt_o = w.allowed & ~w.mandatory & cnt, w.allowed & ~w.mandatory & ~cnt
    mand_c, mand_o = (w.mandatory & cnt).sum(axis=0), (w.mandatory & ~cnt).sum(axis=0)
    n = int(counted.sum())
    b = np.arange(n + 1)[None, :]
    take_c = np.clip(b - mand_c[:, None], 0, n)
    x = np.maximum(0, w.lo[:, None] - b - mand_o[:, None])  # uncounted layers still needed
    n_o = opt_o.sum(axis=0)
    ok = (b >= mand_c[:, None]) & (b + mand_o[:, None] <= w.hi[:, None]) & (x <= n_o[:, None])
    ok &= b - mand_c[:, None] <= opt_c.sum(axis=0)[:, None]
    b_lo = np.where(ok.any(axis=1), ok.argmax(axis=1), n + 1)
    b_hi = np.where(ok.any(axis=1), n - ok[:, ::-1].argmax(axis=1), -1)
    return _Shape(opt_c=opt_c, opt_o=opt_o if n_o.any() else None, take_c=take_c, x=np.minimum(x, L), ok=ok,
                  b_lo=b_lo, b_hi=b_hi)


def _table(w: _Where, counted: np.ndarray, values: np.ndarray,
           shape: _Shape | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least sum of `values` (L,) or (L, p) over the layers rank q holds, as a function of b, the number of
    `counted` layers it holds: its mandatory layers, the b − (mandatory counted) cheapest optional counted
    layers, and as few cheapest optional uncounted layers as its count range needs. Returns (table (p, n+1)
    with +inf where impossible, b_lo, b_hi). `shape`: `_shape(w, counted)`, when the caller has it."""
    sh = shape if shape is not None else _shape(w, counted)
    L, p = w.allowed.shape
    vals = values if values.ndim == 2 else np.broadcast_to(values[:, None], (L, p))
    rows = np.arange(p)[:, None]
    base = (w.mandatory * vals).sum(axis=0)[:, None]
    table = base + _cheapest_sums(vals, sh.opt_c, sh.take_c.shape[1] - 1)[rows, sh.take_c]
    if sh.opt_o is not None:  # else x = 0 wherever b is possible: nothing to add there
        table = table + _cheapest_sums(vals, sh.opt_o, L)[rows, sh.x]
    return np.where(sh.ok, table, np.inf), sh.b_lo, sh.b_hi


def _envelope(F: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The largest non-decreasing function ≤ F on each row's [lo, hi] (suffix minimum); +inf outside."""
    cols = np.arange(F.shape[1])[None, :]
    inrange = (cols >= lo[:, None]) & (cols <= hi[:, None])
    G = np.minimum.accumulate(np.where(inrange, F, np.inf)[:, ::-1], axis=1)[:, ::-1]
    return np.where(inrange, G, np.inf)


def _slopes(pr: InnerProblem) -> np.ndarray:
    """Seconds added per activation byte saved between neighbouring modes on the lower hull of each run of
    ≥ 2 identical layers (per in-flight micro-batch): where the rank's best mix of modes changes."""
    ks = [MODES.index(k) for k in pr.modes]
    out = set()
    for r in pr.runs:
        if r.count < 2:
            continue
        hull = _hull([(r.act_bytes[k], r.time_s[k]) for k in ks])
        out.update((t2 - t1) / (m1 - m2) for (m1, t1), (m2, t2) in zip(hull, hull[1:], strict=False))
    return np.array(sorted(out))


def _rank_times(pr: InnerProblem, w: _Where, counted: np.ndarray, tau, act, state):
    """Per rank and count b of `counted` layers: a lower bound on the least time of its layers, each under
    its own mode, within the rank's memory; +inf where even every layer's leanest mode does not fit.
    Lagrangian relaxation of the memory row: for every λ ≥ 0 the time is at least
    min Σ_i min_k (τ_ik + λ·m_ik) − λ·(M_q − W_lb) over the layers the rank may hold (weak duality), taken at
    λ = 0 and at the hull slopes of the runs (`_slopes`: the LP optimum of a rank of identical layers)."""
    phi, cap = np.array(pr.inflight), np.array(pr.capacity_bytes)
    ks = [MODES.index(x) for x in pr.modes]
    w_lb = min(pr.workspace_bytes(MODES[k]) for k in ks)
    mem = state[:, None, None] + act[:, ks][:, None, :] * phi[None, :, None]  # (L, p, K)
    t = tau[:, ks][:, None, :]  # (L, 1, K)
    sh = _shape(w, counted)
    lean, b_lo, b_hi = _table(w, counted, mem.min(axis=2), sh)
    fits = lean + w_lb <= cap[:, None] * (1 + 1e-9)
    F, _, _ = _table(w, counted, np.broadcast_to(t.min(axis=2), mem.shape[:2]), sh)
    for slope in _slopes(pr):
        lam = slope / np.maximum(phi, 1e-30)  # (p,): seconds per byte of rank q's memory
        vals = (t + lam[None, :, None] * mem).min(axis=2)
        G, _, _ = _table(w, counted, vals, sh)
        F = np.maximum(F, G - (lam * (cap - w_lb))[:, None])
    F = F + w.rank_send_s[:, None]
    return np.where(fits, F, np.inf), b_lo, b_hi


def tight_bound(pr: InnerProblem) -> Bound:
    """The count-relaxation bound described in the module docstring; value_s = +inf when infeasible."""
    p, v, a, S, L = pr.num_ranks, pr.virtual_stages, pr.bottleneck_slots, pr.num_stages, pr.num_layers
    none = Bound(value_s=_INF, bottleneck_s=_INF, work_s=_INF, tail_s=_INF)
    if L < S:
        return none
    tau, act, state, omega, delta, send = _layer_arrays(pr)
    w = _where(pr, send)
    every = np.ones(L, dtype=bool)
    F, lo, hi = _rank_times(pr, w, every, tau, act, state)
    F = _envelope(F, lo, hi)
    T, counts = _minmax(F, lo, hi, L)
    if counts is None:
        bad = int(np.argmax(~np.isfinite(F[np.arange(p), np.minimum(np.maximum(lo, 0), L)])))
        return Bound(value_s=_INF, bottleneck_s=_INF, work_s=_INF, tail_s=_INF, infeasible_rank=bad)
    work = max(_pooled_work(pr) + 2 * float(w.boundary_send_s.sum()), _minsum(F, lo, hi, L))
    # Each run of ≥ 2 identical layers counted exactly (no two ranks share its layers).
    of = np.repeat(np.arange(len(pr.runs)), [r.count for r in pr.runs])
    for ri, r in enumerate(pr.runs):
        if r.count < 2:
            continue
        Fr, lo_r, hi_r = _rank_times(pr, w, of == ri, tau, act, state)
        Fr = _envelope(Fr, lo_r, hi_r)
        T_r, _ = _minmax(Fr, lo_r, hi_r, r.count)
        if T_r == _INF:
            return Bound(value_s=_INF, bottleneck_s=_INF, work_s=_INF, tail_s=_INF, infeasible_rank=-1)
        T = max(T, T_r)
        work = max(work, _minsum(Fr, lo_r, hi_r, r.count))
    ks = [MODES.index(k) for k in pr.modes]
    T = max(T, work / p, max(min(r.time_s[k] for k in ks) for r in pr.runs))  # never weaker than the cheap one
    sh = _shape(w, every)
    G, _, _ = _table(w, every, omega, sh)
    D, _, _ = _table(w, every, delta, sh)
    E, _ = _minmax(_envelope(G + np.maximum(0.0, D + pr.grad_sync_latency_s), lo, hi), lo, hi, L)
    opt, dsum = float(omega.sum()), float(delta.sum())
    E = max(E, opt / p, (opt + dsum) / p + pr.grad_sync_latency_s)
    value = a * T + work / v + E
    return Bound(value_s=value, bottleneck_s=T, work_s=work, tail_s=E, counts=tuple(int(c) for c in counts))
