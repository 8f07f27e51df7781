"""Turns a solved layout into the public `Estimate`, `StagePlan`s and `Plan`.

Breakdown of the step (sums to step_time_s exactly): the bottleneck rank b runs m micro-batches,
m·T_b, split into compute / recompute / tp_comm / pp_comm by b's own shares; the fill and drain of the
other stages, (Σ_s t_s − T_b)/v, is the pipeline bubble; the tail after the flush is exposed
data-parallel communication plus the optimizer step.
"""

from __future__ import annotations

from autopar.capture.sequence import sequence_parallel_refusal, sequence_span
from autopar.plan import Estimate, Plan, SolverInfo, StagePlan
from autopar.planner.band import layout_band
from autopar.planner.costs import CostModel
from autopar.planner.ilp import MODES
from autopar.planner.search import SearchResult, Solved
from cost_models import memory
from cost_models.pipeline_order import bottleneck_slots

__all__ = ["build_estimate", "build_stages", "build_plan"]


def _rank_totals(solved: Solved, costs: CostModel) -> tuple[list[float], list[dict[str, int]]]:
    sol, c = solved.solution, solved.candidate
    pr_ws = costs.problem(c, MODES)
    names = _stage_layer_names(costs, sol.layers_per_stage)
    by_rank: list[list[str]] = [[] for _ in range(c.pp)]
    acts, ws = [0.0] * c.pp, [0.0] * c.pp
    used: list[set[str]] = [set() for _ in range(c.pp)]
    for st in sol.stages:
        by_rank[st.rank] += names[st.index]
        acts[st.rank] += st.act_bytes
        used[st.rank].update(st.layer_modes)
    for q in range(c.pp):  # layers recompute one at a time: the largest workspace of the rank's modes
        ws[q] = max(pr_ws.workspace_bytes(k) for k in used[q])
    breakdown = costs.memory.memory_breakdown(c, by_rank, acts, ws)
    return [float(sum(b.values())) for b in breakdown], breakdown


def _stage_layer_names(costs: CostModel, layers_per_stage: tuple[int, ...]) -> list[list[str]]:
    names = [la.name for la in costs.graph.layers]
    out, pos = [], 0
    for n in layers_per_stage:
        out.append(names[pos:pos + n])
        pos += n
    return out


def build_estimate(solved: Solved, costs: CostModel) -> Estimate:
    sol, c = solved.solution, solved.candidate
    m, v = c.num_microbatches, c.virtual_stages
    mine = [st for st in sol.stages if st.rank == sol.bottleneck_rank]
    T = sum(st.time_s for st in mine)
    breakdown = {
        "compute": m * sum(st.compute_s for st in mine),
        "recompute": m * sum(st.recompute_s for st in mine),
        "tp_comm": m * sum(st.tp_comm_s for st in mine),
        "pp_comm": m * sum(st.pp_comm_s for st in mine),
        # a micro-batch group N ≠ p adds its order's stalls to Narayanan et al.'s (p − 1)/v bubble
        "pipeline_bubble": (sum(st.time_s for st in sol.stages) - T) / v + (
            0.0 if c.microbatch_group is None else (bottleneck_slots(c.pp, v, m, c.microbatch_group) - m + 1 / v) * T),
        "dp_comm": sol.tail_s - sol.tail_optimizer_s,
        "optimizer": sol.tail_optimizer_s,
    }
    host = m * sum(st.host_s for st in mine) + sol.tail_optimizer_host_s
    step = sum(breakdown.values())  # equals sol.objective_s up to rounding; the breakdown must sum exactly
    g = costs.graph
    batch = c.config("none").global_batch_size
    model_flops = batch * (g.forward_flops + g.backward_flops)
    world = costs.world_size
    peak = costs.device.peak_flops_for(g.dtype)
    totals, by_rank = _rank_totals(solved, costs)
    top = max(range(len(totals)), key=lambda q: totals[q])
    band = layout_band(costs, tp=c.tp, pp=c.pp, zero_stage=c.zero_stage)
    return Estimate(step_time_s=step, tokens_per_s=batch * (g.seq_len or 1) / step,
                    tflops_per_device=model_flops / step / world / 1e12, mfu=model_flops / (step * world * peak),
                    peak_memory_bytes=int(max(totals)), breakdown=breakdown, host_s=host,
                    fits=sol.feasible, violated=sol.violated, memory_breakdown=dict(by_rank[top]),
                    memory_capacity_bytes=int(costs.memory.usable_bytes),
                    reserved_bytes=int(memory.reserved_bytes(max(totals), costs.memory.usable_bytes)),
                    notes=solved.notes + _eager_note(costs, c) + _batch_norm_note(costs, c) + _sequence_note(costs, c),
                    **({} if band is None else {"band_lo": band.lo, "band_hi": band.hi, "band_runs": band.runs,
                                                "band_basis": band.basis}))


def _eager_note(costs: CostModel, c) -> tuple[str, ...]:
    """A note when the model's blocks run unfused eager kernels that take a visible share of the time."""
    if getattr(c, "compile", False):
        return ()
    count, share = costs.compute.eager_memory_share(tp=c.tp, sp=c.sequence_parallel, mbs=c.tokens_share)
    if share < 0.05:
        return ()
    return (f"unfused eager kernels: each block runs {count} memory-bound kernels per forward (norms, "
            f"activations, rotary, residuals), each reading and writing HBM: {share:.0%} of its compute, priced "
            "so; fused kernels or compiled blocks (--compile) would spend less",)


def _sequence_note(costs: CostModel, c) -> tuple[str, ...]:
    """Under tp: why sequence parallelism is off when the model cannot use it, or which layers run on the full
    sequence under it (capture.sequence.sequence_span)."""
    if c.tp <= 1:
        return ()
    if not c.sequence_parallel:
        why = sequence_parallel_refusal(costs.graph, c.tp)
        return (f"sequence parallelism off: {why}",) if why else ()
    whole = sequence_span(costs.graph, c.tp).whole_layers
    if not whole:
        return ()
    names = ", ".join(whole[:3]) + (", ..." if len(whole) > 3 else "")
    many = len(whole) > 1
    return (f"sequence parallelism: {len(whole)} layer{'s' if many else ''} ({names}) {'run' if many else 'runs'} "
            "on the full sequence (attention tensor parallelism keeps whole): all-gathered at their input and "
            "split after, priced so",)


def _batch_norm_note(costs: CostModel, c) -> tuple[str, ...]:
    """What batch norm computes under this layout, and where its synchronisation is priced."""
    norms = sum(len(la.batch_norm_channels) for la in costs.graph.layers)
    if not norms:
        return ()
    per_stat = c.dp * c.micro_batch_size
    if c.dp == 1:
        return (f"batch norm: {norms} modules compute their statistics on each micro-batch of "
                f"{c.micro_batch_size} samples (no data parallelism: nothing to synchronise)",)
    return (f"batch norm: {norms} modules synchronise their statistics over the {c.dp} data-parallel ranks "
            f"every micro-batch ({c.dp}·{c.micro_batch_size} = {per_stat} samples per statistic, as one process "
            f"on those micro-batches), 4 all-reduces each per micro-batch, priced in tp_comm",)


def build_stages(solved: Solved, costs: CostModel) -> tuple[StagePlan, ...]:
    sol = solved.solution
    names = _stage_layer_names(costs, sol.layers_per_stage)
    totals, breakdown = _rank_totals(solved, costs)
    return tuple(StagePlan(index=st.index, layers=tuple(names[st.index]), pp_rank=st.rank, recompute=st.mode,
                           time_per_microbatch_s=st.time_s, peak_memory_bytes=int(totals[st.rank]),
                           memory_breakdown=dict(breakdown[st.rank]),
                           layer_recompute=st.layer_modes if len(set(st.layer_modes)) > 1 else ())
                 for st in sol.stages)


def build_plan(result: SearchResult, costs: CostModel, *, cluster_name: str, cluster_fingerprint: str,
               global_batch_size: int, graph_fingerprint: str | None = None,
               router_skew: float | None = None) -> Plan:
    """The plan of `result`. graph_fingerprint: the captured model's (default: the priced graph's), which
    differs from the priced one where `router_skew` set the MoE layers' load imbalance."""
    best = result.best
    return Plan(config=best.config, stages=build_stages(best, costs), estimate=build_estimate(best, costs),
                model_name=costs.graph.model_name, graph_fingerprint=graph_fingerprint or costs.graph.fingerprint,
                router_skew=router_skew, loss_mode=costs.graph.loss_mode,
                cluster_name=cluster_name, cluster_fingerprint=cluster_fingerprint,
                global_batch_size=global_batch_size, seq_len=costs.graph.seq_len,
                solver=SolverInfo(status=result.status, gap=result.gap, solver=result.solver,
                                  solve_time_s=result.solve_time_s, configs_considered=result.configs_considered,
                                  ilps_solved=result.ilps_solved, ilp_time_s=result.ilp_time_s),
                alternatives=tuple((a.config, build_estimate(a, costs)) for a in result.alternatives))
