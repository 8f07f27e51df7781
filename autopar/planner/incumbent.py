"""A good feasible solution of the inner problem, built from the tight bound's layer counts.

It serves three purposes, none of which affects exactness: its objective is an upper bound that lets
the search prune candidates before any ILP runs, it is the ILP's warm start (HiGHS starts with an
incumbent), and when it equals the tight bound the candidate's optimum is known (the ILP then closes
at its root because the bound is also added to it as a valid inequality).

Construction: rank q gets the N_q layers of the bound (v = 1: stage q holds N_q layers; v > 1: N_q − v·⌊L/S⌋
of its chunks hold one layer more, tried as its first and as its last chunks). For fixed cuts the
objective is minimised by giving every rank the fastest recompute mode that fits its own memory (each
rank's time only grows with a slower mode and the tail does not depend on modes), so that is the
mode assignment; with v = 1 we also try the counts shifted by one layer between neighbouring ranks.
"""

from __future__ import annotations

from autopar.planner.bound import Bound
from autopar.planner.problem import MODES, InnerProblem, InnerSolution, evaluate

__all__ = ["incumbent", "best_modes"]


def best_modes(pr: InnerProblem, layers_per_stage: tuple[int, ...]) -> tuple[str, ...] | None:
    """Per stage, its rank's fastest allowed mode that fits that rank's memory; None if a rank fits none."""
    p, S = pr.num_ranks, pr.num_stages
    of = [ri for ri, r in enumerate(pr.runs) for _ in range(r.count)]
    counts = [[0] * len(pr.runs) for _ in range(p)]
    pos = 0
    for s, n in enumerate(layers_per_stage):
        for i in range(pos, pos + n):
            counts[s % p][of[i]] += 1
        pos += n
    rank_mode = []
    for q in range(p):
        best = None
        for name in pr.modes:
            k = MODES.index(name)
            mem = sum(c * (r.state_bytes + pr.inflight[q] * r.act_bytes[k]) for c, r in zip(counts[q], pr.runs,
                                                                                            strict=True))
            if mem + pr.workspace_bytes(name) > pr.capacity_bytes[q] * (1 + 1e-9):
                continue
            t = sum(c * r.time_s[k] for c, r in zip(counts[q], pr.runs, strict=True))
            if best is None or t < best[0]:
                best = (t, name)
        if best is None:
            return None
        rank_mode.append(best[1])
    return tuple(rank_mode[s % p] for s in range(S))


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
            sol = evaluate(pr, cuts, modes)
            if sol.feasible and (best is None or sol.objective_s < best.objective_s):
                best = sol
        if best is not None and best.objective_s <= bound.value_s * (1 + 1e-9):
            break
    return best
