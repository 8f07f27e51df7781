"""A good feasible solution of the inner problem, built from the tight bound's layer counts.

It serves three purposes, none of which affects exactness: its objective is an upper bound that lets
the search prune candidates before any ILP runs, it is the ILP's warm start (HiGHS starts with an
incumbent), and when it equals the tight bound the candidate's optimum is known (the ILP then closes
at its root because the bound is also added to it as a valid inequality).

Construction: rank q gets the N_q layers of the bound (v = 1: stage q holds N_q layers; v > 1: N_q − v·⌊L/S⌋
of its chunks hold one layer more, tried as its first and as its last chunks). For fixed cuts the
objective falls as each rank's time falls (the tail does not depend on modes), so each rank gets a
quick mix of modes that fits its own memory (`best_modes`: a greedy multiple-choice knapsack); with
v = 1 we also try the counts shifted by one layer between neighbouring ranks.
"""

from __future__ import annotations

import math

from autopar.planner.bound import Bound
from autopar.planner.problem import MODES, InnerProblem, InnerSolution, evaluate

__all__ = ["incumbent", "best_modes"]


def best_modes(pr: InnerProblem, layers_per_stage: tuple[int, ...]) -> tuple[str, ...] | None:
    """Per layer, a recompute mode such that every rank fits its memory, fast: for each pair of allowed
    modes (fast, lean), the rank's layers start in the fast mode and move to the lean one, runs saving the
    most bytes per second added first, as few layers as fit; the quickest such mix per rank. None if a
    rank fits no mix."""
    p, R = pr.num_ranks, len(pr.runs)
    of = [ri for ri, r in enumerate(pr.runs) for _ in range(r.count)]
    rank_of = [s % p for s, n in enumerate(layers_per_stage) for _ in range(n)]
    counts = [[0] * R for _ in range(p)]
    for i, q in enumerate(rank_of):
        counts[q][of[i]] += 1
    lean_count: list[dict[int, tuple[str, str, int]]] = []  # per rank: run → (fast, lean, layers moved)
    for q in range(p):
        phi, cap = pr.inflight[q], pr.capacity_bytes[q] * (1 + 1e-9)
        best: tuple[float, dict[int, tuple[str, str, int]]] | None = None
        for fast in pr.modes:
            kf = MODES.index(fast)
            base = sum(c * (r.state_bytes + phi * r.act_bytes[kf]) for c, r in zip(counts[q], pr.runs, strict=True))
            t_fast = sum(c * r.time_s[kf] for c, r in zip(counts[q], pr.runs, strict=True))
            for lean in pr.modes if pr.per_layer else (fast,):
                kl = MODES.index(lean)
                runs = [ri for ri in range(R)
                        if counts[q][ri] and pr.runs[ri].act_bytes[kl] < pr.runs[ri].act_bytes[kf]]
                runs.sort(key=lambda ri, kf=kf, kl=kl: (pr.runs[ri].time_s[kl] - pr.runs[ri].time_s[kf])
                          / (pr.runs[ri].act_bytes[kf] - pr.runs[ri].act_bytes[kl]))
                mem, t, moved = base + pr.workspace_bytes(fast), t_fast, {}
                for ri in runs:
                    if mem <= cap:
                        break
                    r = pr.runs[ri]
                    ws = max(pr.workspace_bytes(fast), pr.workspace_bytes(lean)) - pr.workspace_bytes(fast) \
                        if not moved else 0.0
                    save = phi * (r.act_bytes[kf] - r.act_bytes[kl])
                    n = min(counts[q][ri], max(1, math.ceil((mem + ws - cap) / save)))
                    mem += ws - n * save
                    t += n * (r.time_s[kl] - r.time_s[kf])
                    moved[ri] = (fast, lean, n)
                if mem <= cap and (best is None or t < best[0]):
                    best = (t, {ri: moved.get(ri, (fast, fast, 0)) for ri in range(R)})
        if best is None:
            return None
        lean_count.append(best[1])
    out, left = [], [dict(d) for d in lean_count]
    for i, q in enumerate(rank_of):
        fast, lean, n = left[q][of[i]]
        out.append(lean if n > 0 else fast)
        left[q][of[i]] = (fast, lean, n - 1)
    return tuple(out)


def _cuts(pr: InnerProblem, counts: tuple[int, ...], big_first: bool) -> tuple[int, ...] | None:
    p, v, S, L = pr.num_ranks, pr.virtual_stages, pr.num_stages, pr.num_layers
    if sum(counts) != L or min(counts) < v:
        return None
    if v == 1:
        return tuple(counts)
    a = L // S
    cuts = [a] * S
    for q, n in enumerate(counts):
        extra = n - v * a
        if not 0 <= extra <= v:
            return None
        chunks = range(v) if big_first else range(v - 1, -1, -1)
        for j in list(chunks)[:extra]:
            cuts[q + j * p] += 1
    return tuple(cuts) if min(cuts) >= 1 else None


def _neighbours(counts: tuple[int, ...]) -> list[tuple[int, ...]]:
    out = []
    for q in range(len(counts) - 1):
        for d in (1, -1):
            c = list(counts)
            c[q] += d
            c[q + 1] -= d
            out.append(tuple(c))
    return out


def incumbent(pr: InnerProblem, bound: Bound) -> InnerSolution | None:
    """The best feasible solution among the constructions above; None when none fits memory."""
    if not bound.counts:
        return None
    best: InnerSolution | None = None
    tried: set[tuple[int, ...]] = set()
    for counts in [bound.counts, *(_neighbours(bound.counts) if pr.virtual_stages == 1 else [])]:
        for big_first in ((True, False) if pr.virtual_stages > 1 else (True,)):
            cuts = _cuts(pr, counts, big_first)
            if cuts is None or cuts in tried:
                continue
            tried.add(cuts)
            modes = best_modes(pr, cuts)
            if modes is None:
                continue
            sol = evaluate(pr, cuts, layer_modes=modes)
            if sol.feasible and (best is None or sol.objective_s < best.objective_s):
                best = sol
        if best is not None and best.objective_s <= bound.value_s * (1 + 1e-9):
            break
    return best
