"""The inner problem of the planner as an integer linear program: stage cuts and per-layer recompute.

The outer search (`autopar.planner.search`) fixes tp, pp, dp, ZeRO stage, micro-batch size and count,
schedule, virtual stages and sequence parallelism. What remains is where to cut the layer sequence into
S = p·v contiguous stages (stage s runs on pipeline rank s mod p) and which recompute mode each layer
uses, so k of a rank's n layers may recompute (Megatron-LM's --recompute-num-layers; Mist, Zhu et al.
2025, picks that count per stage). With interleaving all chunks hold ⌊L/S⌋ or ⌈L/S⌉ layers, as
Megatron-LM's interleaved schedule wants equal chunks. Identical layers are interchangeable and a rank's
time and memory are sums over its layers, so modes are counted per rank and run (u below), not per layer
or chunk: that removes the symmetric solutions that would otherwise make the ILP slow. This module takes
numbers and names only (no torch; the data classes and `evaluate` live in `autopar.planner.problem`), so tests can
check it against brute force.

Data. The layer sequence is a list of *runs*: run r is n_r consecutive identical layers (equal
signatures), so a cut inside a run only matters through how many of its layers fall on each side.
Per layer of run r and recompute mode k ∈ K (cost_models.memory.RECOMPUTE_MODES), per micro-batch:
  τ[r,k]   forward + backward (+ recompute) compute and tensor-parallel communication time, s
  a[r,k]   activation bytes kept per in-flight micro-batch
  σ[r]     model-state bytes (weights, grads, optimizer) per device
  β[r]     backward compute time (the window that hides gradient reduction), s
  γ[r]     data-parallel gradient/ZeRO communication time of the layer's parameters, s
  ω[r]     optimizer-step time of the layer's parameters, s
  π[r,x]   time to send the tensor crossing a cut after a layer of run r; x = intra/inter-node, s
Per rank q: in-flight micro-batches φ[q] (schedule-dependent) and memory capacity M[q] (device memory less
the allocator reserve and stage-independent terms). Workspace W[k] = max_r (a[r,none] − a[r,k]): the
activations that recomputing one layer materialises again (layers recompute one at a time in backward,
so a rank needs the largest W[k] of the modes it uses).

Variables (per stage s = 0..S−1, pipeline rank q, run r, mode k):
  F[r,s] ∈ {0..n_r}  integer   layers of run r in stages ≤ s (cumulative; F[r,S−1] = n_r)
  c[r,s] = F[r,s] − F[r,s−1]  layers of run r in stage s (an expression, ≥ 0)
  g[r,s] ∈ {0,1}               run r has started by stage s
  u[r,q,k] ∈ {0..n_r} integer  layers of run r on pipeline rank q (all its chunks) under mode k
  z[q,k] ∈ {0,1}               rank q has a layer under mode k (k ≠ none, for the workspace; every k
                               when one mode per rank is asked)
  w[q] ≥ 0                     rank q's recompute workspace
  e[r,s] ≥ 0                   stage s ends inside run r (sets the size of the tensor sent on)
  t[q], T, E ≥ 0               rank time, bottleneck rank time, step tail (DP comm + optimizer)

Objective (docs/design.md §5; Narayanan et al. 2021 §2.2 for interleaving):
  minimise a·T + (1/v)·Σ_q t[q] + E,  a = m − 1/v (InnerProblem.bottleneck_slots; for interleaving with a
  group N ≠ p, the makespan of its order in units of T, cost_models.pipeline_order)
  which for v = 1 is (m − 1)·max_q T_q + Σ_q t[q] + E: m slots of the bottleneck rank plus the
  fill/drain of the other stages, divided by v when each rank holds v interleaved chunks (the stages'
  times only enter through their sums per rank and in all, so rank times suffice).

Constraints (the name prefix of each family, as it appears in the model):
  cum_{r}_{s}      F[r,s] ≥ F[r,s−1]                        stages take consecutive layers of a run
  started_{r}_{s}  g[r,s] ≤ F[r,s] ≤ n_r·g[r,s]             g is exactly "F > 0"
  order_{r}_{s}    F[r,s] ≥ n_r·g[r+1,s]                    run r+1 starts only after run r is complete
  nonempty_{s}     Σ_r c[r,s] ≥ 1                            every stage holds a layer
  chunk_lo/hi_{s}  ⌊L/S⌋ ≤ Σ_r c[r,s] ≤ ⌈L/S⌉  (v > 1 only)    interleaved chunks are near-equal
  split_{r}_{q}    Σ_k u[r,q,k] = Σ_{s≡q} c[r,s];  u[r,q,k] ≤ n_r·z[q,k]   (umode_{r}_{q}_{k})
  workspace_{q}_{k} w[q] ≥ W[k]·z[q,k]
  mode_{q}         Σ_k z[q,k] = 1   (only when InnerProblem.per_layer is False: one mode per rank)
  ends_{r}_{s}     e[r,s] ≥ g[r,s] − g[r+1,s]                the last layer of stage s is in run r
  rank_time_{q}    t[q] = Σ τ·u + Σ_{s≡q} (π(out, fwd) + π(in, bwd))   each stage sends its output forward
                                                             and its input gradient backward
  bottleneck_{q}   T ≥ t[q]
  tail_{q}         E ≥ Σ ω·c;  tail_dp_{q}: E ≥ Σ (ω + γ − β)·c + γ0   gradient reduction hides behind the
                                                             last micro-batch's backward (PyTorch DDP
                                                             bucketing, Li et al. VLDB 2020)
  memory_rank{q}   Σ_{r,k} (σ + φ[q]·a[r,k])·u[r,q,k] + w[q] ≤ M[q]
  bound_T, bound_E, bound_obj   T ≥ T*, E ≥ E_lb, objective ≥ LB   (optional; from `bound.tight_bound`)
                   valid inequalities: every feasible point satisfies them (the bound relaxes this model),
                   so the optimum is unchanged; they lift the LP relaxation, so an incumbent that meets LB
                   closes the search at the root. Should a bound ever exceed the optimum, the solution's
                   re-evaluation below disagrees with the ILP objective and `solve` raises.

Solving: HiGHS (CBC when HiGHS is missing) with relative gap 0, optionally warm-started from a feasible
solution (`autopar.planner.incumbent`) and with `cutoff_s` as an objective bound (branches that cannot
beat the best layout the search knows are pruned; then `solve` returns None). The returned cuts and modes are
re-priced by `autopar.planner.problem.evaluate`, which must agree with the ILP objective.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import lru_cache

import pulp

from autopar.planner.bound import Bound
from autopar.planner.problem import MODES, InnerProblem, InnerSolution, Run, StageEval, evaluate

__all__ = ["MODES", "Run", "InnerProblem", "InnerSolution", "StageEval", "evaluate", "solve", "select_solver"]


@lru_cache(maxsize=1)
def _has_highs() -> bool:
    return "HiGHS" in pulp.listSolvers(onlyAvailable=True)


_banner_silenced = False


@contextlib.contextmanager
def _first_highs_silenced() -> Iterator[None]:
    """The process's stdout (file descriptor 1) sent to /dev/null around the first `highspy.Highs()`.

    HiGHS's C++ constructor prints its banner ("Running HiGHS …") once per process to the C stdout, before
    any option (`output_flag`) can be set, so neither `msg=False` nor redirecting `sys.stdout` stops it; a
    library called from Python stays quiet unless asked. Later constructions print nothing, so they run as
    they are."""
    global _banner_silenced
    if _banner_silenced:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            try:
                yield
            finally:
                ctypes.CDLL(None).fflush(None)  # what the C library buffered goes to /dev/null, not later to fd 1
                os.dup2(saved, 1)
                _banner_silenced = True
    finally:
        os.close(saved)


class _HiGHSWarm(pulp.HiGHS):
    """pulp's in-process HiGHS, handed a feasible start (`highspy.Highs.setSolution`) before it runs."""

    def __init__(self, start: dict[str, float] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.start = start

    def createAndConfigureSolver(self, lp: pulp.LpProblem) -> None:  # noqa: N802 (pulp's name)
        with _first_highs_silenced():
            super().createAndConfigureSolver(lp)

    def callSolver(self, lp: pulp.LpProblem) -> None:  # noqa: N802 (pulp's name)
        if self.start:
            import highspy

            values = [0.0] * lp.solverModel.getNumCol()
            for var in lp.variables():
                values[var.index] = self.start.get(var.name, 0.0)
            sol = highspy.HighsSolution()
            sol.col_value = values
            sol.value_valid = True
            lp.solverModel.setSolution(sol)
        lp.solverModel.run()


def select_solver(time_limit_s: float, threads: int = 1, cutoff_s: float | None = None,
                  prefer: str | None = None, start: dict[str, float] | None = None) -> pulp.LpSolver:
    """HiGHS when installed, else CBC; both exact branch-and-cut with relative gap 0.
    `cutoff_s`: prune every branch that cannot beat this objective (the search's k-th best).
    `start`: variable name → value of a feasible solution to start from."""
    if prefer != "CBC" and _has_highs():
        extra = {"objective_bound": cutoff_s} if cutoff_s is not None else {}
        return _HiGHSWarm(start=start, msg=False, timeLimit=time_limit_s, gapRel=0.0, gapAbs=1e-9,
                          threads=threads, **extra)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=0.0, threads=threads,
                             warmStart=bool(start))


def start_values(problem: InnerProblem, sol: InnerSolution) -> dict[str, float]:
    """The ILP's variables at a feasible `sol` (names as in `solve`), for a warm start."""
    p, S, R = problem.num_ranks, problem.num_stages, len(problem.runs)
    of = [ri for ri, r in enumerate(problem.runs) for _ in range(r.count)]
    out: dict[str, float] = {}
    cum = [0] * R
    for st in sol.stages:
        s = st.index
        for i in range(st.first_layer, st.first_layer + st.num_layers):
            cum[of[i]] += 1
            key = f"u_{of[i]}_{st.rank}_{MODES.index(sol.layer_modes[i])}"
            out[key] = out.get(key, 0.0) + 1.0
            if sol.layer_modes[i] != MODES[0] or not problem.per_layer:
                out[f"z_{st.rank}_{MODES.index(sol.layer_modes[i])}"] = 1.0
        if s < S - 1:
            for r in range(R):
                out[f"F_{r}_{s}"] = float(cum[r])
                out[f"g_{r}_{s}"] = float(cum[r] > 0)
            out[f"e_{of[st.first_layer + st.num_layers - 1]}_{s}"] = 1.0
    rank_t = [sum(st.time_s for st in sol.stages if st.rank == q) for q in range(p)]
    for q in range(p):
        out[f"t_{q}"] = rank_t[q]
        used = {sol.layer_modes[i] for st in sol.stages if st.rank == q
                for i in range(st.first_layer, st.first_layer + st.num_layers)}
        out[f"w_{q}"] = max(problem.workspace_bytes(k) for k in used) / (max(problem.capacity_bytes) or 1.0)
    out["T"], out["E"] = max(rank_t), sol.tail_s
    return out


def solve(problem: InnerProblem, *, time_limit_s: float = 60.0, solver: pulp.LpSolver | None = None,
          cutoff_s: float | None = None, bound: Bound | None = None,
          start: InnerSolution | None = None) -> InnerSolution | None:
    """The exact optimum of the inner problem; None when no cut/recompute assignment fits memory or, with
    `cutoff_s`, when none beats that objective. `bound` (valid inequalities) and `start` (a feasible
    solution) only speed the proof up."""
    t0 = time.perf_counter()
    p, v, a, S = problem.num_ranks, problem.virtual_stages, problem.bottleneck_slots, problem.num_stages
    runs, R = problem.runs, len(problem.runs)
    if problem.num_layers < S:
        return None
    K = [MODES.index(k) for k in problem.modes]
    unit = max(problem.capacity_bytes) or 1.0  # memory rows in units of the largest capacity: RHS ≈ 1
    lp = pulp.LpProblem("stage_cuts", pulp.LpMinimize)
    F = {(r, s): (lp.add_variable(f"F_{r}_{s}", 0, runs[r].count, cat="Integer") if s < S - 1 else runs[r].count)
         for r in range(R) for s in range(S)}
    g = {(r, s): (lp.add_variable(f"g_{r}_{s}", cat="Binary") if s < S - 1 else 1) for r in range(R) for s in range(S)}
    u = {(r, q, k): lp.add_variable(f"u_{r}_{q}_{k}", 0, runs[r].count, cat="Integer")
         for r in range(R) for q in range(p) for k in K}
    ws = {k: problem.workspace_bytes(MODES[k]) / unit for k in K}
    z = {(q, k): lp.add_variable(f"z_{q}_{k}", cat="Binary") for q in range(p) for k in K
         if ws[k] > 0 or not problem.per_layer}
    w = {q: lp.add_variable(f"w_{q}", 0) for q in range(p)}
    e = {(r, s): lp.add_variable(f"e_{r}_{s}", 0) for r in range(R) for s in range(S - 1)}
    t = {q: lp.add_variable(f"t_{q}", 0) for q in range(p)}
    T, E = lp.add_variable("T", 0), lp.add_variable("E", 0)
    lp += a * T + pulp.lpSum(t.values()) * (1.0 / v) + E

    def c(r: int, s: int):
        return F[r, s] - F[r, s - 1] if s > 0 else F[r, s]

    send: dict[int, list] = {q: [] for q in range(p)}
    for s in range(S):
        for r in range(R):
            if 0 < s < S:
                lp += F[r, s] >= F[r, s - 1], f"cum_{r}_{s}"
            if s < S - 1:
                lp += g[r, s] <= F[r, s], f"started_lo_{r}_{s}"
                lp += F[r, s] <= runs[r].count * g[r, s], f"started_hi_{r}_{s}"
                if r + 1 < R:
                    lp += F[r, s] >= runs[r].count * g[r + 1, s], f"order_{r}_{s}"
                    lp += e[r, s] >= g[r, s] - g[r + 1, s], f"ends_{r}_{s}"
                else:
                    lp += e[r, s] >= g[r, s], f"ends_{r}_{s}"
        lp += pulp.lpSum(c(r, s) for r in range(R)) >= 1, f"nonempty_{s}"
        if v > 1:
            size = pulp.lpSum(c(r, s) for r in range(R))
            lp += size >= problem.num_layers // S, f"chunk_lo_{s}"
            lp += size <= -(-problem.num_layers // S), f"chunk_hi_{s}"
        if s < S - 1:
            send[s % p] += [runs[r].send_s[problem.inter_node[s]] * e[r, s] for r in range(R)]
        if s > 0:
            send[s % p] += [runs[r].send_s[problem.inter_node[s - 1]] * e[r, s - 1] for r in range(R)]
    for q in range(p):
        mine = range(q, S, p)
        for r in range(R):
            lp += pulp.lpSum(u[r, q, k] for k in K) == pulp.lpSum(c(r, s) for s in mine), f"split_{r}_{q}"
            for k in K:
                if (q, k) in z:
                    lp += u[r, q, k] <= runs[r].count * z[q, k], f"umode_{r}_{q}_{k}"
        for k in K:
            if (q, k) in z:
                lp += w[q] >= ws[k] * z[q, k], f"workspace_{q}_{k}"
        if not problem.per_layer:
            lp += pulp.lpSum(z[q, k] for k in K) == 1, f"mode_{q}"
        lp += t[q] == pulp.lpSum(runs[r].time_s[k] * u[r, q, k] for r in range(R) for k in K) + \
            pulp.lpSum(send[q]), f"rank_time_{q}"
        lp += t[q] <= T, f"bottleneck_{q}"
        opt = pulp.lpSum(runs[r].optimizer_s * c(r, s) for r in range(R) for s in mine)
        dp = pulp.lpSum((runs[r].grad_sync_s - runs[r].backward_s) * c(r, s) for r in range(R) for s in mine)
        lp += opt <= E, f"tail_{q}"
        lp += opt + dp + problem.grad_sync_latency_s <= E, f"tail_dp_{q}"
        mem = pulp.lpSum((runs[r].state_bytes + problem.inflight[q] * runs[r].act_bytes[k]) / unit * u[r, q, k]
                         for r in range(R) for k in K)
        lp += mem + w[q] <= problem.capacity_bytes[q] / unit, f"memory_rank{q}"
    if bound is not None and bound.value_s < float("inf"):
        slack = 1.0 - 1e-9  # float round-off of the bound must not cut the optimum
        lp += T - bound.bottleneck_s * slack >= 0, "bound_T"
        lp += E - bound.tail_s * slack >= 0, "bound_E"
        lp += a * T + pulp.lpSum(t.values()) * (1.0 / v) + E >= bound.value_s * slack, "bound_obj"
    warm = start_values(problem, start) if start is not None and start.feasible else None
    if warm and solver is None and not _has_highs():
        for var in lp.variables():
            var.setInitialValue(warm.get(var.name, 0.0))
    solver = solver or select_solver(time_limit_s, cutoff_s=cutoff_s, start=warm)
    lp.solve(solver)
    status = pulp.LpStatus[lp.status]
    if status != "Optimal" and lp.sol_status != pulp.LpSolutionIntegerFeasible:
        return None  # infeasible, or no integer solution within the time limit
    gap = 0.0
    model = getattr(lp, "solverModel", None)
    if model is not None and hasattr(model, "getInfo"):
        info_gap = model.getInfo().mip_gap
        gap = float(info_gap) if info_gap < float("inf") else 1.0
        gap = 0.0 if gap < 1e-9 else gap  # round-off of an exact optimum
        hs = model.getModelStatus().name
        if hs in ("kObjectiveBound", "kObjectiveTarget"):
            return None  # cannot beat cutoff_s: pruned
        if hs == "kTimeLimit":
            status = "time_limit"
    if cutoff_s is not None and pulp.value(lp.objective) > cutoff_s:
        return None  # HiGHS pruned every branch under the cutoff; what it kept cannot beat it
    counts = [sum(round(pulp.value(c(r, s))) for r in range(R)) for s in range(S)]
    layer_modes = _layer_modes(problem, counts, {key: round(pulp.value(var)) for key, var in u.items()})
    sol = evaluate(problem, tuple(counts), layer_modes=layer_modes)
    # the solver meets each constraint within its primal feasibility tolerance (HiGHS: 1e-7), and T ≥ t_i enters
    # the objective times a = m − 1 (up to hundreds of micro-batches): 1e-6 of the step was met and missed by
    # round-off alone (llama3-70b on 24 A100 nodes, 2.6e-6); a pricing mismatch between the ILP and evaluate is a
    # layer's worth, orders above this
    if abs(sol.objective_s - pulp.value(lp.objective)) > 1e-5 * max(1.0, sol.objective_s) and status == "Optimal":
        raise RuntimeError(f"ILP objective {pulp.value(lp.objective)} disagrees with its evaluation {sol.objective_s}")
    return _with_status(sol, "optimal" if status == "Optimal" else status.lower(), gap,
                        time.perf_counter() - t0)


def _layer_modes(problem: InnerProblem, counts: list[int], u: dict[tuple[int, int, int], int]) -> tuple[str, ...]:
    """Per layer, from the per-rank counts u[r,q,k]: each rank's layers of a run take the heavier modes
    first, in layer order (identical layers, so which ones does not change the objective; Megatron-LM's
    block method likewise recomputes the first layers of a stage)."""
    p = problem.num_ranks
    of = [ri for ri, r in enumerate(problem.runs) for _ in range(r.count)]
    queue: dict[tuple[int, int], list[int]] = {}  # (run, rank) → one mode index per layer, heaviest first
    for (r, q, k), n in sorted(u.items(), key=lambda item: -item[0][2]):
        queue.setdefault((r, q), []).extend([k] * n)
    out, pos = [], 0
    for s, n in enumerate(counts):
        for i in range(pos, pos + n):
            left = queue.get((of[i], s % p))
            out.append(MODES[left.pop(0) if left else 0])
        pos += n
    return tuple(out)


def _with_status(sol: InnerSolution, status: str, gap: float, seconds: float) -> InnerSolution:
    return replace(sol, status=status, gap=gap, solve_time_s=seconds)
