"""Exact search over the whole space: enumerate outer candidates, solve ILPs in lower-bound order.

Branch and bound over the outer candidates, with bounds refined lazily in a priority queue:
  level −1 every candidate enters with its floor (`_floor_s`: its passes' and collectives' least time and
           its optimizer step from terms cached per tp, micro-batch, ep, …, before its problem is built:
           most candidates of a large space never get further, and never get their runs priced);
  level 0  when popped, its problem is built and it re-enters with the cheap bound (`bound.lower_bound`);
  level 1  when popped, it gets the tight bound (`bound.tight_bound`) and re-enters with it;
  level 2  when popped again, it gets a feasible incumbent (`incumbent.incumbent`, only here: most
           tight bounds end above the window, and those candidates never need one): if it meets its tight
           bound, that is its optimum; if its bound exceeds the best objective known (the lead), it cannot
           win and its incumbent stays as a runner-up; otherwise its ILP (`ilp.solve`) is solved exactly,
           warm-started from the incumbent, with the tight bound as valid inequalities and the lead as cutoff.
With `PlannerOptions(objective="pessimistic")` every key and objective of a candidate is its step time
times the slow end of its error band (`band.pessimism`, one factor per outer candidate, so bounds stay
bounds and the order of the search is the same argument).
The search stops when the next key in the queue exceeds the (top_k+1)-th best objective known: no
candidate left can beat the best or enter the runner-ups. The best is the exact optimum of the modelled
step time over the space (gap 0): every candidate whose bound lies below it had its ILP solved or its
optimum met by its incumbent. Runner-ups are real layouts priced at a feasible stage assignment, their
exact optimum where the search needed it, else their incumbent (an upper bound on it): proving each
runner-up optimal would cost as many ILPs again and change no choice.
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from autopar.capture.sequence import sequence_parallel_expert_conflict, sequence_parallel_refusal
from autopar.config import OFFLOAD_MODES, ParallelConfig, PlannerOptions
from autopar.errors import InfeasiblePlanError
from autopar.planner.band import pessimism
from autopar.planner.bound import Bound, lower_bound, tight_bound
from autopar.planner.costs import CostModel
from autopar.planner.fp8_costs import check_fp8_device, fp8_recipes
from autopar.planner.ilp import select_solver, solve
from autopar.planner.incumbent import incumbent
from autopar.planner.problem import MODES, InnerProblem, InnerSolution, evaluate, mode_label
from autopar.planner.rules import cp_invalid, layout_notes, tp_invalid
from autopar.planner.space import Candidate, enumerate_candidates, expert_degrees_invalid

__all__ = ["Solved", "SearchResult", "search", "price"]

_GiB = float(1 << 30)


@dataclass(frozen=True, kw_only=True)
class Solved:
    candidate: Candidate
    solution: InnerSolution
    # the rules of thumb this layout breaks, as pinned (autopar.planner.rules.layout_notes): kept in its estimate
    notes: tuple[str, ...] = ()

    @property
    def objective_s(self) -> float:
        return self.solution.objective_s

    @property
    def config(self) -> ParallelConfig:
        return self.candidate.config(mode_label(self.solution.layer_modes))


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    best: Solved
    alternatives: tuple[Solved, ...]
    status: str  # "optimal" | "time_limit"
    gap: float  # relative gap between the best and the lowest bound left unexplored
    solver: str
    configs_considered: int  # outer candidates enumerated (each with its own stage-cut ILP)
    ilps_solved: int
    solve_time_s: float  # wall time of the whole search
    ilp_time_s: float = 0.0  # of which inside `ilp.solve`


def _modes(options: PlannerOptions) -> tuple[str, ...]:
    return (options.recompute,) if options.recompute else tuple(k for k in MODES if k not in options.exclude_recompute)


def _fp8_choices(costs: CostModel, options: PlannerOptions) -> tuple[str, ...]:
    """The FP8 recipes to consider: the pinned one (refused on a device without FP8), else every one the
    device runs beside "none" (--fp8 auto)."""
    if options.fp8 is not None:
        check_fp8_device(costs.device, options.fp8, options.fp8_runtime)
        return (options.fp8,)
    return ("none", *fp8_recipes(costs.device, options.fp8_runtime))


def _offload_choices(costs: CostModel, options: PlannerOptions) -> tuple[str, ...]:
    """The offload modes to consider: the pinned one (refused without a host), else every mode the host allows.
    On CPU devices the host is the device's own memory, so offload frees nothing: only pinned there (to run the
    mechanics), never chosen."""
    if options.offload is not None:
        costs.memory.offload.check(options.offload)
        return (options.offload,)
    return OFFLOAD_MODES if costs.memory.offload.host is not None and costs.device.kind != "cpu" else ("none",)


def _host_fitting(costs: CostModel, cands: list[Candidate]) -> list[Candidate]:
    """The candidates whose host states fit the node's host memory; raises when none does."""
    fits = [(c, *costs.memory.host_fits(c)) for c in cands]
    kept = [c for c, ok, _ in fits if ok]
    if not kept:
        c, _, need = min(fits, key=lambda x: x[2])
        cap = costs.memory.offload.host_capacity_bytes
        raise InfeasiblePlanError(
            f"no offload layout's host states fit the node's host memory: the leanest ({c.config('none')}) needs "
            f"{need / _GiB:,.0f} GiB per node, {cap / _GiB:,.0f} GiB are usable; use more nodes or --offload none")
    return kept


def _grouped_where_needed(cands: list[Candidate], problem: Callable[[Candidate], InnerProblem],
                          options: PlannerOptions) -> list[Candidate]:
    """The candidates, those with a micro-batch group N below torch's (interleaving) only where the same layout
    with torch's N = pp cannot fit memory: a smaller N is slower (its order stalls while a group's first
    micro-batch goes round the pipeline, cost_models.pipeline_order) and only holds less."""
    if options.microbatch_group is not None or all(c.microbatch_group is None for c in cands):
        return cands
    torch_n = {c for c in cands if c.microbatch_group is None}
    fits: dict[Candidate, bool] = {}
    kept = []
    for c in cands:
        base = replace(c, microbatch_group=None)
        if c.microbatch_group is not None and base in torch_n:
            if base not in fits:
                fits[base] = tight_bound(problem(base)).value_s < float("inf")
            if fits[base]:
                continue
        kept.append(c)
    return kept


def search(costs: CostModel, *, global_batch_size: int, options: PlannerOptions, floors: bool = True) -> SearchResult:
    """The exact optimum of the modelled step time over the space (module docstring); floors=False enters
    every candidate at key 0 instead of its floor (`_floor_s`): the same result, slower (for tests)."""
    t0 = time.perf_counter()
    cands = enumerate_candidates(costs.graph, world_size=costs.world_size, devices_per_node=costs.devices_per_node,
                                 global_batch_size=global_batch_size, options=options,
                                 fp8s=_fp8_choices(costs, options), offloads=_offload_choices(costs, options),
                                 precision=costs.precision.name)
    cands = _host_fitting(costs, cands)
    modes = _modes(options)
    built: dict[Candidate, InnerProblem] = {}

    def problem_of(c: Candidate) -> InnerProblem:
        if c not in built:
            built[c] = costs.problem(c, modes, options.recompute_per_layer)
        return built[c]

    cands = _grouped_where_needed(cands, problem_of, options)
    # the objective's factor per candidate: 1 for the fastest layout, the band's slow end for the pessimistic one
    scale = [pessimism(costs, tp=c.tp, pp=c.pp, zero_stage=c.zero_stage) if options.objective == "pessimistic"
             else 1.0 for c in cands]
    heap = [(_floor_s(costs, c) * scale[i] if floors else 0.0, i, -1) for i, c in enumerate(cands)]
    heapq.heapify(heap)
    keep = options.top_k + 1
    found: dict[int, Solved] = {}  # candidate → its best known solution: exact optimum, else incumbent
    ranked: list[float] = []  # sorted (scaled) objectives of `found`; ranked[0] is the best known
    tight: dict[int, Bound] = {}
    solved, status, open_bound, ilp_time = 0, "optimal", float("inf"), 0.0
    solver_name = type(select_solver(1.0)).__name__.replace("PULP_CBC_CMD", "CBC").replace("_HiGHSWarm", "HiGHS")

    def offer(i: int, sol: InnerSolution) -> None:
        old = found.get(i)
        if old is None or sol.objective_s < old.objective_s:
            if old is not None:
                ranked.remove(old.objective_s * scale[i])
            found[i] = Solved(candidate=cands[i], solution=sol, notes=_notes(costs, cands[i], options))
            bisect.insort(ranked, sol.objective_s * scale[i])

    while heap:
        key, i, level = heapq.heappop(heap)
        window = ranked[keep - 1] * (1 + 1e-9) if len(ranked) >= keep else float("inf")
        if key == float("inf") or key > window:
            break
        if time.perf_counter() - t0 > options.time_limit_s and found:
            status, open_bound = "time_limit", key
            break
        if level == -1:
            if floors and costs.over_memory(cands[i], modes):
                continue  # its cheap bound is +inf
            pr = problem_of(cands[i])
            lb = lower_bound(pr) * scale[i]
            if lb < float("inf"):
                heapq.heappush(heap, (max(key, lb), i, 0))
            continue
        pr = problem_of(cands[i])
        if level == 0:
            bnd = tight_bound(pr)
            if bnd.value_s == float("inf"):
                continue
            tight[i] = bnd
            heapq.heappush(heap, (max(key, bnd.value_s * scale[i]), i, 1))
            continue
        bnd = tight.pop(i)
        inc = incumbent(pr, bnd)
        if inc is not None:
            offer(i, inc)
        lead = ranked[0] * (1 + 1e-9) if ranked else float("inf")
        if key > lead or (inc is not None and inc.objective_s <= bnd.value_s * (1 + 1e-9)):
            continue  # it cannot beat the lead (its incumbent, if any, stays a runner-up), or its incumbent
            # meets its bound: that is its optimum
        left = options.time_limit_s - (time.perf_counter() - t0)
        t_ilp = time.perf_counter()
        sol = solve(pr, time_limit_s=max(left, 1.0), cutoff_s=lead / scale[i] if lead < float("inf") else None,
                    bound=bnd, start=inc)
        ilp_time += time.perf_counter() - t_ilp
        solved += 1
        if sol is None:
            continue
        if sol.status != "optimal":
            status = "time_limit"
        offer(i, sol)
    index = {id(c): i for i, c in enumerate(cands)}
    top = sorted(found.values(), key=lambda s: s.objective_s * scale[index[id(s.candidate)]])[:keep]
    if not top:
        hint = ("; or let the planner keep model states in host memory (--offload auto, PlannerOptions(offload=None))"
                if options.offload == "none" and costs.memory.offload.host is not None else "")
        raise InfeasiblePlanError(_why_infeasible(costs, [(c, problem_of(c)) for c in cands]) + hint)
    best = top[0]
    best_key = best.objective_s * scale[index[id(best.candidate)]]
    gap = 0.0 if status == "optimal" else max(0.0, (best_key - open_bound) / best_key)
    gap = max(gap, best.solution.gap)
    return SearchResult(best=best, alternatives=tuple(top[1:]), status=status, gap=gap, solver=solver_name,
                        configs_considered=len(cands), ilps_solved=solved, solve_time_s=time.perf_counter() - t0,
                        ilp_time_s=ilp_time)


def _notes(costs: CostModel, c: Candidate, options: PlannerOptions) -> tuple[str, ...]:
    return layout_notes(costs.graph, cp=c.cp, virtual_stages=c.virtual_stages,
                        max_virtual_stages=options.max_virtual_stages, tp=c.tp)


def _floor_s(costs: CostModel, c: Candidate) -> float:
    """A lower bound on c's step time from CostModel.floor, before its problem is built: the objective
    a·T + Σt/v + E with Σt ≥ W, T ≥ W/p and E ≥ Ω/p (the bottleneck and the tail are at least their rank
    averages), a = m − 1/v under torch's order, else (a shorter group) 0 ≤ a."""
    work, opt = costs.floor(c)
    a = c.num_microbatches - 1 / c.virtual_stages if c.microbatch_group is None else 0.0
    return a * work / c.pp + work / c.virtual_stages + opt / c.pp


def price(costs: CostModel, config: ParallelConfig, options: PlannerOptions | None = None,
          layer_modes: tuple[str, ...] | None = None, layers_per_stage: tuple[int, ...] | None = None) -> Solved:
    """The planner's objective for one given layout. By default its best stage cuts (an ILP) with
    `config.recompute` on every layer; with `layers_per_stage` and `layer_modes` (a plan's own stages)
    exactly those cuts and per-layer modes, evaluated without search. A layout over memory comes back
    priced with `solution.feasible` False and the memory row it breaks (by default on even cuts); other
    violations raise InfeasiblePlanError naming the constraint."""
    _check_layout(costs, config)
    notes = _notes(costs, Candidate.of(config), options or PlannerOptions())
    check_fp8_device(costs.device, config.fp8, costs.memory.fp8_runtime)
    costs.memory.offload.check(config.offload)
    if config.precision != costs.precision.name:
        raise InfeasiblePlanError(f"layout {config} is in precision {config.precision}, but these costs price "
                                  f"{costs.precision.name}; build the CostModel with precision={config.precision!r}")
    cand = Candidate.of(config)
    if layers_per_stage is not None or layer_modes is not None:
        if layers_per_stage is None or layer_modes is None:
            raise InfeasiblePlanError("price a layout's own stages with both layers_per_stage and layer_modes")
        pr = costs.problem(cand, tuple(sorted(set(layer_modes), key=MODES.index)))
        try:
            sol = evaluate(pr, tuple(layers_per_stage), layer_modes=tuple(layer_modes))
        except ValueError as e:
            raise InfeasiblePlanError(f"layout {config} with stages {layers_per_stage}: {e}") from None
        if not sol.feasible and not sol.violated.startswith("memory_"):
            raise InfeasiblePlanError(f"layout {config} with {layers_per_stage} layers per stage and recompute "
                                      f"{layer_modes} violates constraint {sol.violated}")
        return Solved(candidate=cand, solution=sol, notes=notes)  # over memory: priced, with feasible False
    pr = costs.problem(cand, (config.recompute,))
    bnd = tight_bound(pr)
    sol = None
    if bnd.value_s < float("inf"):
        sol = solve(pr, time_limit_s=options.time_limit_s if options else 60.0, bound=bnd,
                    start=incumbent(pr, bnd))
    if sol is None:  # over memory everywhere: price its evenly cut stages, marked as not fitting
        sol = evaluate(pr, _even_cuts(pr.num_layers, pr.num_stages), layer_modes=(config.recompute,) * pr.num_layers)
        if sol.feasible:  # the ILP found nothing, yet even cuts fit: should not happen; keep the old message
            raise InfeasiblePlanError(_why_layout_infeasible(costs, cand, pr, bnd))
    return Solved(candidate=cand, solution=sol, notes=notes)


def _even_cuts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage as even as possible (the larger stages last, where the LM head's rank has no
    embedding): what a layout that does not fit is priced with."""
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (1 if s >= num_stages - extra else 0) for s in range(num_stages))


def _check_layout(costs: CostModel, c: ParallelConfig) -> None:
    g, world = costs.graph, costs.world_size
    if c.world_size != world:
        raise InfeasiblePlanError(f"layout {c} uses tp·cp·pp·dp = {c.world_size} devices but the cluster has {world}; "
                                  f"choose degrees whose product is {world}")
    if why := tp_invalid(g, c.tp, devices_per_node=costs.devices_per_node, world_size=world):
        raise InfeasiblePlanError(f"layout {c}: {why}")
    if why := cp_invalid(g, c.cp):
        raise InfeasiblePlanError(f"layout {c}: {why}")
    if why := expert_degrees_invalid(g, c.ep, c.etp):
        raise InfeasiblePlanError(f"layout {c}: {why}")
    if c.sequence_parallel and (why := sequence_parallel_refusal(g, c.tp)
                                or sequence_parallel_expert_conflict(g, c.ep, c.etp)):
        raise InfeasiblePlanError(f"layout {c}: sequence parallelism is not possible: {why}; set "
                                  "sequence_parallel=False")
    if c.pp * c.virtual_stages > g.num_layers:
        raise InfeasiblePlanError(f"pp·v = {c.pp * c.virtual_stages} stages exceed the {g.num_layers} layers of "
                                  f"{g.model_name}; lower pp or virtual_stages")


def _lean_need_bytes(costs: CostModel, pr: InnerProblem) -> float:
    """Per-device bytes the layout needs at least: pooled lean model states and activations + fixed terms."""
    phi = min(pr.inflight)
    lean = sum(r.count * min(r.state_bytes + phi * r.act_bytes[MODES.index(k)] for k in pr.modes) for r in pr.runs)
    fixed = sum(costs.memory.usable_bytes - cap for cap in pr.capacity_bytes)
    return (lean + fixed) / pr.num_ranks


def _why_layout_infeasible(costs: CostModel, c: Candidate, pr: InnerProblem, bnd: Bound) -> str:
    need = _lean_need_bytes(costs, pr)
    row = f"memory_rank{bnd.infeasible_rank}" if bnd.infeasible_rank >= 0 else "memory_rank*"
    return (f"layout {c.config(pr.modes[0])} does not fit: constraint {row} (per-device memory of pipeline rank "
            f"{max(bnd.infeasible_rank, 0)}) is violated; "
            f"it needs at least {need / _GiB:.1f} GiB per device but {costs.device.name} offers "
            f"{costs.memory.usable_bytes / _GiB:.1f} GiB after the reserve; raise tp/pp, the ZeRO stage or recompute")


def _why_infeasible(costs: CostModel, problems: list[tuple[Candidate, InnerProblem]]) -> str:
    c, pr = min(problems, key=lambda x: _lean_need_bytes(costs, x[1]))
    need = _lean_need_bytes(costs, pr)
    factor = need / costs.memory.usable_bytes
    return (f"no layout of {costs.graph.model_name} fits on {costs.world_size} × {costs.device.name}: the binding "
            f"constraint is memory_rank* (per-device memory); the leanest layout ({c.config(pr.modes[-1])}) needs "
            f"at least {need / _GiB:.1f} GiB per device, {costs.memory.usable_bytes / _GiB:.1f} GiB are usable. Use "
            f"about {max(2, int(factor + 0.999))}× as many devices, a device with more memory, or unpin options")
