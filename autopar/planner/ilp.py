"""The inner problem of the planner as an integer linear program: stage cuts and per-stage recompute.

The outer search (`autopar.planner.search`) fixes tp, pp, dp, ZeRO stage, micro-batch size and count,
schedule, virtual stages and sequence parallelism. What remains is where to cut the layer sequence into
S = p·v contiguous stages (stage s runs on pipeline rank s mod p) and which recompute mode each pipeline
rank uses (with v = 1 a rank is a stage; with interleaving its v chunks share the mode, and all chunks
hold ⌊L/S⌋ or ⌈L/S⌉ layers, as Megatron-LM's interleaved schedule wants equal chunks — both rules also
remove the symmetric solutions that would otherwise make the ILP slow). This module takes numbers and
names only (no torch), so tests can check it against brute force.

Data. The layer sequence is a list of *runs*: run r is n_r consecutive identical layers (equal
signatures), so a cut inside a run only matters through how many of its layers fall on each side.
Per layer of run r and recompute mode k ∈ K (none, selective, full), per micro-batch:
  τ[r,k]   forward + backward (+ recompute) compute and tensor-parallel communication time, s
  a[r,k]   activation bytes kept per in-flight micro-batch
  σ[r]     model-state bytes (weights, grads, optimizer) per device
  β[r]     backward compute time (the window that hides gradient reduction), s
  γ[r]     data-parallel gradient/ZeRO communication time of the layer's parameters, s
  ω[r]     optimizer-step time of the layer's parameters, s
  π[r,x]   time to send the tensor crossing a cut after a layer of run r; x = intra/inter-node, s
Per rank q: in-flight micro-batches φ[q] (schedule-dependent) and memory capacity M[q] (device memory less
the allocator reserve and stage-independent terms). Workspace W[k] = max_r (a[r,none] − a[r,k]): the
activations that recomputing one layer materialises again (needed once per rank using mode k).

Variables (all per stage s = 0..S−1, run r, mode k):
  F[r,s] ∈ {0..n_r}  integer   layers of run r in stages ≤ s (cumulative; F[r,S−1] = n_r)
  c[r,s] = F[r,s] − F[r,s−1]  layers of run r in stage s (an expression, ≥ 0)
  g[r,s] ∈ {0,1}               run r has started by stage s
  z[q,k] ∈ {0,1}               pipeline rank q uses recompute mode k (all its chunks)
  y[r,s,k] ≥ 0                 layers of run r in stage s under mode k (integral because z is)
  e[r,s] ≥ 0                   stage s ends inside run r (sets the size of the tensor sent on)
  t[s], T, E ≥ 0               stage time, bottleneck rank time, step tail (DP comm + optimizer)

Objective (design.md §5; Narayanan et al. 2021 §2.2 for interleaving):
  minimise (m − 1/v)·T + (1/v)·Σ_s t[s] + E
  which for v = 1 is (m − 1)·max_q T_q + Σ_s t[s] + E: m slots of the bottleneck rank plus the
  fill/drain of the other stages, divided by v when each rank holds v interleaved chunks.

Constraints (the name prefix of each family, as it appears in the model):
  cum_{r}_{s}      F[r,s] ≥ F[r,s−1]                        stages take consecutive layers of a run
  started_{r}_{s}  g[r,s] ≤ F[r,s] ≤ n_r·g[r,s]             g is exactly "F > 0"
  order_{r}_{s}    F[r,s] ≥ n_r·g[r+1,s]                    run r+1 starts only after run r is complete
  nonempty_{s}     Σ_r c[r,s] ≥ 1                            every stage holds a layer
  mode_{q}         Σ_k z[q,k] = 1
  chunk_lo/hi_{s}  ⌊L/S⌋ ≤ Σ_r c[r,s] ≤ ⌈L/S⌉  (v > 1 only)    interleaved chunks are near-equal
  split_{r}_{s}    Σ_k y[r,s,k] = c[r,s];  y[r,s,k] ≤ n_r·z[s mod p,k]   (ymode_{r}_{s}_{k})
  ends_{r}_{s}     e[r,s] ≥ g[r,s] − g[r+1,s]                the last layer of stage s is in run r
  stage_time_{s}   t[s] = Σ τ·y + π(out, fwd) + π(in, bwd)   each stage sends its output forward and its
                                                             input gradient backward
  rank_time_{q}    T ≥ Σ_{s ≡ q} t[s]
  tail_{q}         E ≥ Σ ω·c;  tail_dp_{q}: E ≥ Σ (ω + γ − β)·c + γ0   gradient reduction hides behind the
                                                             last micro-batch's backward (PyTorch DDP
                                                             bucketing, Li et al. VLDB 2020)
  memory_rank{q}   Σ_{s≡q} Σ (σ + φ[q]·a[r,k])·y + Σ_k W[k]·z[q,k] ≤ M[q]
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pulp

__all__ = ["MODES", "Run", "InnerProblem", "InnerSolution", "StageEval", "evaluate", "solve", "select_solver"]

MODES = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class Run:
    """`count` consecutive identical layers; every number is per layer, per micro-batch, per device."""

    name: str
    count: int
    layer_names: tuple[str, ...]  # len == count
    time_s: tuple[float, float, float]  # τ by mode (none, selective, full)
    compute_s: tuple[float, float, float]  # of τ: forward + backward compute (no recompute, no comm)
    recompute_s: tuple[float, float, float]  # of τ: recompute compute and its tensor-parallel comm
    tp_comm_s: tuple[float, float, float]  # of τ: tensor-parallel comm of forward and backward
    act_bytes: tuple[float, float, float]  # a by mode, per in-flight micro-batch
    state_bytes: float  # σ
    backward_s: float  # β
    grad_sync_s: float  # γ
    optimizer_s: float  # ω
    send_s: tuple[float, float]  # π (intra-node, inter-node)

    def __post_init__(self) -> None:
        if self.count < 1 or len(self.layer_names) != self.count:
            raise ValueError(f"Run {self.name}: count={self.count} with {len(self.layer_names)} layer names")


@dataclass(frozen=True, kw_only=True)
class InnerProblem:
    runs: tuple[Run, ...]
    num_ranks: int  # p
    virtual_stages: int  # v
    num_microbatches: int  # m
    inflight: tuple[float, ...]  # φ per rank
    capacity_bytes: tuple[float, ...]  # M per rank
    inter_node: tuple[bool, ...]  # per boundary between stage s and s+1 (S−1 entries)
    modes: tuple[str, ...] = MODES  # allowed recompute modes
    grad_sync_latency_s: float = 0.0  # γ0: latency part of the gradient collectives (0 when dp = 1)

    def __post_init__(self) -> None:
        s = self.num_stages
        if len(self.inflight) != self.num_ranks or len(self.capacity_bytes) != self.num_ranks:
            raise ValueError("InnerProblem: inflight and capacity_bytes need one entry per pipeline rank")
        if len(self.inter_node) != s - 1:
            raise ValueError(f"InnerProblem: inter_node needs {s - 1} entries (one per stage boundary)")
        if not self.modes or any(k not in MODES for k in self.modes):
            raise ValueError(f"InnerProblem.modes={self.modes}; expected a non-empty subset of {MODES}")

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual_stages

    @property
    def num_layers(self) -> int:
        return sum(r.count for r in self.runs)

    def workspace_bytes(self, mode: str) -> float:
        k = MODES.index(mode)
        return max(r.act_bytes[0] - r.act_bytes[k] for r in self.runs)


@dataclass(frozen=True, kw_only=True)
class StageEval:
    index: int
    rank: int
    first_layer: int  # position in the layer sequence
    num_layers: int
    mode: str
    time_s: float
    compute_s: float
    recompute_s: float
    tp_comm_s: float
    pp_comm_s: float
    memory_bytes: float  # model states + activations (+ workspace) of this stage
    state_bytes: float
    act_bytes: float


@dataclass(frozen=True, kw_only=True)
class InnerSolution:
    """A cut vector and mode per stage, priced by `evaluate`; ILP status when it came from `solve`."""

    layers_per_stage: tuple[int, ...]
    modes: tuple[str, ...]
    objective_s: float
    pipeline_s: float  # (m − 1/v)·T + Σ t / v
    bottleneck_rank: int
    tail_s: float  # E
    tail_optimizer_s: float  # of E: the optimizer step on the rank that sets E
    stages: tuple[StageEval, ...]
    rank_memory_bytes: tuple[float, ...]
    feasible: bool
    violated: str = ""  # name of a violated constraint, "" when feasible
    status: str = "evaluated"
    gap: float = 0.0
    solve_time_s: float = 0.0


def _layer_run(problem: InnerProblem) -> list[int]:
    return [ri for ri, r in enumerate(problem.runs) for _ in range(r.count)]


def evaluate(problem: InnerProblem, layers_per_stage: tuple[int, ...], modes: tuple[str, ...]) -> InnerSolution:
    """Price one cut vector and recompute assignment with the ILP's objective, layer by layer."""
    p, v, m, S = problem.num_ranks, problem.virtual_stages, problem.num_microbatches, problem.num_stages
    if len(layers_per_stage) != S or len(modes) != S:
        raise ValueError(f"need {S} stages, got {len(layers_per_stage)} cuts and {len(modes)} modes")
    if sum(layers_per_stage) != problem.num_layers or min(layers_per_stage) < 1:
        raise ValueError(f"cuts {layers_per_stage} must be ≥ 1 each and sum to {problem.num_layers} layers")
    runs, of = problem.runs, _layer_run(problem)
    stages, pos = [], 0
    ranks_t = [0.0] * p
    mem = [0.0] * p
    used_modes: list[set[str]] = [set() for _ in range(p)]
    tail_opt, tail_dp = [0.0] * p, [problem.grad_sync_latency_s] * p
    for s, (n, mode) in enumerate(zip(layers_per_stage, modes, strict=False)):
        k, q = MODES.index(mode), s % p
        lay = [runs[of[i]] for i in range(pos, pos + n)]
        comp = sum(r.compute_s[k] for r in lay)
        rec = sum(r.recompute_s[k] for r in lay)
        tpc = sum(r.tp_comm_s[k] for r in lay)
        t = sum(r.time_s[k] for r in lay)
        ppc = 0.0
        if s < S - 1:
            ppc += lay[-1].send_s[problem.inter_node[s]]
        if s > 0:
            ppc += runs[of[pos - 1]].send_s[problem.inter_node[s - 1]]
        state = sum(r.state_bytes for r in lay)
        act = sum(r.act_bytes[k] for r in lay) * problem.inflight[q]
        ranks_t[q] += t + ppc
        mem[q] += state + act
        used_modes[q].add(mode)
        tail_opt[q] += sum(r.optimizer_s for r in lay)
        tail_dp[q] += sum(r.grad_sync_s - r.backward_s for r in lay)
        stages.append(StageEval(index=s, rank=q, first_layer=pos, num_layers=n, mode=mode, time_s=t + ppc,
                                compute_s=comp, recompute_s=rec, tp_comm_s=tpc, pp_comm_s=ppc,
                                memory_bytes=state + act, state_bytes=state, act_bytes=act))
        pos += n
    for q in range(p):
        mem[q] += sum(problem.workspace_bytes(k) for k in used_modes[q])
    b = max(range(p), key=lambda q: ranks_t[q])
    T = ranks_t[b]
    pipeline = (m - 1.0 / v) * T + sum(st.time_s for st in stages) / v
    tails = [max(tail_opt[q], tail_opt[q] + tail_dp[q]) for q in range(p)]
    qe = max(range(p), key=lambda q: tails[q])
    violated = ""
    for s, mode in enumerate(modes):
        if mode not in problem.modes:
            violated = f"mode_{s} (recompute {mode!r} not allowed)"
    for s in range(p, S):
        if modes[s] != modes[s - p]:
            violated = violated or f"mode_{s % p} (chunks of one rank share a recompute mode)"
    if v > 1 and max(layers_per_stage) - min(layers_per_stage) > 1:
        violated = violated or "chunk_lo/hi (interleaved chunks differ by at most one layer)"
    for q in range(p):
        if mem[q] > problem.capacity_bytes[q] * (1 + 1e-6):
            violated = violated or f"memory_rank{q}"
    return InnerSolution(layers_per_stage=tuple(layers_per_stage), modes=tuple(modes),
                         objective_s=pipeline + tails[qe], pipeline_s=pipeline, bottleneck_rank=b,
                         tail_s=tails[qe], tail_optimizer_s=tail_opt[qe], stages=tuple(stages),
                         rank_memory_bytes=tuple(mem), feasible=not violated, violated=violated)


def select_solver(time_limit_s: float, threads: int = 1, cutoff_s: float | None = None,
                  prefer: str | None = None) -> pulp.LpSolver:
    """HiGHS when installed, else CBC. HiGHS solved the benchmark ILPs faster in
    `python benchmarks/plan_speed.py --solvers` (both are exact branch-and-cut; relative gap set to 0).
    `cutoff_s`: prune every branch that cannot beat this objective (the search's incumbent)."""
    if prefer != "CBC" and "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        extra = {"objective_bound": cutoff_s} if cutoff_s is not None else {}
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=0.0, gapAbs=1e-9, threads=threads, **extra)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=0.0, threads=threads)


def solve(problem: InnerProblem, *, time_limit_s: float = 60.0, solver: pulp.LpSolver | None = None,
          cutoff_s: float | None = None) -> InnerSolution | None:
    """The exact optimum of the inner problem; None when no cut/recompute assignment fits memory or, with
    `cutoff_s`, when none beats that objective."""
    t0 = time.perf_counter()
    p, v, m, S = problem.num_ranks, problem.virtual_stages, problem.num_microbatches, problem.num_stages
    runs, R = problem.runs, len(problem.runs)
    if problem.num_layers < S:
        return None
    K = [MODES.index(k) for k in problem.modes]
    unit = max(problem.capacity_bytes) or 1.0  # memory rows in units of the largest capacity: RHS ≈ 1
    lp = pulp.LpProblem("stage_cuts", pulp.LpMinimize)
    F = {(r, s): (lp.add_variable(f"F_{r}_{s}", 0, runs[r].count, cat="Integer") if s < S - 1 else runs[r].count)
         for r in range(R) for s in range(S)}
    g = {(r, s): (lp.add_variable(f"g_{r}_{s}", cat="Binary") if s < S - 1 else 1) for r in range(R) for s in range(S)}
    z = {(q, k): lp.add_variable(f"z_{q}_{k}", cat="Binary") for q in range(p) for k in K}
    y = {(r, s, k): lp.add_variable(f"y_{r}_{s}_{k}", 0) for r in range(R) for s in range(S) for k in K}
    e = {(r, s): lp.add_variable(f"e_{r}_{s}", 0) for r in range(R) for s in range(S - 1)}
    t = {s: lp.add_variable(f"t_{s}", 0) for s in range(S)}
    T, E = lp.add_variable("T", 0), lp.add_variable("E", 0)
    lp += (m - 1.0 / v) * T + pulp.lpSum(t.values()) * (1.0 / v) + E

    def c(r: int, s: int):
        return F[r, s] - F[r, s - 1] if s > 0 else F[r, s]

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
            lp += pulp.lpSum(y[r, s, k] for k in K) == c(r, s), f"split_{r}_{s}"
            for k in K:
                lp += y[r, s, k] <= runs[r].count * z[s % p, k], f"ymode_{r}_{s}_{k}"
        lp += pulp.lpSum(c(r, s) for r in range(R)) >= 1, f"nonempty_{s}"
        if v > 1:
            size = pulp.lpSum(c(r, s) for r in range(R))
            lp += size >= problem.num_layers // S, f"chunk_lo_{s}"
            lp += size <= -(-problem.num_layers // S), f"chunk_hi_{s}"
        send = []
        if s < S - 1:
            send += [runs[r].send_s[problem.inter_node[s]] * e[r, s] for r in range(R)]
        if s > 0:
            send += [runs[r].send_s[problem.inter_node[s - 1]] * e[r, s - 1] for r in range(R)]
        lp += t[s] == pulp.lpSum(runs[r].time_s[k] * y[r, s, k] for r in range(R) for k in K) + pulp.lpSum(send), \
            f"stage_time_{s}"
    for q in range(p):
        mine = range(q, S, p)
        lp += pulp.lpSum(z[q, k] for k in K) == 1, f"mode_{q}"
        lp += pulp.lpSum(t[s] for s in mine) <= T, f"rank_time_{q}"
        opt = pulp.lpSum(runs[r].optimizer_s * c(r, s) for r in range(R) for s in mine)
        dp = pulp.lpSum((runs[r].grad_sync_s - runs[r].backward_s) * c(r, s) for r in range(R) for s in mine)
        lp += opt <= E, f"tail_{q}"
        lp += opt + dp + problem.grad_sync_latency_s <= E, f"tail_dp_{q}"
        mem = pulp.lpSum((runs[r].state_bytes + problem.inflight[q] * runs[r].act_bytes[k]) / unit * y[r, s, k]
                         for r in range(R) for s in mine for k in K)
        ws = pulp.lpSum(problem.workspace_bytes(MODES[k]) / unit * z[q, k] for k in K if k != 0)
        lp += mem + ws <= problem.capacity_bytes[q] / unit, f"memory_rank{q}"
    solver = solver or select_solver(time_limit_s, cutoff_s=cutoff_s)
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
    modes = tuple(MODES[max(K, key=lambda k, q=s % p: pulp.value(z[q, k]))] for s in range(S))
    sol = evaluate(problem, tuple(counts), modes)
    if abs(sol.objective_s - pulp.value(lp.objective)) > 1e-6 * max(1.0, sol.objective_s) and status == "Optimal":
        raise RuntimeError(f"ILP objective {pulp.value(lp.objective)} disagrees with its evaluation {sol.objective_s}")
    return _with_status(sol, "optimal" if status == "Optimal" else status.lower(), gap,
                        time.perf_counter() - t0)


def _with_status(sol: InnerSolution, status: str, gap: float, seconds: float) -> InnerSolution:
    from dataclasses import replace

    return replace(sol, status=status, gap=gap, solve_time_s=seconds)
